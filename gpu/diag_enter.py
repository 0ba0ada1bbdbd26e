"""Where a capture's enter phase goes, per allocator (issue 11; docs/hot-path.md 15, 17).

    PYTHONPATH=python CUDAPOOL_LIBRARY=lib/libcudapool.so python3 gpu/diag_enter.py MODE REPS N

By turns the enter phase of torch.cuda.graph (synchronize, gc.collect,
empty_cache, capture_begin) takes cudapool 1.22-1.28x native's 0.25-0.30 ms:
empty_cache and the beginAllocateToPool hook run with the caches cold.
This times those calls, and capture_end, alone in a loop, per configuration
(DIAG_CONFIGS, default "native cudapool"; cudapool_nofront: front_cache:False;
cudapool_cold: warm_runtime:False, capi/warm's keeper off;
cudapool_sched: GODEBUG=schedtrace in the child's first environment, which
keeps the Go runtime's sysmon out of its deep sleep),
in REPS fresh processes each, interleaved. MODE:
  gpt   each iteration captures bench/model.py's GPT-2 forward (batch 8 x 512)
        into a new graph after gc.collect + synchronize, as the benchmark's
        graph section does; the last DIAG_KEEP graphs are kept (default 6:
        older ones are released, so empty_cache frees their pools, for every
        allocator alike; 0: all, as the benchmark does).
  tiny  each iteration captures two small ops instead, after evicting the
        caches by writing a byte of every line of 64 MiB (no gc.collect: with
        torch loaded it takes tens of ms); the last DIAG_KEEP graphs are kept. For a
        CPU profile of the library (a build with -tags cudapool_cpuprofile
        and CUDAPOOL_CPUPROFILE=FILE). Not yet run to its end: a first try
        with gc.collect in every iteration ran past 6 minutes at 3,000.
Medians (min-max over processes' medians) in us of: empty (empty_cache),
begin (capture_begin: the allocator's hook and cudaStreamBeginCapture), end
(capture_end), and for cudapool with DIAG_TIMING=1 the hooks alone as timed
inside the library's class. The first 3 iterations of a process are left out.
"""
import json
import os
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = r'''
import collections, gc, json, os, statistics, sys, time
cfg, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.path.insert(0, os.path.join(REPO, "bench"))
if cfg.startswith("cudapool"):
    sys.path.insert(0, os.path.join(REPO, "python"))
    import cudapool
    cudapool.install()
    conf = {"cudapool_nofront": "front_cache:False", "cudapool_cold": "warm_runtime:False"}.get(cfg)
    if conf:
        cudapool.configure(conf)
import torch
timed = os.environ.get("DIAG_TIMING") == "1" and cfg.startswith("cudapool")
if timed:
    from cudapool import _ext
torch.manual_seed(0)
if mode == "gpt":
    from model import GPT
    from torch_bench import warm_forward
    model = GPT(layers=12).cuda().to(torch.bfloat16).eval()
    x = torch.randint(0, 16384, (8, 512), device="cuda")
    with torch.no_grad():
        warm_forward(torch, model, x)
    work = lambda: model(x)
    evict = lambda: gc.collect()
else:
    import numpy as np
    a = torch.randn(256, 1024, device="cuda")
    w = torch.randn(1024, 1024, device="cuda")
    work = lambda: torch.relu(a @ w) + 1
    for _ in range(3):
        work()
    big = np.zeros(64 << 20, dtype=np.uint8)
    def evict():  # no gc.collect: with torch loaded it takes tens of ms
        big[::64] += 1
torch.cuda.synchronize()
pc = time.perf_counter_ns
res = {"empty": [], "begin": [], "end": [], "hook_begin": [], "hook_end": []}
keep = collections.deque(maxlen=int(os.environ.get("DIAG_KEEP", "6")) or None)
s = torch.cuda.Stream()
if timed:
    _ext.timing(True)
with torch.no_grad():
    for i in range(n):
        g = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        evict()
        t0 = pc()
        torch.cuda.empty_cache()
        t1 = pc()
        with torch.cuda.stream(s):
            g.capture_begin()
            t2 = pc()
            y = work()
            t3 = pc()
            g.capture_end()
            t4 = pc()
        torch.cuda.synchronize()
        keep.append((g, y))
        del g, y
        c = _ext.timing_take() if timed else None
        if i < 3:
            continue
        res["empty"].append((t1 - t0) / 1e3)
        res["begin"].append((t2 - t1) / 1e3)
        res["end"].append((t4 - t3) / 1e3)
        if c:
            res["hook_begin"].append(sum(c[("cudapool", "begin_pool")][0]) / 1e3)
            res["hook_end"].append(sum(c[("cudapool", "end_pool")][0]) / 1e3)
print("RESULT " + json.dumps(res))
'''.replace("REPO", repr(REPO))

CONFIGS = os.environ.get("DIAG_CONFIGS", "native cudapool").split()
KEYS = ("empty", "begin", "end", "hook_begin", "hook_end")


def main():
    if len(sys.argv) != 4 or sys.argv[1] not in ("gpt", "tiny"):
        sys.exit(__doc__.split("\n\n")[1])
    mode, reps, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    env = dict(os.environ)
    for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CUDAPOOL_CONF"):
        env.pop(k, None)
    meds = {c: {k: [] for k in KEYS} for c in CONFIGS}
    for r in range(reps):
        for c in CONFIGS:
            e = dict(env)
            if c == "cudapool_sched":  # read at the library's load, from the process's first environment
                e["GODEBUG"] = ",".join(filter(None, (e.get("GODEBUG"), "schedtrace=2147483647")))
            if c != "native" and os.environ.get("DIAG_PROFILE_DIR"):  # one profile per process
                e["CUDAPOOL_CPUPROFILE"] = os.path.join(os.environ["DIAG_PROFILE_DIR"], f"enter_{mode}_{c}_{r + 1}.prof")
            out = subprocess.run([sys.executable, "-c", CHILD, c, mode, str(n)], env=e, capture_output=True,
                                 text=True, timeout=300)
            line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
            if not line:
                print(f"{c}: failed\n{out.stderr[-2000:]}")
                continue
            d = json.loads(line[0][7:])
            for k in KEYS:
                if d[k]:
                    meds[c][k].append(statistics.median(d[k]))
            print(f"  {mode} run {r + 1} {c}: " + " ".join(
                f"{k} {statistics.median(d[k]):.1f}" for k in KEYS if d[k]), flush=True)
    print(f"\n{mode}: us per call, median (min-max) of {reps} processes' medians of {n - 3} iterations")
    print(f"{'config':18}" + "".join(f"{k:>22}" for k in KEYS))
    for c in CONFIGS:
        cells = [f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})" if v else "-" for v in meds[c].values()]
        print(f"{c:18}" + "".join(f"{x:>22}" for x in cells))


if __name__ == "__main__":
    main()
