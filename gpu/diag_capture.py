"""Where a CUDA graph capture's time goes, per allocator (issue 11).

    PYTHONPATH=python CUDAPOOL_LIBRARY=lib/libcudapool.so python3 gpu/diag_capture.py [REPS] [CAPTURES]

Each configuration (native, cudapool, and both with expandable segments) runs
in REPS fresh processes, interleaved. A process builds bench/model.py's GPT-2
small (bf16, eval), runs the forward eagerly on a side stream (cuBLAS and the
caches warm), then captures the same forward CAPTURES times, each into a new
graph and private pool, timing the phases of torch.cuda.graph by hand:
  prep     gc.collect + synchronize + empty_cache (what graph.__enter__ does)
  empty    of which empty_cache alone
  begin    capture_begin (the allocator's beginAllocateToPool, cudaStreamBeginCapture)
  forward  the captured forward (allocations into the new pool)
  end      capture_end (cudaStreamEndCapture, instantiation, endAllocateToPool)
  sync     torch.cuda.synchronize after it
Medians over the captures of all processes, ms: the first capture of each
process (one-off costs) in a table of its own, the later ones in another.
Each capture starts after the previous graph was deleted; DIAG_KEEP=1 keeps
every graph instead (as bench/torch_bench.py's graph section does).
DIAG_CONFIGS (a space-separated list) narrows the configurations, or adds
cudapool_exp_nofront (expandable segments with the front cache off).
A table gives what each later capture's private pool took (memory_stats:
reserved MiB, driver allocations, allocations).
For cudapool, a last table gives what its front cache did during each
later capture (cudapool.front_counters: hits, of which in the capture's
pool, blocks left untracked in cold mode, cold verdicts).
DIAG_TIMING=1 times cudapool's calls in each capture (cudapool._ext.timing):
its allocate() calls during the captured forward (their number, sum, median,
and the median of their call into the library alone), its
begin/endAllocateToPool hooks and PyTorch's stream filter (calls, median),
in a third table.
"""
import json
import os
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = r'''
import gc, json, os, statistics, sys, time
cfg, n = sys.argv[1], int(sys.argv[2])
sys.path.insert(0, os.path.join(REPO, "bench"))
if cfg.startswith("cudapool"):
    sys.path.insert(0, os.path.join(REPO, "python"))
    import cudapool
    cudapool.install()
    if cfg == "cudapool_exp":
        cudapool.configure("expandable_segments:True")
    elif cfg == "cudapool_exp_nofront":
        cudapool.configure("expandable_segments:True,front_cache:False")
elif cfg == "expandable":
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
import torch
from model import GPT
from torch_bench import warm_forward
torch.manual_seed(0)
model = GPT(layers=12).cuda().to(torch.bfloat16).eval()
x = torch.randint(0, 16384, (8, 512), device="cuda")
phases = {k: [] for k in ("prep", "empty", "begin", "forward", "end", "sync", "total")}
first = {}
keep = os.environ.get("DIAG_KEEP") == "1"
graphs = []
timed = os.environ.get("DIAG_TIMING") == "1" and cfg.startswith("cudapool")
if timed:
    from cudapool import _ext
with torch.no_grad():
    warm_forward(torch, model, x)
    if timed:
        _ext.timing(True)
    for i in range(n):
        if not keep:
            graphs.clear()
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        pc = time.perf_counter
        f0 = cudapool.front_counters(0) if cfg.startswith("cudapool") else None
        m0 = torch.cuda.memory_stats()
        t0 = pc()
        gc.collect(); torch.cuda.synchronize()
        te = pc()
        torch.cuda.empty_cache()
        t1 = pc()
        with torch.cuda.stream(s):
            g.capture_begin()
            t2 = pc()
            y = model(x)
            t3 = pc()
            g.capture_end()
            t4 = pc()
        torch.cuda.synchronize()
        t5 = pc()
        m1 = torch.cuda.memory_stats()
        if i > 0:  # what the capture's pool took: reserved MiB, driver allocations
            phases.setdefault("m_pool_mib", []).append(
                (m1["reserved_bytes.all.current"] - m0["reserved_bytes.all.current"]) / 2**20)
            phases.setdefault("m_device_allocs", []).append(m1["num_device_alloc"] - m0["num_device_alloc"])
            phases.setdefault("m_allocs", []).append(
                m1["allocation.all.allocated"] - m0["allocation.all.allocated"])
        if f0 is not None and i > 0:  # the front cache during the capture
            f1 = cudapool.front_counters(0)
            for k in f1:
                phases.setdefault("f_" + k, []).append(f1[k] - f0[k])
        for k, v in zip(phases, (t1 - t0, t1 - te, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - t0)):
            if i > 0:
                phases[k].append(v * 1e3)
            else:
                first["first_" + k] = [v * 1e3]
        if timed:
            c = _ext.timing_take()
            a, lib = c[("cudapool", "alloc")][0], c[("cudapool", "alloc_lib")][0]
            t = {"allocs": [len(a)], "alloc_sum": [sum(a) / 1e6],
                 "alloc_med_us": [statistics.median(a) / 1e3 if a else 0],
                 "lib_med_us": [statistics.median(lib) / 1e3 if lib else 0],
                 "begin_us": [sum(c[("cudapool", "begin_pool")][0]) / 1e3],
                 "end_us": [sum(c[("cudapool", "end_pool")][0]) / 1e3],
                 "filters": [len(c[("cudapool", "filter")][0])],
                 "filter_med_us": [statistics.median(c[("cudapool", "filter")][0]) / 1e3
                                   if c[("cudapool", "filter")][0] else 0]}
            for k, v in t.items():
                if i > 0:
                    phases.setdefault("t_" + k, []).extend(v)
        graphs.append((g, y))  # deleted before the next capture unless DIAG_KEEP=1
        del g, y
phases.update(first)
print("RESULT " + json.dumps(phases))
'''.replace("REPO", repr(REPO))

CONFIGS = os.environ.get("DIAG_CONFIGS", "native cudapool expandable cudapool_exp").split()


def main():
    args = [a for a in sys.argv[1:]]
    reps = int(args[0]) if args else 2
    n = int(args[1]) if len(args) > 1 else 6
    env = dict(os.environ)
    for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CUDAPOOL_CONF"):
        env.pop(k, None)
    res = {c: {} for c in CONFIGS}
    for r in range(reps):
        for c in CONFIGS:
            out = subprocess.run([sys.executable, "-c", CHILD, c, str(n)], env=env, capture_output=True,
                                 text=True, timeout=240)
            line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
            if not line:
                print(f"{c}: failed\n{out.stderr[-2000:]}")
                continue
            for k, v in json.loads(line[0][7:]).items():
                res[c].setdefault(k, []).extend(v)
            print(f"  run {r + 1} {c}: total " + " ".join(f"{v:.1f}" for v in res[c]["total"][-(n - 1):]), flush=True)
    keys = ("prep", "empty", "begin", "forward", "end", "sync", "total")
    for title, pre in ((f"first capture of each process, ms: median (min-max) over {reps} processes", "first_"),
                       (f"later captures, ms: median (min-max) over {reps} processes x {n - 1} captures", "")):
        print(f"\n{title}")
        print(f"{'config':14}" + "".join(f"{k:>20}" for k in keys))
        for c in CONFIGS:
            cells = []
            for k in keys:
                v = res[c].get(pre + k) or []
                f = ".3f" if k in ("empty", "begin") else ".2f"  # tenths of a ms
                cells.append(f"{statistics.median(v):{f}} ({min(v):{f}}-{max(v):{f}})" if v else "-")
            print(f"{c:14}" + "".join(f"{x:>20}" for x in cells))
    tkeys = ("allocs", "alloc_sum", "alloc_med_us", "lib_med_us", "begin_us", "end_us", "filters", "filter_med_us")
    cudapool_table(res, "what each later capture's pool took: median (min-max)", "m_",
                   ("pool_mib", "device_allocs", "allocs"), ".0f")
    cudapool_table(res, "cudapool's calls per later capture (DIAG_TIMING): median (min-max); alloc_sum in ms",
                   "t_", tkeys, ".2f")
    cudapool_table(res, "cudapool's front cache per later capture: median (min-max)", "f_",
                   ("hits", "pool_hits", "cold_skipped", "cold_verdicts"), ".0f")


def cudapool_table(res, title, pre, keys, fmt):
    """Prints the per-capture values res[config][pre + key] of the configs that have them."""
    configs = [c for c in CONFIGS if res[c].get(pre + keys[0])]
    if not configs:
        return
    print(f"\n{title}")
    print(f"{'config':14}" + "".join(f"{k:>20}" for k in keys))
    for c in configs:
        cells = [f"{statistics.median(v):{fmt}} ({min(v):{fmt}}-{max(v):{fmt}})" for v in (res[c][pre + k] for k in keys)]
        print(f"{c:14}" + "".join(f"{x:>20}" for x in cells))

if __name__ == "__main__":
    main()
