"""torch.empty + free of 4 KiB and of mixed sizes, per allocator path, each
in a fresh process, interleaved, repeated: the C++ class's direct path, the
same class on the pluggable base's malloc/free path, the CUDAPluggableAllocator
fallback (no class), and PyTorch's native allocator. Prints medians and the
spread (min-max) of the repeats, in us per pair.

    PYTHONPATH=python CUDAPOOL_LIBRARY=lib/libcudapool.so python3 gpu/bench_class_paths.py [REPEATS]
"""
import json
import os
import statistics
import subprocess
import sys

CHILD = r'''
import os, sys, time, json
mode = sys.argv[1]
if mode != "native":
    import cudapool
    cudapool.install(cpp_class=(mode != "pluggable"))
import torch
torch.cuda.init()
def run(sizes, n):
    dev = torch.device("cuda")
    for s in sizes[:256]:
        torch.empty(s, dtype=torch.uint8, device=dev)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    k = len(sizes)
    for i in range(n):
        torch.empty(sizes[i % k], dtype=torch.uint8, device=dev)
    return (time.perf_counter() - t0) / n * 1e6
import random
rng = random.Random(1)
mixed = [int(512 * 2 ** rng.uniform(0, 15)) for _ in range(4096)]
import statistics
out = {"hot": statistics.median(run([4096], 200000) for _ in range(3)), "mixed": statistics.median(run(mixed, 100000) for _ in range(3))}
print("RESULT " + json.dumps(out))
'''

MODES = [("class", {}), ("class, pluggable base path", {"CUDAPOOL_TORCH_EXT_FAST": "0"}),
         ("pluggable (no class)", {}), ("native", {})]
ARG = {"class": "class", "class, pluggable base path": "class", "pluggable (no class)": "pluggable", "native": "native"}


def main():
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    res = {m: {"hot": [], "mixed": []} for m, _ in MODES}
    for r in range(reps):
        for m, env in MODES:
            e = dict(os.environ, **env)
            out = subprocess.run([sys.executable, "-c", CHILD, ARG[m]], env=e, capture_output=True, text=True, timeout=300)
            line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
            if not line:
                print(f"{m}: failed\n{out.stderr[-2000:]}")
                return 1
            d = json.loads(line[0][7:])
            for k in d:
                res[m][k].append(d[k])
    print(f"torch.empty + free, us per pair: median of {reps} fresh processes (min-max)")
    print(f"{'path':32} {'4 KiB':>20} {'mixed 512 B-16 MiB':>22}")
    for m, _ in MODES:
        cells = []
        for k in ("hot", "mixed"):
            v = res[m][k]
            cells.append(f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})")
        print(f"{m:32} {cells[0]:>20} {cells[1]:>22}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
