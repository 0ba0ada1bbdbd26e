# SPDX-License-Identifier: Apache-2.0
"""A GPU soak of one allocator (docs/reliability.md): PyTorch's native one or cudapool.

    python gpu/soak.py --allocator cudapool          # SOAK_S seconds (default 60)
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python gpu/soak.py --allocator native

gpu/soak.sh runs native and cudapool side by side (two processes on one GPU)
and prints both results in one table.

What runs, for SOAK_S seconds:
  - 4 worker threads, each on its own stream, allocate and free tensors of
    random sizes (512 B to 64 MiB, log-uniform), fill each with a value of
    their own and verify every live tensor (each before it is freed, and all
    of them now and then);
  - the same threads hand tensors to a side stream whose kernel sleeps, then
    counts the elements that changed (a delayed read), call record_stream,
    free the tensor at once and allocate and fill the same size at once on
    the freeing stream; every delayed read's count is checked;
  - one thread captures two CUDA graphs sharing a private pool in
    thread-local mode (capture_error_mode="thread_local"), replays them
    between eager allocations, checks every replay against eager, then
    destroys both and captures again;
  - a producer thread sends CUDA tensors to a consumer process
    (torch.multiprocessing, spawn) that checks them and answers, with
    expandable segments too (the consumer then takes the producer's file
    descriptors with pidfd_getfd: the producer names it with
    prctl(PR_SET_PTRACER), which Yama's ptrace_scope 1 requires of a parent
    whose child imports its memory, natively as well);
  - empty_cache now and then (never during a capture: natively that is an
    internal assert);
  - before and after: allocate under set_per_process_memory_fraction until
    torch.OutOfMemoryError, free, allocate again.

It fails on any corrupted element, bad delayed read, wrong replay, leak
(torch.cuda.memory_allocated() back to its baseline at the end), error or
hang: a watchdog thread ends the process (exit status 3) when a thread makes
no progress for WATCHDOG_S seconds (default 90) or the run overstays SOAK_S by
that much, after printing every thread's stack and the summary so far.
SOAK_ON_HANG names a command the watchdog runs first, with the process id
as its last argument, to see the native stacks too (Python's show only
where each thread entered C), e.g.
SOAK_ON_HANG="cuda-gdb -batch -ex 'thread apply all bt' -p".

The last two lines are a table and "SOAK-RESULT {json}"; the exit status is 0
only if everything checked out.
"""

import argparse
import ctypes
import faulthandler
import json
import math
import os
import queue
import random
import shlex
import subprocess
import sys
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MiB = 1 << 20
MIN_SIZE, MAX_SIZE = 512, 64 * MiB
MAX_LIVE = 24  # live tensors per worker


def log_size(rng):
    return int(math.exp(rng.uniform(math.log(MIN_SIZE), math.log(MAX_SIZE))))


class Soak:
    def __init__(self, torch, args):
        self.torch = torch
        self.args = args
        self.dev = torch.device("cuda")
        self.lock = threading.Lock()
        self.c = dict(ops=0, allocs=0, frees=0, verified=0, corrupted_elems=0, delayed_reads=0,
                      bad_delayed_reads=0, captures=0, replays=0, bad_replays=0, graph_destroys=0,
                      empty_caches=0, ipc_sent=0, ipc_bad=0, ooms_in_loop=0)
        self.errors = []
        self.progress = {}
        self.stop = threading.Event()  # an error, or the end: the threads stop
        self.finished = threading.Event()  # the run is over: the watchdog stops
        # Held by the capture thread while it captures: empty_cache waits.
        self.capture_lock = threading.Lock()
        self.deadline = 0.0
        self.cycles_per_ms = 0

    def add(self, **kw):
        with self.lock:
            for k, v in kw.items():
                self.c[k] += v

    def beat(self, name):
        self.progress[name] = time.monotonic()

    def done(self, name):
        """A thread that ended is no longer watched."""
        self.progress.pop(name, None)

    def error(self, where, e):
        with self.lock:
            self.errors.append(f"{where}: {e!r}\n{traceback.format_exc(limit=6)}")
        self.stop.set()

    # -- helpers ----------------------------------------------------------

    def calibrate(self):
        t = self.torch
        probe = 10_000_000
        t.cuda._sleep(probe)
        t.cuda.synchronize()
        a, b = t.cuda.Event(enable_timing=True), t.cuda.Event(enable_timing=True)
        a.record()
        t.cuda._sleep(probe)
        b.record()
        b.synchronize()
        self.cycles_per_ms = int(probe / max(a.elapsed_time(b), 1e-3))

    def tensor(self, size, value):
        """An int32 tensor of about size bytes on the current stream, filled."""
        x = self.torch.empty(max(size // 4, 1), dtype=self.torch.int32, device=self.dev)
        x.fill_(value)
        return x

    def verify(self, x, value):
        bad = int((x != value).sum().item())
        self.add(verified=1, corrupted_elems=bad)
        return bad

    # -- OOM under a memory fraction, and recovery --------------------------

    def oom_phase(self, label):
        """Allocate 256 MiB blocks under a memory fraction until
        torch.OutOfMemoryError, free them, allocate again."""
        t = self.torch
        frac = self.args.oom_fraction
        t.cuda.set_per_process_memory_fraction(frac)
        held, got_oom = [], False
        try:
            # Twice what the fraction allows: the loop ends at the first OOM.
            limit = 2 * int(t.cuda.get_device_properties(0).total_memory * frac) // (256 * MiB) + 8
            for _ in range(limit):
                held.append(t.empty(256 * MiB, dtype=t.uint8, device=self.dev))
        except t.OutOfMemoryError:
            got_oom = True
        n = len(held)
        del held
        t.cuda.empty_cache()
        after = t.empty(64 * MiB, dtype=t.uint8, device=self.dev)
        after.fill_(1)
        ok = got_oom and int(after.sum().item()) == 64 * MiB
        del after
        t.cuda.set_per_process_memory_fraction(1.0)
        t.cuda.empty_cache()
        return {"label": label, "oom_raised": got_oom, "blocks_before_oom": n, "recovered": ok}

    # -- the threads ------------------------------------------------------

    def worker(self, wid):
        t = self.torch
        name = f"worker{wid}"
        rng = random.Random(1000 + wid)
        stream, side = t.cuda.Stream(), t.cuda.Stream()
        live = []  # (tensor, value)
        pending = []  # (event, count tensor): delayed reads not yet checked
        serial = 0

        def value():
            nonlocal serial
            serial += 1
            return (wid << 24) | (serial & 0xFFFFFF)

        try:
            with t.cuda.stream(stream):
                while not self.stop.is_set() and time.monotonic() < self.deadline:
                    self.beat(name)
                    self.add(ops=1)
                    r = rng.random()
                    if r < 0.40 and len(live) < MAX_LIVE:
                        v = value()
                        try:
                            live.append((self.tensor(log_size(rng), v), v))
                            self.add(allocs=1)
                        except t.OutOfMemoryError:
                            self.add(ooms_in_loop=1)
                    elif r < 0.70 and live:
                        x, v = live.pop(rng.randrange(len(live)))
                        if self.verify(x, v):
                            self.error(name, f"a tensor held {v:#x} no more before its free")
                        del x
                        self.add(frees=1)
                    elif r < 0.90 and live:
                        self.delayed_read(rng, live, pending, stream, side, value)
                    elif r < 0.93:
                        for x, v in live:
                            if self.verify(x, v):
                                self.error(name, f"a live tensor lost its value {v:#x}")
                    elif r < 0.94:
                        if self.capture_lock.acquire(blocking=False):
                            try:
                                t.cuda.empty_cache()
                                self.add(empty_caches=1)
                            finally:
                                self.capture_lock.release()
                    self.check_delayed(pending, block=False)
                self.check_delayed(pending, block=True)
                for x, v in live:
                    if self.verify(x, v):
                        self.error(name, f"a live tensor lost its value {v:#x} (final check)")
                live.clear()
                stream.synchronize()
        except Exception as e:
            self.error(name, e)
        finally:
            self.done(name)

    def delayed_read(self, rng, live, pending, stream, side, value):
        t = self.torch
        x, v = live.pop(rng.randrange(len(live)))
        size = x.numel() * 4
        side.wait_stream(stream)
        with t.cuda.stream(side):
            t.cuda._sleep(int(self.cycles_per_ms * rng.uniform(0.5, 3)))
            count = (x != v).sum()
            ev = t.cuda.Event()
            ev.record(side)
        x.record_stream(side)
        del x  # freed while the side stream's kernel still has to read it
        self.add(frees=1)
        v2 = value()
        try:
            y = self.tensor(size, v2)  # at once, same size, same stream
            live.append((y, v2))
            self.add(allocs=1)
        except t.OutOfMemoryError:
            self.add(ooms_in_loop=1)
        pending.append((ev, count))

    def check_delayed(self, pending, block):
        keep = []
        for ev, count in pending:
            if block:
                ev.synchronize()
            elif not ev.query():
                keep.append((ev, count))
                continue
            bad = int(count.item())
            self.add(delayed_reads=1, bad_delayed_reads=int(bad != 0))
        pending[:] = keep

    def capturer(self):
        """Two graphs sharing a pool, captured thread-locally, replayed and
        checked against eager, destroyed and captured again."""
        t = self.torch
        name = "capturer"
        rng = random.Random(7)
        cs = t.cuda.Stream()
        n = 1 << 16

        def f1(x):
            tmp = x * 2 + 1  # freed inside the capture: the pool reuses it
            return tmp.sum(dtype=t.int64) + x[: n // 2].sum(dtype=t.int64)

        def f2(x, y):
            scratch = t.empty(rng_size, dtype=t.uint8, device=self.dev)
            scratch.fill_(3)
            return y * 3 + (x.max().to(t.int64)) + scratch[:1].to(t.int64).sum()

        try:
            with t.cuda.stream(cs):
                static = t.zeros(n, dtype=t.int32, device=self.dev)
                while not self.stop.is_set() and time.monotonic() < self.deadline:
                    self.beat(name)
                    rng_size = log_size(rng)
                    pool = t.cuda.graph_pool_handle()
                    g1, g2 = t.cuda.CUDAGraph(), t.cuda.CUDAGraph()
                    with self.capture_lock:
                        with t.cuda.graph(g1, pool=pool, stream=cs, capture_error_mode="thread_local"):
                            out1 = f1(static)
                        with t.cuda.graph(g2, pool=pool, stream=cs, capture_error_mode="thread_local"):
                            out2 = f2(static, out1)
                    self.add(captures=2)
                    for _ in range(rng.randint(5, 30)):
                        if self.stop.is_set():
                            break
                        self.beat(name)
                        static.copy_(t.randint(-1000, 1000, (n,), dtype=t.int32, device=self.dev))
                        eager_junk = [self.tensor(log_size(rng), 5) for _ in range(rng.randint(0, 3))]
                        g1.replay()
                        g2.replay()
                        want = f2(static, f1(static))
                        got = out2.clone()
                        del eager_junk
                        cs.synchronize()
                        self.add(replays=2, bad_replays=int(not bool((got == want).all().item())))
                    del g1, g2, out1, out2, pool
                    self.add(graph_destroys=2)
                cs.synchronize()
        except Exception as e:
            self.error(name, e)
        finally:
            self.done(name)

    def ipc_producer(self, inq, outq, proc):
        t = self.torch
        name = "ipc"
        rng = random.Random(11)
        s = t.cuda.Stream()
        i = 0
        try:
            with t.cuda.stream(s):
                while not self.stop.is_set() and time.monotonic() < self.deadline:
                    self.beat(name)
                    i += 1
                    v = rng.randint(1, 1 << 30)
                    x = self.tensor(rng.choice([MiB, 4 * MiB, 24 * MiB]), v)
                    s.synchronize()
                    inq.put((i, x, v))
                    try:
                        j, ok = outq.get(timeout=self.args.watchdog_s / 2)
                    except queue.Empty:
                        raise RuntimeError("the consumer process did not answer") from None
                    if j != i:
                        raise RuntimeError(f"the consumer answered message {j}, not {i}")
                    self.add(ipc_sent=1, ipc_bad=int(not ok))
                    del x  # only after the consumer is done with it
                    time.sleep(0.01)
        except Exception as e:
            self.error(name, e)
        finally:
            self.done(name)
            inq.put(None)
            proc.join(timeout=60)
            if proc.is_alive():
                self.error(name, "the consumer process did not exit")
                proc.kill()
            elif proc.exitcode != 0:
                self.error(name, f"the consumer process exited with {proc.exitcode}")

    def watchdog(self, summary):
        limit = self.args.watchdog_s
        while not self.finished.wait(2):
            now = time.monotonic()
            stale = [n for n, ts in list(self.progress.items()) if now - ts > limit]
            if stale or now > self.deadline + limit:
                print(f"WATCHDOG: no progress for {limit} s in {stale or 'the run'}: hang", file=sys.stderr, flush=True)
                faulthandler.dump_traceback(all_threads=True)
                on_hang(os.environ.get("SOAK_ON_HANG", ""))
                res = summary()
                res["hang"] = stale or ["overran"]
                emit(res)
                os._exit(3)


def on_hang(command, timeout=120):
    """Runs command (shell words) with this process's id appended, its
    output going to stderr: a debugger's view of the hung threads."""
    if not command:
        return
    try:
        subprocess.run(shlex.split(command) + [str(os.getpid())], stdout=sys.stderr, stderr=sys.stderr,
                       timeout=timeout, check=False)
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        print(f"SOAK_ON_HANG {command!r} failed: {e}", file=sys.stderr, flush=True)


def ipc_consumer(allocator, inq, outq):
    """The other process: checks each tensor it receives and answers."""
    if allocator == "cudapool":
        sys.path.insert(0, os.path.join(ROOT, "python"))
        import cudapool

        cudapool.install()
    import torch

    while True:
        msg = inq.get()
        if msg is None:
            return
        i, x, v = msg
        ok = bool((x == v).all().item())
        del x
        torch.cuda.synchronize()
        outq.put((i, ok))


def allow_descriptors(pid):
    """Let process pid (the consumer, a child) take this process's file
    descriptors, as importing memory of expandable segments does: under
    Yama's ptrace_scope 1 a child may not unless its parent names it."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(0x59616D61, ctypes.c_ulong(pid), 0, 0, 0) != 0:  # PR_SET_PTRACER
        print(f"prctl(PR_SET_PTRACER, {pid}): {os.strerror(ctypes.get_errno())}", file=sys.stderr)


def emit(res):
    rows = [("allocator", res["allocator"]), ("PYTORCH_CUDA_ALLOC_CONF", res["conf"] or "-"),
            ("seconds", res["seconds"]), ("operations", res["ops"]), ("verified tensors", res["verified"]),
            ("corrupted elements", res["corrupted_elems"]),
            ("delayed reads (bad)", f"{res['delayed_reads']} ({res['bad_delayed_reads']})"),
            ("graph captures / replays (bad)", f"{res['captures']} / {res['replays']} ({res['bad_replays']})"),
            ("IPC tensors (bad)", res["ipc"]), ("empty_cache calls", res["empty_caches"]),
            ("OOM + recovery before / after", res["oom_phases"]), ("leak (bytes)", res["leak_bytes"]),
            ("errors", len(res["errors"])), ("hang", res["hang"] or "no"), ("RESULT", "PASS" if res["ok"] else "FAIL")]
    print()
    for k, v in rows:
        print(f"{k:<32} {v}")
    print("SOAK-RESULT " + json.dumps(res), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--allocator", choices=["native", "cudapool"], default=os.environ.get("SOAK_ALLOCATOR", "cudapool"))
    ap.add_argument("--seconds", type=float, default=float(os.environ.get("SOAK_S", "60")))
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--watchdog-s", dest="watchdog_s", type=float, default=float(os.environ.get("WATCHDOG_S", "90")))
    ap.add_argument("--oom-fraction", type=float, default=0.15, help="memory fraction of the OOM phases")
    ap.add_argument("--no-ipc", action="store_true")
    args = ap.parse_args()
    # cudapool reads CUDAPOOL_CONF, else PYTORCH_CUDA_ALLOC_CONF.
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if args.allocator == "cudapool" and "CUDAPOOL_CONF" in os.environ:
        conf = os.environ["CUDAPOOL_CONF"]
    if args.allocator == "cudapool":
        sys.path.insert(0, os.path.join(ROOT, "python"))
        import cudapool

        cudapool.install()
    import torch
    import torch.multiprocessing as mp

    if not torch.cuda.is_available():
        print("SKIP: CUDA is not available")
        print("SOAK-RESULT " + json.dumps({"allocator": args.allocator, "skipped": "CUDA is not available", "ok": True}))
        return 0
    s = Soak(torch, args)
    t_start = time.monotonic()
    # Until the threads start, the main thread is watched (deadline set
    # for the run once it starts).
    s.deadline = t_start + args.seconds + args.watchdog_s
    s.beat("main")
    ipc = not args.no_ipc
    oom_phases = []
    res_box = {}
    gpu = torch.cuda.get_device_name(0)  # read once: the watchdog must not call CUDA

    def summary():
        c = dict(s.c)
        ok = (not s.errors and c["corrupted_elems"] == 0 and c["bad_delayed_reads"] == 0 and c["bad_replays"] == 0
              and c["ipc_bad"] == 0 and res_box.get("leak_bytes") == 0
              and len(oom_phases) == 2 and all(p["oom_raised"] and p["recovered"] for p in oom_phases))
        return dict(allocator=args.allocator, conf=conf, torch=torch.__version__, gpu=gpu,
                    seconds=round(time.monotonic() - t_start, 1), **c,
                    ipc=f"{c['ipc_sent']} ({c['ipc_bad']})" if ipc else "skipped",
                    oom_phases=" / ".join(f"{p['oom_raised'] and p['recovered']}" for p in oom_phases) or "-",
                    oom_detail=oom_phases, leak_bytes=res_box.get("leak_bytes"),
                    reserved_after=res_box.get("reserved_after"), errors=s.errors[:10], hang=None, ok=ok)

    threading.Thread(target=s.watchdog, args=(summary,), name="watchdog", daemon=True).start()
    try:
        s.calibrate()
        s.beat("main")
        oom_phases.append(s.oom_phase("before"))
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()
        s.done("main")
        s.deadline = time.monotonic() + args.seconds
        threads = [threading.Thread(target=s.worker, args=(i,), name=f"worker{i}") for i in range(args.workers)]
        threads.append(threading.Thread(target=s.capturer, name="capturer"))
        if ipc:
            ctx = mp.get_context("spawn")
            inq, outq = ctx.Queue(), ctx.Queue()
            proc = ctx.Process(target=ipc_consumer, args=(args.allocator, inq, outq), daemon=True)
            proc.start()
            allow_descriptors(proc.pid)
            threads.append(threading.Thread(target=s.ipc_producer, args=(inq, outq, proc), name="ipc"))
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        s.beat("main")
        torch.cuda.synchronize()
        if ipc:
            torch.cuda.ipc_collect()  # shared blocks the consumer has released
        torch.cuda.empty_cache()  # also ends the deferred frees of the delayed reads
        res_box["leak_bytes"] = torch.cuda.memory_allocated() - baseline
        oom_phases.append(s.oom_phase("after"))
        res_box["reserved_after"] = torch.cuda.memory_reserved()
    except Exception as e:
        s.error("main", e)
    s.stop.set()
    s.finished.set()
    res = summary()
    emit(res)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
