# SPDX-License-Identifier: Apache-2.0
"""The capture-time record_stream race, as small as it can be (docs/reliability.md).

One thread captures a CUDA graph in thread-local mode. Meanwhile, on another
thread, a tensor x is handed to a side stream whose kernel first sleeps, then
counts the elements of x that changed; x.record_stream(side) and `del x`
happen while that capture runs; right after the capture ends the same size
is allocated on x's stream and filled with another value. An allocator that
reuses x's memory before the side stream's kernel has read it makes the
kernel see the new value: a bad read.

PyTorch's allocator defers the events of blocks freed while any capture is
under way, and at the end of the capture drops the stream uses recorded
during it (it assumes those streams joined the capture, which other threads'
streams do not under thread-local capture), so the block is reused at once.
cudapool keeps the block until the side stream's event completes.

    python gpu/race_record_stream.py                   # native and cudapool, side by side
    python gpu/race_record_stream.py --allocator cudapool --repeats 50 --json

One process per allocator (cudapool.install() must precede CUDA). The last
line is a table (both) or one JSON object (--json). Exit status: 1 if
cudapool had a bad read or either run failed, else 0; native's bad reads are
recorded, not judged.
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
N = 1 << 22  # int32 elements: 16 MiB, a large-pool block of its own


def run_one(allocator, repeats, sleep_ms, mode, timeout):
    if allocator == "cudapool":
        sys.path.insert(0, os.path.join(ROOT, "python"))
        import cudapool

        cudapool.install()
    import torch

    if not torch.cuda.is_available():
        return {"allocator": allocator, "skipped": "CUDA is not available"}
    dev = torch.device("cuda")
    s1, side = torch.cuda.Stream(), torch.cuda.Stream()
    cycles = calibrate_sleep(torch, sleep_ms)
    bad_reads = reused = graph_errors = 0
    t0 = time.time()
    for _ in range(repeats):
        started, freed = threading.Event(), threading.Event()
        result = {}

        def capture():
            try:
                static = torch.ones(1 << 16, device=dev)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, capture_error_mode=mode):
                    out = static * 2
                    started.set()
                    if not freed.wait(timeout):
                        raise RuntimeError("the main thread never freed x")
                    out = out + 1
                g.replay()
                torch.cuda.current_stream().synchronize()
                result["ok"] = bool((out == 3).all().item())
            except Exception as e:  # reported below
                result["error"] = repr(e)
                started.set()

        th = threading.Thread(target=capture)
        th.start()
        if not started.wait(timeout):
            raise RuntimeError("the capture never started")
        with torch.cuda.stream(s1):
            x = torch.full((N,), 7, dtype=torch.int32, device=dev)
        side.wait_stream(s1)
        with torch.cuda.stream(side):
            torch.cuda._sleep(cycles)  # the delayed reader
            bad = (x != 7).sum()
        x_ptr = x.data_ptr()
        x.record_stream(side)  # during the other thread's capture
        del x
        freed.set()
        th.join(timeout)
        if th.is_alive():
            raise RuntimeError("the capture thread hangs")
        with torch.cuda.stream(s1):
            y = torch.empty((N,), dtype=torch.int32, device=dev)
            y.fill_(9)
        reused += y.data_ptr() == x_ptr
        torch.cuda.synchronize()
        bad_reads += int(bad.item()) > 0
        if not result.get("ok"):
            graph_errors += 1
            print("graph error:", result.get("error", "wrong replay result"), file=sys.stderr)
        del y, bad
    return {"allocator": allocator, "mode": mode, "repeats": repeats, "bad_reads": bad_reads,
            "reused_at_once": reused, "graph_errors": graph_errors, "sleep_ms": sleep_ms,
            "seconds": round(time.time() - t0, 1), "torch": torch.__version__}


def calibrate_sleep(torch, ms):
    """torch.cuda._sleep cycles that take about ms milliseconds."""
    probe = 10_000_000
    torch.cuda._sleep(probe)  # warm up
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(probe)
    b.record()
    b.synchronize()
    per_ms = probe / max(a.elapsed_time(b), 1e-3)
    return int(per_ms * ms)


def both(args):
    rows = []
    ok = True
    for alloc in ("native", "cudapool"):
        cmd = [sys.executable, os.path.abspath(__file__), "--allocator", alloc, "--repeats", str(args.repeats),
               "--sleep-ms", str(args.sleep_ms), "--mode", args.mode, "--json"]
        env = dict(os.environ)
        if args.conf is not None:
            env["PYTORCH_CUDA_ALLOC_CONF"] = args.conf
            env.pop("CUDAPOOL_CONF", None)
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.repeats * 5 + 120)
            out, rc = p.stdout, p.returncode
            sys.stderr.write(p.stderr[-4000:])
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            rc = "timeout (hang)"
        lines = [line for line in out.splitlines() if line.startswith("{")]
        r = json.loads(lines[-1]) if lines else {"allocator": alloc, "error": f"rc={rc}, no result"}
        r["rc"] = rc
        rows.append(r)
        if rc != 0 or "error" in r or r.get("graph_errors"):
            ok = False
        if alloc == "cudapool" and r.get("bad_reads", 1) != 0 and "skipped" not in r:
            ok = False
    print()
    print(f"capture-time record_stream race, {args.mode} capture, {args.repeats} repeats, reader delay {args.sleep_ms} ms")
    print(f"{'allocator':<10} {'bad reads':>10} {'reused at once':>15} {'graph errors':>13} {'time':>7}  status")
    for r in rows:
        if "skipped" in r:
            print(f"{r['allocator']:<10} skipped: {r['skipped']}")
            continue
        print(f"{r['allocator']:<10} {r.get('bad_reads', '-'):>10} {r.get('reused_at_once', '-'):>15} "
              f"{r.get('graph_errors', '-'):>13} {str(r.get('seconds', '-')) + 's':>7}  rc={r['rc']} {r.get('error', '')}")
    print("RACE-RESULT " + json.dumps(rows))
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--allocator", choices=["native", "cudapool", "both"], default="both")
    ap.add_argument("--repeats", type=int, default=int(os.environ.get("RACE_REPEATS", "100")))
    ap.add_argument("--sleep-ms", type=float, default=100.0, help="how long the side stream waits before reading")
    ap.add_argument("--mode", default="thread_local", choices=["thread_local", "global", "relaxed"])
    ap.add_argument("--conf", default=None, help="PYTORCH_CUDA_ALLOC_CONF for both runs (default: inherited)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.allocator == "both":
        return both(args)
    r = run_one(args.allocator, args.repeats, args.sleep_ms, args.mode, timeout=60)
    print(json.dumps(r) if args.json else r)
    if args.allocator == "cudapool" and r.get("bad_reads", 0) != 0:
        return 1
    return 1 if r.get("graph_errors") else 0


if __name__ == "__main__":
    sys.exit(main())
