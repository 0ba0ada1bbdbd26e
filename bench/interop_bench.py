#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""One pool for CuPy and PyTorch, measured on a GPU.

    python3 bench/interop_bench.py [--repeats 3] [--chunk-mib 256] [--chunks 32]

Each measurement runs in a fresh process (cudapool.install() must precede
CUDA's initialization), with each library's default allocator ("native":
CuPy's MemoryPool, PyTorch's caching allocator) or with everything on
cudapool (cudapool.install() for PyTorch, cudapool.cupy.install() for CuPy):

1. peak: CuPy preprocessing allocates --chunks x --chunk-mib, computes on
   it and frees it; then a PyTorch stage allocates as much and computes.
   Reported: the device memory in use above the start (cudaMemGetInfo,
   after each stage; nothing is returned to the driver in between, so the
   larger is the peak), the allocators' own peak reserved, and a checksum
   of both stages' results (must match between the modes).
2. fit: the same with each stage taking 60% of the device: does it fit?
3. alloc: the cost of one CuPy allocation + free (cupy.cuda.alloc, then
   dropping it), 4 KiB in a loop, and mixed sizes (512 B-16 MiB, 64 live),
   with CuPy's MemoryPool, cudapool through CuPy's CFunctionAllocator
   (cudapool's C functions, no Python of cudapool's) and cudapool through a
   Python allocator function (the fallback); medians of --repeats processes.

Ends with a table. Every part reports its own error and the others still run.
Without a GPU, CuPy or PyTorch the parts say why they did not run.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PYTHON_DIR = os.path.join(REPO, "python")
MiB, GiB = 1 << 20, 1 << 30


# ---------------------------------------------------------------------------
# Children: one measurement each, printing "RESULT {json}".


def _setup(mode, need_torch=True):
    """Import and install the allocators for mode ("native" or "cudapool");
    returns (cupy, torch)."""
    torch = None
    if mode == "cudapool":
        import cudapool

        if need_torch:
            cudapool.install()
    if need_torch:
        import torch
    import cupy

    if mode == "cudapool":
        import cudapool.cupy

        got = cudapool.cupy.install()
        assert got == "c", f"cudapool.cupy.install() chose the {got} path"
    elif mode == "cudapool-python":
        import cudapool.cupy

        cudapool.cupy.install(mode="python")
    return cupy, torch


def _used(torch):
    free, total = torch.cuda.mem_get_info()
    return total - free, total


def child_peak(mode, chunk, chunks, fit):
    cupy, torch = _setup(mode)
    torch.zeros(1, device="cuda")  # both runtimes initialized before the start
    cupy.zeros(1)
    torch.cuda.synchronize()
    start, total = _used(torch)
    if fit:
        chunks = max(1, int(0.6 * total) // chunk)
    out = {"mode": mode, "chunk": chunk, "chunks": chunks, "device_total": total}
    checksum = 0
    try:
        xs = [cupy.empty(chunk // 4, dtype=cupy.float32) for _ in range(chunks)]
        for i, x in enumerate(xs):
            x.fill(i % 7)
            x *= 2  # compute
            checksum += int(x[:1024].sum())
        cupy.cuda.runtime.deviceSynchronize()
        out["after_cupy"] = _used(torch)[0] - start
        del xs, x
        cupy.cuda.runtime.deviceSynchronize()
    except Exception as e:
        out.update(fits=False, error=f"CuPy stage: {type(e).__name__}: {str(e)[:200]}")
        return out
    try:
        ts = [torch.empty(chunk // 4, dtype=torch.float32, device="cuda") for _ in range(chunks)]
        for i, t in enumerate(ts):
            t.fill_(i % 5)
            t.add_(1)
            checksum += int(t[:1024].sum().item())
        torch.cuda.synchronize()
        out["after_torch"] = _used(torch)[0] - start
        del ts, t
    except Exception as e:  # torch.OutOfMemoryError where the stages do not fit
        out.update(fits=False, error=f"PyTorch stage: {type(e).__name__}: {str(e)[:200]}")
        return out
    out["fits"] = True
    out["peak_used"] = max(out["after_cupy"], out["after_torch"])
    out["checksum"] = checksum
    if mode == "cudapool":
        import cudapool

        out["cudapool_peak_reserved"] = cudapool.max_memory_reserved(torch.cuda.current_device())
    else:
        out["torch_peak_reserved"] = torch.cuda.max_memory_reserved()
        out["cupy_pool_total"] = cupy.get_default_memory_pool().total_bytes()
    return out


def _mixed_sizes(n, seed=12345):
    """Deterministic sizes, 512 B-16 MiB, mostly small (log-uniform)."""
    sizes, x = [], seed
    for _ in range(n):
        x = (x * 6364136223846793005 + 1442695040888963407) & ((1 << 64) - 1)
        sizes.append(512 << ((x >> 33) % 16))  # 512 B .. 16 MiB
    return sizes


def child_alloc(mode, iters):
    cupy, _ = _setup(mode, need_torch=False)
    alloc = cupy.cuda.alloc
    for _ in range(1000):  # warm: the pool holds the blocks the loops use
        alloc(4096)
    t0 = time.perf_counter()
    for _ in range(iters):
        m = alloc(4096)
        del m
    small = (time.perf_counter() - t0) / iters * 1e6

    sizes = _mixed_sizes(iters)
    ring = [None] * 64
    for k, s in enumerate(sizes[:2000]):  # warm the mixed sizes too
        ring[k % 64] = alloc(s)
    t0 = time.perf_counter()
    for k, s in enumerate(sizes):
        ring[k % 64] = alloc(s)  # frees the allocation it replaces
    mixed = (time.perf_counter() - t0) / iters * 1e6
    ring = None

    t0 = time.perf_counter()
    for _ in range(iters):
        a = cupy.empty(1024, dtype=cupy.float32)
        del a
    empty = (time.perf_counter() - t0) / iters * 1e6
    return {"mode": mode, "small_us": small, "mixed_us": mixed, "empty_us": empty}


def run_child(args):
    which = args.child
    try:
        if which.startswith("peak-") or which.startswith("fit-"):
            kind, mode = which.split("-", 1)
            res = child_peak(mode, args.chunk_mib * MiB, args.chunks, kind == "fit")
        elif which.startswith("alloc-"):
            res = child_alloc(which[len("alloc-"):], args.iters)
        else:
            raise ValueError(f"unknown child {which}")
    except Exception as e:
        res = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    print("RESULT " + json.dumps(res), flush=True)


# ---------------------------------------------------------------------------
# Parent: runs the children and prints the table.


def spawn(args, child, timeout=600):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([PYTHON_DIR] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.pop("CUDAPOOL_BACKEND", None)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", child, "--chunk-mib", str(args.chunk_mib),
           "--chunks", str(args.chunks), "--iters", str(args.iters)]
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout}s"}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
    return {"error": f"rc={p.returncode}: " + " | ".join(tail)}


def gib(x):
    return "-" if x is None else f"{x / GiB:.2f}"


def preflight():
    """Why the benchmark cannot run here, or None."""
    for mod in ("torch", "cupy"):
        try:
            __import__(mod)
        except Exception as e:
            return f"{mod} is not importable ({type(e).__name__}: {e})"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=3, help="processes per allocation-cost figure (median)")
    ap.add_argument("--chunk-mib", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=32, help="chunks per stage in the peak scenario")
    ap.add_argument("--iters", type=int, default=100000, help="allocations per timing loop")
    ap.add_argument("--parts", default="peak,fit,alloc")
    args = ap.parse_args()
    if args.child:
        return run_child(args)

    why = preflight()
    if why:
        print(f"interop_bench: skipped: {why}")
        return 0
    parts = set(args.parts.split(","))
    rows, checks = [], []

    def scenario(kind):
        res = {m: spawn(args, f"{kind}-{m}") for m in ("native", "cudapool")}
        for m, r in res.items():
            print(f"{kind}-{m}: {json.dumps(r)}", flush=True)
        return res

    if "peak" in parts:
        res = scenario("peak")
        for m in ("native", "cudapool"):
            r = res[m]
            own = r.get("cudapool_peak_reserved")
            if own is None and "torch_peak_reserved" in r:
                own = r["torch_peak_reserved"] + r.get("cupy_pool_total", 0)
            rows.append((f"peak, {args.chunks} x {args.chunk_mib} MiB per stage", m,
                         gib(r.get("after_cupy")), gib(r.get("after_torch")), gib(r.get("peak_used")), gib(own),
                         "yes" if r.get("fits") else ("no" if "fits" in r else "-"), r.get("error", "")))
        a, b = res["native"].get("checksum"), res["cudapool"].get("checksum")
        checks.append(f"peak checksums: native {a}, cudapool {b}: {'EQUAL' if a is not None and a == b else 'DIFFER'}")
    if "fit" in parts:
        res = scenario("fit")
        for m in ("native", "cudapool"):
            r = res[m]
            own = r.get("cudapool_peak_reserved")
            if own is None and "torch_peak_reserved" in r:
                own = r["torch_peak_reserved"] + r.get("cupy_pool_total", 0)
            label = f"fit, 60% of {gib(r.get('device_total'))} GiB per stage"
            rows.append((label, m, gib(r.get("after_cupy")), gib(r.get("after_torch")), gib(r.get("peak_used")),
                         gib(own), "yes" if r.get("fits") else ("no" if "fits" in r else "-"),
                         (r.get("error") or "")[:90]))

    alloc_rows = []
    if "alloc" in parts:
        for mode, label in (("native", "CuPy MemoryPool (default)"), ("cudapool", "cudapool, C functions"),
                            ("cudapool-python", "cudapool, Python function")):
            runs = [spawn(args, f"alloc-{mode}") for _ in range(args.repeats)]
            good = [r for r in runs if "error" not in r]
            for r in runs:
                print(f"alloc-{mode}: {json.dumps(r)}", flush=True)
            if not good:
                alloc_rows.append((label, "-", "-", "-", runs[0].get("error", "")[:90]))
                continue

            def fig(key):
                vals = sorted(r[key] for r in good)
                return f"{statistics.median(vals):.2f} ({vals[0]:.2f}-{vals[-1]:.2f})"

            alloc_rows.append((label, fig("small_us"), fig("mixed_us"), fig("empty_us"), ""))

    print()
    if rows:
        print("One device, CuPy stage then PyTorch stage (GiB; used = cudaMemGetInfo above the start)")
        hdr = ("scenario", "allocators", "used after CuPy", "used after PyTorch", "peak used", "peak reserved",
               "fits", "error")
        print("| " + " | ".join(hdr) + " |")
        print("|" + "---|" * len(hdr))
        for r in rows:
            print("| " + " | ".join(str(c) for c in r) + " |")
        for c in checks:
            print(c)
        print()
    if alloc_rows:
        print(f"CuPy allocation + free, us per pair, median (min-max) of {args.repeats} processes, "
              f"{args.iters} per loop")
        hdr = ("CuPy allocator", "cupy.cuda.alloc 4 KiB", "mixed 512 B-16 MiB, 64 live", "cupy.empty 4 KiB + del",
               "error")
        print("| " + " | ".join(hdr) + " |")
        print("|" + "---|" * len(hdr))
        for r in alloc_rows:
            print("| " + " | ".join(str(c) for c in r) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
