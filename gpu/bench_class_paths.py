# SPDX-License-Identifier: Apache-2.0
"""torch.empty + free per allocator path, each in a fresh process, interleaved,
repeated: the C++ class's direct path, the same class on the pluggable base's
malloc/free path (and, with --modes, the benchmark's build of the class with
frees made at once, bench/bench_ext.py), the CUDAPluggableAllocator fallback
(no class), the floor (a trivial C allocator behind CUDAPluggableAllocator:
PyTorch's own cost of the pluggable path, bench/floor_alloc.c), and
PyTorch's native allocator.
Prints medians and the spread (min-max) of the repeats, in us per pair.

Columns: 4 KiB pairs in a tight loop; mixed sizes 512 B-16 MiB; a 4 KiB pair
after the loop touched 2 MiB of other memory (as a Python program does
between allocations: the allocator's working set is evicted from L1/L2);
and one 4 KiB torch.empty after 10 ms of sleep (the thread spent that long
outside the allocator; docs/hot-path.md). The last two are medians of
single timed calls.

    PYTHONPATH=python CUDAPOOL_LIBRARY=lib/libcudapool.so FLOOR_LIB=build/bench/libfloor.so \
        python3 gpu/bench_class_paths.py [REPEATS] [--json FILE] [--modes a,b] [--pin CPUS] [--hot-only]

--modes keeps the paths whose names start with one of the comma-separated
prefixes; --pin CPUS runs every child on those CPUs (a list like 4-7, as
taskset takes it: sched_setaffinity before torch loads); --hot-only skips
the two single-call columns. Each child's figures are printed as it ends,
so that a bimodal spread shows which processes were slow.
"""
import json
import os
import statistics
import subprocess
import sys

CHILD = r'''
import os, sys, time, json, statistics, random
mode = sys.argv[1]
if os.environ.get("BENCH_PIN"):
    cpus = set()
    for part in os.environ["BENCH_PIN"].split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    os.sched_setaffinity(0, cpus)
import torch
if mode == "floor":
    a = torch.cuda.memory.CUDAPluggableAllocator(os.environ["FLOOR_LIB"], "floor_malloc", "floor_free")
    torch.cuda.memory.change_current_allocator(a)
elif mode == "bench":
    # The benchmark's build of the class (bench/bench_ext.py), for its
    # frees made at once (CUDAPOOL_TORCH_EXT_FAST=2).
    sys.path.insert(0, os.environ["BENCH_DIR"])
    import bench_ext
    bench_ext.install()
elif mode != "native":
    import cudapool
    cudapool.install(cpp_class=(mode != "pluggable"))
torch.cuda.init()
dev = torch.device("cuda")
def run(sizes, n):
    for s in sizes[:256]:
        torch.empty(s, dtype=torch.uint8, device=dev)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    k = len(sizes)
    for i in range(n):
        torch.empty(sizes[i % k], dtype=torch.uint8, device=dev)
    return (time.perf_counter() - t0) / n * 1e6
def single(prepare, n):
    # Median of single timed pairs, the clock's own cost subtracted.
    clock, pair = [], []
    pc = time.perf_counter_ns
    for _ in range(n):
        prepare()
        t0 = pc(); t1 = pc()
        torch.empty(4096, dtype=torch.uint8, device=dev)
        t2 = pc()
        clock.append(t1 - t0); pair.append(t2 - t1)
    return (statistics.median(pair) - statistics.median(clock)) / 1e3
evict = bytearray(2 << 20)
view = memoryview(evict)
ones = b"\x01" * (len(evict) // 64)
def touch():
    # Writes one byte per cache line: evict[::64] = ... touches every line.
    view[::64] = ones
rng = random.Random(1)
mixed = [int(512 * 2 ** rng.uniform(0, 15)) for _ in range(4096)]
out = {"hot": statistics.median(run([4096], 200000) for _ in range(3))}
if mode != "floor":  # the floor caches by exact size and never frees: no mixed loop
    out["mixed"] = statistics.median(run(mixed, 100000) for _ in range(3))
if not os.environ.get("BENCH_HOT_ONLY"):
    out["touched"] = single(touch, 3000)
    out["asleep"] = single(lambda: time.sleep(0.01), 100)
print("RESULT " + json.dumps(out))
'''

BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
MODES = [("class", {}), ("class, pluggable base path", {"CUDAPOOL_TORCH_EXT_FAST": "0"}),
         ("class, frees not queued", {"CUDAPOOL_TORCH_EXT_FAST": "2"}),
         ("class, GODEBUG=schedtrace", {"GODEBUG": "schedtrace=1000000000"}),
         ("pluggable (no class)", {}), ("floor (trivial C allocator)", {}), ("native", {})]
ARG = {"class": "class", "class, pluggable base path": "class", "class, frees not queued": "bench",
       "class, GODEBUG=schedtrace": "class", "pluggable (no class)": "pluggable",
       "floor (trivial C allocator)": "floor", "native": "native"}
# The default set; --modes picks others.
DEFAULT = ["class", "class, pluggable base path", "pluggable (no class)", "floor (trivial C allocator)", "native"]
COLS = [("hot", "4 KiB loop"), ("mixed", "mixed 512 B-16 MiB"), ("touched", "4 KiB, 2 MiB touched"),
        ("asleep", "4 KiB after 10 ms")]


def cell(v):
    if not v:
        return "-"
    return f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})"


def main():
    args = [a for i, a in enumerate(sys.argv[1:], 1)
            if not a.startswith("--") and sys.argv[i - 1] not in ("--json", "--modes", "--pin")]
    reps = int(args[0]) if args else 5
    json_out = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else None
    want = sys.argv[sys.argv.index("--modes") + 1].split(",") if "--modes" in sys.argv else None
    modes = [(m, env) for m, env in MODES if (ARG[m] != "floor" or os.environ.get("FLOOR_LIB")) and
             (any(m.startswith(w) for w in want) if want else m in DEFAULT)]
    pin = sys.argv[sys.argv.index("--pin") + 1] if "--pin" in sys.argv else ""
    hot_only = "--hot-only" in sys.argv
    if pin:
        print(f"every child pinned to CPUs {pin}")
    res = {m: {k: [] for k, _ in COLS} for m, _ in modes}
    for r in range(reps):
        for m, env in modes:
            e = dict(os.environ, BENCH_DIR=BENCH_DIR, **env)
            if pin:
                e["BENCH_PIN"] = pin
            if hot_only:
                e["BENCH_HOT_ONLY"] = "1"
            out = subprocess.run([sys.executable, "-c", CHILD, ARG[m]], env=e, capture_output=True, text=True, timeout=300)
            line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
            if not line:
                print(f"{m}: failed\n{out.stderr[-2000:]}")
                return 1
            d = json.loads(line[0][7:])
            print(f"  run {r + 1} {m}: " + ", ".join(f"{k} {v:.2f}" for k, v in d.items()), flush=True)
            for k in d:
                res[m][k].append(d[k])
    if json_out:
        with open(json_out, "w") as f:
            json.dump(res, f)
    print(f"torch.empty + free, us per pair: median of {reps} fresh processes (min-max)")
    print(f"{'path':30}" + "".join(f" {name:>22}" for _, name in COLS))
    for m, _ in modes:
        print(f"{m:30}" + "".join(f" {cell(res[m][k]):>22}" for k, _ in COLS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
