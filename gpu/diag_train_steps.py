"""Where the training row's time goes, step by step (issue 11).

    python3 gpu/diag_train_steps.py CONFIG      (native, expandable, cudapool, cudapool_exp)

bench/torch_bench.py timed 60 GPT-2 steps after 5 warm-up steps (until the
fifteenth session, which warms every timed length: bench/workloads.py); its blocks
of 10 steps spread 3-7x, slowest to fastest, in every process of the
fourteenth session's run (50-130 ms against 17-30 ms per step, every
allocator alike). This child runs the same steps (same model, lengths, batches)
one at a time, each synchronized, and prints one JSON line per process with,
per step: its sequence length, whether the process has seen that length
before, the step's ms and the driver allocations and frees the allocator made
in it. Then 30 more steps whose lengths have all been seen (the steady state),
the driver's own cuMemAlloc / cuMemFree times by size, called through
ctypes next to the allocator, so that a step's allocations can be priced;
and 4 unsynchronized blocks of steps, the loop's (CPU's) time per step
against the block's, to tell whether the step is bound by the CPU.
"""
import ctypes
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))

import torch_bench  # noqa: E402


def driver_times(sizes_mib, n=8):
    """Median us of cuMemAlloc_v2 and cuMemFree_v2 per size, in the current
    context (the one torch made current on this thread)."""
    cu = ctypes.CDLL("libcuda.so.1")
    out = {}
    for mib in sizes_mib:
        a, f = [], []
        for _ in range(n):
            p = ctypes.c_uint64()
            t0 = time.perf_counter()
            rc = cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(mib << 20))
            t1 = time.perf_counter()
            if rc != 0:
                raise RuntimeError(f"cuMemAlloc_v2({mib} MiB) = {rc}")
            rc = cu.cuMemFree_v2(p)
            t2 = time.perf_counter()
            if rc != 0:
                raise RuntimeError(f"cuMemFree_v2 = {rc}")
            a.append((t1 - t0) * 1e6)
            f.append((t2 - t1) * 1e6)
        out[mib] = (statistics.median(a), statistics.median(f))
    return out


def main():
    cfg = sys.argv[1]
    torch_bench.set_allocator_env(cfg)
    if cfg in torch_bench.CUDAPOOL_CONFS:
        sys.path.insert(0, os.path.join(REPO, "python"))
        import cudapool

        cudapool.install()
        if torch_bench.CUDAPOOL_CONFS[cfg]:
            cudapool.configure(torch_bench.CUDAPOOL_CONFS[cfg])
    import torch
    from model import GPT, batch, seq_lens

    torch.cuda.init()
    torch.empty(1, device="cuda")
    drv = driver_times((2, 20, 64, 256))

    torch.manual_seed(0)
    model = GPT().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    lens = seq_lens(65, seed=1)
    seen = set()

    def calls():
        st = torch.cuda.memory_stats(0)
        return int(st.get("num_device_alloc", 0)), int(st.get("num_device_free", 0))

    steps = []

    def train(n, seed):
        """One training step as torch_bench.py's, not synchronized."""
        x, y = batch(n, 8, torch_bench.VOCAB, "cuda", seed=seed)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def step(n, i):
        a0, f0 = calls()
        t0 = time.perf_counter()
        train(n, i)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        a1, f1 = calls()
        steps.append({"i": i, "len": n, "new": n not in seen, "ms": round(ms, 3),
                      "dev_alloc": a1 - a0, "dev_free": f1 - f0})
        seen.add(n)

    for i, n in enumerate(lens):
        step(n, i)
    steady = sorted(seen) * 2
    for j, n in enumerate(steady):
        step(n, 1000 + j)
    # Unsynchronized blocks, as torch_bench.py times them: the loop's own
    # time (the CPU's: launches, allocator, Python) against the block's
    # after the synchronize. Equal: the step is bound by the CPU.
    order = sorted(seen)
    pipe = []
    front = cudapool.front_counters if cfg in torch_bench.CUDAPOOL_CONFS else None
    h0 = front(0)["hits"] if front else 0
    for b in range(4):
        torch.cuda.synchronize()
        n0 = int(torch.cuda.memory_stats(0).get("allocation.all.allocated", 0))
        t0 = time.perf_counter()
        for j, n in enumerate(order):
            train(n, 2000 + j)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        n1 = int(torch.cuda.memory_stats(0).get("allocation.all.allocated", 0))
        k = len(order)
        pipe.append({"cpu_ms": round((t1 - t0) * 1e3 / k, 3), "total_ms": round((t2 - t0) * 1e3 / k, 3),
                     "allocs_per_step": (n1 - n0) / k})
    if front:  # mallocs the front served without entering Go, per step
        pipe[-1]["front_hits_per_step"] = (front(0)["hits"] - h0) / (4 * len(order))
    rec = {"config": cfg, "pipeline": pipe, "driver_us": {str(k): v for k, v in drv.items()}, "steps": steps,
           "module_loading": os.environ.get("CUDA_MODULE_LOADING", ""),
           "peak_reserved": int(torch.cuda.max_memory_reserved())}
    print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
