#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""What one CuPy allocation costs through cudapool and through CuPy's own pool.

    python3 bench/cupy_alloc_bench.py [--rounds 8] [--iters 200000] [--size 4096]

Fresh processes taking turns: each round runs one process per allocator,
the order alternating from round to round (cupy, cudapool; cudapool, cupy;
...), so that both meet the host in its states alike. A process times
`cupy.cuda.alloc(size)` followed by dropping the pointer (the pair CuPy
code makes for every temporary) --reps times over --iters pairs, and gives
the median rep:

  cupy      CuPy's default MemoryPool: `alloc` (cupy.cuda.alloc), and
            `pool` (MemoryPool.malloc called directly: alloc's own share is
            the difference).
  cudapool  cudapool.cupy.install(), and its layers one by one:
            `alloc`      cupy.cuda.alloc, as CuPy code calls it;
            `installed`  the function install() gave cupy.cuda.set_allocator
                         (the next layer itself where CuPy propagates the
                         C malloc's exception, else cudapool.cupy's NULL
                         check around it);
            `cfunc`      CuPy's CFunctionAllocator.malloc alone: the memory
                         objects CuPy makes and the C calls;
            `raw`        cudapool_cupy_malloc + cudapool_cupy_free called
                         through ctypes (holding the GIL, as CuPy does), with
                         CuPy's current-stream function as the parameter;
            `ctypes`     two calls of a trivial C function of the library
                         through ctypes: what ctypes adds to `raw` (raw -
                         ctypes is the C calls' own cost);
            `loop`       the timing loop with nothing in it.

Prints, per allocator and layer, the median (min-max) over the processes in
us per pair; the ratio cudapool/cupy of the `alloc` medians; and the median
(min-max) of the per-round ratios (each round's two processes). The last
line is the whole result as JSON ("kind": "cupy_alloc").

Needs CuPy and a GPU; cudapool from python/ (PYTHONPATH is set for the
children) with libcudapool.so from $CUDAPOOL_LIBRARY or lib/. Without them
it says why and exits 0.
"""

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PYTHON_DIR = os.path.join(REPO, "python")

MODES = ("cupy", "cudapool")
LAYERS = {
    "cupy": ("alloc", "pool", "loop"),
    "cudapool": ("alloc", "installed", "cfunc", "raw", "ctypes", "loop"),
}


# ---------------------------------------------------------------------------
# Children: one allocator each, printing "RESULT {json}".


def timed(fn, iters, reps):
    """fn(iters) returns ns for iters pairs; the median over reps, in us/pair."""
    fn(min(iters, 10_000))  # warm: the blocks the loop uses are cached
    return statistics.median(fn(iters) / iters / 1e3 for _ in range(reps))


def loops(alloc, size):
    """The timing loop around alloc (one allocation dropped per pass)."""
    pc = time.perf_counter_ns

    def run(n):
        t0 = pc()
        for _ in range(n):
            m = alloc(size)
            del m
        return pc() - t0

    return run


def empty_loop(n):
    pc = time.perf_counter_ns
    t0 = pc()
    for _ in range(n):
        m = None
        del m
    return pc() - t0


def child_cupy(cupy, args):
    pool = cupy.get_default_memory_pool()
    cupy.cuda.set_allocator(pool.malloc)  # CuPy's default, said outright
    return {"alloc": timed(loops(cupy.cuda.alloc, args.size), args.iters, args.reps),
            "pool": timed(loops(pool.malloc, args.size), args.iters, args.reps),
            "loop": timed(empty_loop, args.iters, args.reps)}


def child_cudapool(cupy, args):
    sys.path.insert(0, PYTHON_DIR)
    import cudapool.cupy as cpc
    from cudapool import _lib

    mode = cpc.install()
    out = {"install_mode": mode}
    state = cpc._state
    installed = state.allocator
    c_alloc = state.owner if hasattr(state.owner, "malloc") else None
    out["alloc"] = timed(loops(cupy.cuda.alloc, args.size), args.iters, args.reps)
    out["installed"] = timed(loops(installed, args.size), args.iters, args.reps)
    if c_alloc is not None and mode == "c":
        out["cfunc"] = timed(loops(c_alloc.malloc, args.size), args.iters, args.reps)

    # The C functions through ctypes, with the GIL held (PYFUNCTYPE), as
    # CuPy calls them: the current-stream function needs it.
    lib = _lib.load()
    malloc = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)(
        _lib.address("cudapool_cupy_malloc"))
    free = ctypes.PYFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)(_lib.address("cudapool_cupy_free"))
    noop = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(_lib.address("cudapool_filter_stream_is"))
    param = cpc.current_stream_function(cupy) or 0
    dev = cupy.cuda.runtime.getDevice()
    size = args.size
    pc = time.perf_counter_ns

    def raw(n):
        t0 = pc()
        for _ in range(n):
            p = malloc(param, size, dev)
            free(param, p, dev)
        return pc() - t0

    def ctypes_pair(n):
        t0 = pc()
        for _ in range(n):
            noop(None, None)
            noop(None, None)
        return pc() - t0

    p = malloc(param, size, dev)
    if not p:
        raise RuntimeError(f"cudapool_cupy_malloc({size}) failed: {_lib.last_error()}")
    free(param, p, dev)
    out["raw"] = timed(raw, args.iters, args.reps)
    out["ctypes"] = timed(ctypes_pair, args.iters, args.reps)
    out["loop"] = timed(empty_loop, args.iters, args.reps)
    del lib
    return out


def run_child(args):
    try:
        import cupy

        cupy.cuda.Device(0).use()
        cupy.zeros(1)  # the device and CuPy initialized before the clock
        res = child_cupy(cupy, args) if args.child == "cupy" else child_cudapool(cupy, args)
        res.update(mode=args.child, cupy_version=cupy.__version__, size=args.size, iters=args.iters, reps=args.reps)
    except Exception as e:  # noqa: BLE001  (the parent reports it)
        res = {"mode": args.child, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    print("RESULT " + json.dumps(res), flush=True)
    return 0


# ---------------------------------------------------------------------------
# Parent


def round_order(r):
    """The order of round r's processes: the first allocator alternates."""
    return MODES if r % 2 == 0 else MODES[::-1]


def spawn(args, mode, timeout=300):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([PYTHON_DIR] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.pop("CUDAPOOL_BACKEND", None)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--size", str(args.size),
           "--iters", str(args.iters), "--reps", str(args.reps)]
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "error": f"timed out after {timeout} s"}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
    return {"mode": mode, "error": f"exit code {p.returncode}: " + " | ".join(tail)}


def spread(vals):
    """(median, min, max) of vals, or None."""
    vals = [v for v in vals if isinstance(v, (int, float))]
    return (statistics.median(vals), min(vals), max(vals)) if vals else None


def summarize(rounds):
    """rounds: [{mode: result}] in order. Returns the summary: per mode and
    layer (median, min, max) over the processes; the ratio of the alloc
    medians; the per-round ratios and their (median, min, max); the errors."""
    out = {"layers": {}, "errors": []}
    for mode in MODES:
        good = [r[mode] for r in rounds if mode in r and "error" not in r[mode]]
        out["errors"] += [f"round {i + 1} {mode}: {r[mode]['error']}" for i, r in enumerate(rounds)
                          if mode in r and "error" in r[mode]]
        out["layers"][mode] = {layer: spread([g.get(layer) for g in good]) for layer in LAYERS[mode]}
        out["layers"][mode] = {k: v for k, v in out["layers"][mode].items() if v}
        modes = sorted({g.get("install_mode") for g in good if g.get("install_mode")})
        if modes:
            out[f"{mode}_install_mode"] = "/".join(modes)
    a, b = out["layers"]["cupy"].get("alloc"), out["layers"]["cudapool"].get("alloc")
    if a and b:
        out["ratio_of_medians"] = b[0] / a[0]
    per = [r["cudapool"]["alloc"] / r["cupy"]["alloc"] for r in rounds
           if all(m in r and isinstance(r[m].get("alloc"), (int, float)) for m in MODES) and r["cupy"]["alloc"] > 0]
    if per:
        out["round_ratios"] = per
        out["round_ratio"] = spread(per)
    cp = out["layers"]["cudapool"]
    if cp.get("raw") and cp.get("ctypes"):
        out["raw_minus_ctypes"] = cp["raw"][0] - cp["ctypes"][0]
    return out


def fmt(s):
    return "-" if not s else f"{s[0]:.3f} ({s[1]:.3f}-{s[2]:.3f})"


def report(summary, n):
    lines = [f"cupy.cuda.alloc + drop, us per pair: median (min-max) of {n} processes per allocator, "
             "fresh processes taking turns", "",
             "| allocator | layer | us/pair |", "|---|---|---:|"]
    for mode in MODES:
        for layer in LAYERS[mode]:
            if layer in summary["layers"][mode]:
                lines.append(f"| {mode} | {layer} | {fmt(summary['layers'][mode][layer])} |")
    lines.append("")
    if "ratio_of_medians" in summary:
        lines.append(f"cudapool / cupy (alloc): {summary['ratio_of_medians']:.3f}x of the medians; per round "
                     f"{fmt(summary.get('round_ratio'))}")
    if "raw_minus_ctypes" in summary:
        lines.append(f"cudapool's C functions without ctypes (raw - ctypes): {summary['raw_minus_ctypes']:.3f} us")
    if summary.get("cudapool_install_mode"):
        lines.append(f"cudapool.cupy mode: {summary['cudapool_install_mode']}")
    lines += summary["errors"]
    return "\n".join(lines)


def preflight():
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as e:  # noqa: BLE001
        return f"CuPy cannot run here ({type(e).__name__}: {str(e)[:200]})"
    return None


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=8, help="rounds of one process per allocator")
    ap.add_argument("--iters", type=int, default=200_000, help="pairs per rep")
    ap.add_argument("--reps", type=int, default=5, help="reps per layer and process (their median)")
    ap.add_argument("--size", type=int, default=4096, help="bytes per allocation")
    args = ap.parse_args(argv)
    for name in ("rounds", "iters", "reps", "size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be positive")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        return run_child(args)
    why = preflight()
    if why:
        print(f"cupy_alloc_bench: skipped: {why}")
        return 0
    rounds = []
    for r in range(args.rounds):
        res = {}
        for mode in round_order(r):
            res[mode] = spawn(args, mode)
            print(f"round {r + 1} {mode}: {json.dumps(res[mode])}", flush=True)
        rounds.append(res)
    summary = summarize(rounds)
    print()
    print(report(summary, args.rounds))
    print(json.dumps({"kind": "cupy_alloc", "size": args.size, "iters": args.iters, "reps": args.reps,
                      "rounds": rounds, "summary": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
