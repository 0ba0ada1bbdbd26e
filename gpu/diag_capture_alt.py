"""CUDA graph captures by PyTorch's allocator and by cudapool, alternating in
one process (issue 11; docs/hot-path.md section 23).

    PYTHONPATH=python CUDAPOOL_LIBRARY=lib/libcudapool.so python3 gpu/diag_capture_alt.py [PROCS] [PAIRS]

The graph row of bench/torch_bench.py compares processes, which meet the host
in different states (docs/hot-path.md, sections 7 and 17). Here one process
captures the same forward (bench/model.py's GPT-2 small, bf16, batch 8 x seq
512, as the graph row) by both allocators in turn: cudapool's C++ class,
with passthrough on (cudapool._ext.passthrough), hands torch.empty's
allocations, empty_cache and the capture's private pool to PyTorch's
allocator it replaced. The captures are those of the benchmark's alt section
(bench/torch_bench.py's alt_captures: PAIRS pairs after one discarded capture
of each, who goes first alternating, every graph kept, each capture into a
new pool, as in the graph row); this script looks inside each one.

With DIAG_TIMING=1 (the default) both sides' calls are timed in place
(cudapool._ext.timing): allocate() and the deleter during the captured
forward, empty_cache and begin/endAllocateToPool; "outside" is the forward's
time less its allocate() and deleter calls, what PyTorch itself took around
them. DIAG_TIMING=0 times the phases only (the calls then carry no timing
code). DIAG_LIBS (space-separated paths of libcudapool.so) compares builds:
their processes take turns, one table each. DIAG_CONF gives both allocators
the same settings (PYTORCH_CUDA_ALLOC_CONF syntax), e.g.
expandable_segments:True for the expandable capture row.

Prints per pair the ratio cudapool/native of each phase (enter: synchronize,
empty_cache, capture_begin; forward; exit: capture_end and instantiation;
sync; total), the median over each process's pairs, and a last table of the
medians (min-max) over the processes' medians.
"""
import json
import os
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = r'''
import json, os, sys
pairs = int(sys.argv[1])
sys.path.insert(0, os.path.join(REPO, "bench"))
sys.path.insert(0, os.path.join(REPO, "python"))
import cudapool
cudapool.install()
from cudapool import _ext
import torch
import torch_bench
timed = os.environ.get("DIAG_TIMING", "1") == "1"


def before(side):
    if timed:
        _ext.timing_take()  # what came before the capture's clock


def after(side, row):
    if not timed:
        return
    c = _ext.timing_take()
    a, f = c[(side, "alloc")][0], c[(side, "free")][0]
    # allocate() in bands: under 1 us (a cache hit), 1-20 us (a miss served
    # from cached memory), over 20 us (a driver allocation): count and sum.
    bands = ((0, 1e3), (1e3, 20e3), (20e3, float("inf")))
    for (lo, hi), name in zip(bands, ("hit", "miss", "driver")):
        v = [x for x in a if lo <= x < hi]
        row[name + "_n"], row[name + "_sum"] = len(v), sum(v) / 1e6
    row.update(allocs=len(a), alloc_sum=sum(a) / 1e6, frees=len(f), free_sum=sum(f) / 1e6,
               empty_cache=sum(c[(side, "empty_cache")][0]) / 1e6,
               begin_pool=sum(c[(side, "begin_pool")][0]) / 1e6,
               end_pool=sum(c[(side, "end_pool")][0]) / 1e6)
    row["outside"] = row["forward"] - row["alloc_sum"] - row["free_sum"]


args = torch_bench.parse_args(["cudapool", "--sections", "alt", "--alt-captures", str(pairs)])
if timed:
    _ext.timing(True)
out = torch_bench.alt_captures(torch, args, _ext, before=before, after=after)
if timed:
    _ext.timing(False)
print("RESULT " + json.dumps(out["alt_capture_rows"]))
'''.replace("REPO", repr(REPO))

PHASES = ("enter", "forward", "exit", "sync", "total")
CALLS = ("empty_cache", "begin_pool", "alloc_sum", "hit_sum", "miss_sum", "driver_sum", "free_sum", "outside",
         "end_pool")
COUNTS = ("allocs", "hit_n", "miss_n", "driver_n")


def med(v):
    return statistics.median(v) if v else float("nan")


def pair_up(rows):
    """Pairs the captures in order: (native row, cudapool row) per pair."""
    out = []
    for a, b in zip(rows[0::2], rows[1::2]):
        n, c = (a, b) if a["side"] == "native" else (b, a)
        if (n["side"], c["side"]) == ("native", "cudapool"):
            out.append((n, c))
    return out


def run_proc(env, pairs):
    """One process's pairs, or None (its stderr printed)."""
    out = subprocess.run([sys.executable, "-c", CHILD, str(pairs)], env=env, capture_output=True, text=True,
                         timeout=300)
    line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    if not line:
        print(f"{env.get('CUDAPOOL_LIBRARY')}: a process failed\n{out.stderr[-3000:]}", flush=True)
        return None
    return pair_up(json.loads(line[0][7:]))


def summarize(ps):
    """A process's medians over its pairs: per-phase ratios, per-side times."""
    m = {}
    for k in PHASES:
        m[k] = med([c[k] / n[k] for n, c in ps])
    for k in PHASES + CALLS:
        if k in ps[0][0]:
            m["native_" + k] = med([n[k] for n, _ in ps])
            m["cudapool_" + k] = med([c[k] for _, c in ps])
    for k in COUNTS:
        if k in ps[0][0]:
            m["native_" + k] = med([n[k] for n, _ in ps])
            m["cudapool_" + k] = med([c[k] for _, c in ps])
    return m


def report(label, per_proc):
    print(f"\n{label}: {len(per_proc)} processes; per process the median over its pairs, then the median "
          f"(min-max) over the processes")
    print(f"{'':24}{'cudapool/native':>22}")
    for k in PHASES:
        v = [m[k] for m in per_proc]
        print(f"{k:24}{med(v):>10.3f} ({min(v):.3f}-{max(v):.3f})")
    keys = [k for k in PHASES + CALLS if "native_" + k in per_proc[0]]
    print(f"\n{'ms per capture':24}{'native':>24}{'cudapool':>24}{'difference':>12}")
    for k in keys:
        nv = [m["native_" + k] for m in per_proc]
        cv = [m["cudapool_" + k] for m in per_proc]
        cell = lambda v: f"{med(v):.3f} ({min(v):.3f}-{max(v):.3f})"
        print(f"{k:24}{cell(nv):>24}{cell(cv):>24}{med(cv) - med(nv):>+12.3f}")
    if "native_allocs" in per_proc[0]:
        print("allocate() calls per captured forward (all; under 1 us; 1-20 us; over 20 us): " + ", ".join(
            f"{side} " + " / ".join(f"{med([m[side + '_' + k] for m in per_proc]):.0f}" for k in COUNTS)
            for side in ("native", "cudapool")))


def main():
    procs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    pairs = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    # DIAG_LIBS: several builds of the library, their processes interleaved.
    libs = os.environ.get("DIAG_LIBS", "").split() or [os.environ.get("CUDAPOOL_LIBRARY", "lib/libcudapool.so")]
    env = dict(os.environ)
    for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CUDAPOOL_CONF"):
        env.pop(k, None)
    # DIAG_CONF: settings for both allocators (PyTorch's reads them at its
    # first use, cudapool at install), e.g. expandable_segments:True.
    conf = os.environ.get("DIAG_CONF", "")
    if conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
        print(f"both allocators: PYTORCH_CUDA_ALLOC_CONF={conf}", flush=True)
    per_lib = {lib: [] for lib in libs}
    for r in range(procs):
        for lib in libs:
            ps = run_proc(dict(env, CUDAPOOL_LIBRARY=lib), pairs)
            if not ps:
                continue
            m = summarize(ps)
            per_lib[lib].append(m)
            print(f"{lib} process {r + 1}, {len(ps)} pairs, cudapool/native (median of per-pair ratios): " +
                  " ".join(f"{k} {m[k]:.3f}" for k in PHASES), flush=True)
    if not any(per_lib.values()):
        sys.exit(1)
    for lib, per_proc in per_lib.items():
        if per_proc:
            report(lib, per_proc)


if __name__ == "__main__":
    main()
