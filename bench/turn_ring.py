#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""turn_ring.py - several bench/torch_bench.py processes taking turns on one CPU.

    python3 bench/turn_ring.py [--cpu CPUS] [--pin thread|process|none]
        [--limit S] [--turn-timeout S] --out-dir DIR [--log-dir DIR]
        NAME=CONFIG [NAME=CONFIG ...] [-- torch_bench args]

Each NAME=CONFIG is one fresh `torch_bench.py CONFIG` process; its JSON
lines go to DIR/NAME.json and its stderr to LOGDIR/NAME.log (default DIR),
exactly as one process run alone would write them. The processes start
together and, once all are ready, take turns in the order given: this
script hands the turn to one process, which runs one timed rep (a training
block, a capture, a torch.empty rep: torch_bench.py's Turns) and hands it
back; then the next process gets it. So rep k of every configuration runs
within one round of turns, and all meet the host in the same state
(docs/benchmarks.md, "The host": it runs a process fast or up
to 1.9x slower, per few seconds, so processes run one after another do
not). A process that ends, fails or stays silent past --turn-timeout
leaves the ring and the others go on; --limit cuts everything off.

Pinning (--cpu, default 2 where there are more than 2 CPUs, else 0):
thread (the default) pins each process's main thread, once its library,
torch and CUDA threads have started (BENCH_TURNS_PIN); process pins every
thread with taskset; none pins nothing.

Each process talks to this script through two FIFOs, as to the partner of
bench/turn_pair.sh: it is the "second" of a pair whose "first" is this
script. Exit status: 0 when every process succeeded, else the first
failure's (124: --limit or a silent process).
"""
import argparse
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", default=None, help="taskset CPU list (default 2, or 0 with 2 CPUs or fewer)")
    p.add_argument("--pin", choices=("thread", "process", "none"), default="thread")
    p.add_argument("--limit", type=float, default=600.0, help="seconds before every process is stopped")
    p.add_argument("--turn-timeout", type=float, default=120.0,
                   help="seconds a process may keep the turn (or take to start) before it leaves the ring")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--prog", default=os.path.join(REPO, "bench", "torch_bench.py"),
                   help="the program each process runs (tests use a stand-in)")
    p.add_argument("runs", nargs="+", help="NAME=CONFIG, then optionally -- and torch_bench.py's arguments")
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1:]
    else:
        rest = []
    a = p.parse_args(argv)
    a.rest = rest
    a.pairs = []
    for r in a.runs:
        name, sep, cfg = r.partition("=")
        if not sep or not name or not cfg or "/" in name:
            p.error(f"{r!r}: want NAME=CONFIG")
        a.pairs.append((name, cfg))
    if len({n for n, _ in a.pairs}) != len(a.pairs):
        p.error("every NAME must differ")
    if a.cpu is None:
        a.cpu = "2" if (os.cpu_count() or 1) > 2 else "0"
    return a


class Member:
    """One process of the ring and its two FIFOs (opened read-write here, so
    that neither open nor a write ever blocks, and no read sees EOF)."""

    def __init__(self, name, cfg, tmp):
        self.name, self.cfg = name, cfg
        self.to_path, self.from_path = os.path.join(tmp, name + ".in"), os.path.join(tmp, name + ".out")
        os.mkfifo(self.to_path)
        os.mkfifo(self.from_path)
        self.to_fd = os.open(self.to_path, os.O_RDWR)
        self.from_fd = os.open(self.from_path, os.O_RDWR)
        self.proc = None
        self.gone = ""  # why it left the ring
        self.ended = False  # it said so (or exited): not to be stopped
        self.turns = 0

    def send(self, mark):
        os.write(self.to_fd, mark)

    def receive(self, timeout, deadline):
        """The process's next mark, or None when it exited first or said
        nothing within timeout (or by the deadline)."""
        end = min(time.monotonic() + timeout, deadline)
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.from_fd], [], [], min(left, 0.5))
            if ready:
                return os.read(self.from_fd, 1)
            if self.proc.poll() is not None:
                # It exited; a mark it wrote on the way out may still be there.
                ready, _, _ = select.select([self.from_fd], [], [], 0)
                return os.read(self.from_fd, 1) if ready else None


def main(argv=None):
    a = parse(sys.argv[1:] if argv is None else argv)
    os.makedirs(a.out_dir, exist_ok=True)
    log_dir = a.log_dir or a.out_dir
    os.makedirs(log_dir, exist_ok=True)
    deadline = time.monotonic() + a.limit
    tmp = tempfile.mkdtemp(prefix="turn_ring.")
    ring = []
    try:
        ring = [Member(n, c, tmp) for n, c in a.pairs]
        for m in ring:
            env = dict(os.environ)
            env.pop("BENCH_TURNS_TAG", None)  # lines stay "kind":"torch", as a lone process's
            env["BENCH_TURNS"] = f"{m.to_path}:{m.from_path}:second"
            env["BENCH_TURNS_TIMEOUT"] = str(int(max(a.limit, 1)))  # this script does the timing out
            cmd = [sys.executable, a.prog, m.cfg] + a.rest
            if a.pin == "thread":
                env["BENCH_TURNS_PIN"] = a.cpu
            elif a.pin == "process":
                env.pop("BENCH_TURNS_PIN", None)
                cmd = ["taskset", "-c", a.cpu] + cmd
            else:
                env.pop("BENCH_TURNS_PIN", None)
            with open(os.path.join(a.out_dir, m.name + ".json"), "w") as out, \
                    open(os.path.join(log_dir, m.name + ".log"), "w") as err:
                m.proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=REPO, env=env)
        rc = run_ring(ring, a, deadline)
    finally:
        # One that ended its turns still writes its last line: it has until
        # the limit. The others (cut off, or an exception here) stop now.
        for m in ring:
            if m.proc is not None and not m.ended:
                stop(m.proc, 0)
        for m in ring:
            if m.proc is not None:
                stop(m.proc, max(deadline - time.monotonic(), 0))
        shutil.rmtree(tmp, ignore_errors=True)
    codes = []
    for m in ring:
        code = m.proc.returncode if m.proc is not None else 1
        codes.append(code)
        print(f"turn_ring: {m.name} ({m.cfg}): exit {code}, {m.turns} turns"
              + (f", left the ring: {m.gone}" if m.gone not in ("", "ended") else ""), file=sys.stderr)
    if rc:
        return rc
    return next((c if c > 0 else 1 for c in codes if c != 0), 0)


def stop(proc, grace):
    """Waits up to grace seconds for proc, then terminates it (then kills it)."""
    try:
        proc.wait(timeout=grace)
        return
    except subprocess.TimeoutExpired:
        pass
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_ring(ring, a, deadline):
    """The barrier, then turns in ring order until every process has ended.
    Returns 124 when the limit or a silent process cut the ring short."""
    cut = 0
    # Barrier: every process says it is ready ("r"), or leaves.
    for m in ring:
        mark = m.receive(a.turn_timeout + 60, deadline)  # start-up: torch import, CUDA, model
        if mark != b"r":
            m.ended = mark == b"e" or m.proc.poll() is not None
            m.gone = "ended before the first turn" if m.ended else "did not start"
            cut = cut or (0 if m.ended else 124)
    alive = [m for m in ring if not m.gone]
    for m in alive:
        m.send(b"r")
    while alive:
        for m in list(alive):
            m.send(b"t")  # your turn
            mark = m.receive(a.turn_timeout, deadline)
            if mark == b"t":
                m.turns += 1
                continue
            alive.remove(m)
            m.ended = mark == b"e" or (mark is None and m.proc.poll() is not None)
            if m.ended:
                m.gone = "ended"
            else:
                m.gone = "silent" if time.monotonic() < deadline else "time limit"
                cut = 124
                stop(m.proc, 0)  # it would run on alone, timed against nobody
    return cut


if __name__ == "__main__":
    sys.exit(main())
