# SPDX-License-Identifier: Apache-2.0
"""Pause and resume by tag, timed on the GPU: cudapool against
torch_memory_saver and against the host link itself.

For each implementation, in a process of its own (cudapool must be PyTorch's
allocator before CUDA starts; torch_memory_saver needs PyTorch's), with
--size-gib GiB made of 256 MiB tensors inside a region:
  - link: a plain pinned copy of all of it, device to host and back
    (copy_(non_blocking=True) into one pinned buffer), in the same process;
  - pause(keep=True) / resume: GiB/s each way, contents checked after every
    resume;
  - pause(keep=False) / resume: milliseconds;
  - the driver's free memory after each pause against what the tag held
    (within 1%).
The first keep=True pause of a process is reported apart: it pins the host
memory that later pauses reuse. Medians and min-max over --reps reps; one
short table, then the same as a markdown table (the README's).

    python3 bench/pause_bench.py                    # cudapool and torch_memory_saver
    python3 bench/pause_bench.py --impl cudapool --size-gib 4 --reps 3
    python3 bench/pause_bench.py --impl pinned      # the link alone
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

GIB = 1 << 30
TENSOR = 256 << 20
IMPLS = ("cudapool", "tms", "pinned")
RESULT = "RESULT "


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=int, default=16, help="GiB paused (default 16)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (default 5)")
    p.add_argument("--impl", choices=("all",) + IMPLS, default="all",
                   help="all (default): cudapool and tms, each in a subprocess")
    p.add_argument("--dry-run", action="store_true", help="print what would run and stop")
    a = p.parse_args(argv)
    if a.size_gib < 1 or a.reps < 1:
        p.error("--size-gib and --reps must be positive")
    return a


def require_pause_api(mod):
    """Exit with a clear message when cudapool lacks pause/resume by tag."""
    missing = [n for n in ("region", "pause", "resume") if not hasattr(mod, n)]
    if missing:
        raise SystemExit(
            f"pause_bench: this cudapool ({getattr(mod, '__version__', '?')}, {getattr(mod, '__file__', '?')}) "
            f"has no {', '.join('cudapool.' + m for m in missing)}: it predates pausing memory by tag.")


def spread(xs):
    """(median, min, max)."""
    return statistics.median(xs), min(xs), max(xs)


# ---- measurements (inside one implementation's process) ----

class Bench:
    def __init__(self, torch, size_gib):
        self.torch = torch
        self.n = size_gib * GIB // TENSOR
        self.bytes = self.n * TENSOR
        self.results = []

    def record(self, what, unit, values, **extra):
        self.results.append({"what": what, "unit": unit, "values": values, **extra})

    def make(self):
        """The tensors (made inside the region: nothing else is, so that the
        tag holds exactly them)."""
        return [self.torch.empty(TENSOR, dtype=self.torch.uint8, device="cuda") for _ in range(self.n)]

    def fill(self, ts):
        """Each tensor from its own seeded generator (outside the region)."""
        for i, t in enumerate(ts):
            t.copy_(self.expected(i))
        self.torch.cuda.synchronize()
        return ts

    def expected(self, i):
        g = self.torch.Generator(device="cuda").manual_seed(1000 + i)
        return self.torch.randint(0, 256, (TENSOR,), dtype=self.torch.uint8, device="cuda", generator=g)

    def intact(self, ts):
        return all(self.torch.equal(t, self.expected(i)) for i, t in enumerate(ts))

    def free(self):
        self.torch.cuda.synchronize()
        return self.torch.cuda.mem_get_info()[0]

    def timed(self, fn):
        self.torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        self.torch.cuda.synchronize()
        return time.perf_counter() - t0

    def link(self, ts, impl, reps):
        """A plain pinned copy of every tensor, device to host and back."""
        torch = self.torch
        host = torch.empty(self.bytes, dtype=torch.uint8, pin_memory=True)
        slices = [host[i * TENSOR:(i + 1) * TENSOR] for i in range(self.n)]

        def d2h():
            for h, t in zip(slices, ts):
                h.copy_(t, non_blocking=True)

        def h2d():
            for h, t in zip(slices, ts):
                t.copy_(h, non_blocking=True)

        gib = self.bytes / GIB
        down, up = [], []
        for _ in range(reps):
            down.append(gib / self.timed(d2h))
            up.append(gib / self.timed(h2d))
        self.record("link D2H (pinned copy_)", "GiB/s", down, impl=impl)
        self.record("link H2D (pinned copy_)", "GiB/s", up, impl=impl)
        del slices, host
        getattr(torch._C, "_host_emptyCache", lambda: None)()  # give the pinned buffer back

    def pause_resume(self, ts, impl, reps, keep, pause, resume):
        """Timed pause/resume cycles of the tag holding ts."""
        gib = self.bytes / GIB
        p_times, r_times, freed, ok = [], [], [], True
        for _ in range(reps + (1 if keep else 0)):
            before = self.free()
            p_times.append(self.timed(pause))
            freed.append(self.free() - before)
            r_times.append(self.timed(resume))
            if keep:
                ok = ok and self.intact(ts)
        label = "keep=True" if keep else "keep=False"
        if keep:
            first = p_times.pop(0)
            r_times.pop(0)
            self.record(f"pause {label}", "GiB/s", [gib / t for t in p_times], impl=impl,
                        note=f"first pause {first * 1e3:.0f} ms (pins host memory)")
            self.record(f"resume {label}", "GiB/s", [gib / t for t in r_times], impl=impl,
                        note="contents intact" if ok else "CONTENTS DIFFER")
        else:
            self.record(f"pause {label}", "ms", [t * 1e3 for t in p_times], impl=impl)
            self.record(f"resume {label}", "ms", [t * 1e3 for t in r_times], impl=impl)
        worst = max(abs(1 - f / self.bytes) for f in freed)
        self.record(f"freed by pause {label}", "% of tag", [100 * f / self.bytes for f in freed], impl=impl,
                    note="within 1%" if worst <= 0.01 else "NOT within 1%")
        return ok


def run_cudapool(a):
    try:
        import cudapool
    except ImportError as e:
        raise SystemExit(f"pause_bench: cannot import cudapool ({e})") from e
    require_pause_api(cudapool)
    cudapool.install()
    import torch
    b = Bench(torch, a.size_gib)
    with cudapool.region("bench"):
        ts = b.make()
    b.fill(ts)
    b.link(ts, "cudapool", a.reps)
    for keep in (True, False):
        b.pause_resume(ts, "cudapool", a.reps, keep,
                       lambda: cudapool.pause("bench", keep=keep), lambda: cudapool.resume("bench"))
    release = getattr(cudapool, "release_host_memory", None)
    if release is not None:
        t = b.timed(release)
        b.record("release_host_memory", "ms", [t * 1e3], impl="cudapool")
    return b.results


def run_tms(a):
    if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        raise SystemExit("pause_bench: torch_memory_saver refuses expandable segments; unset PYTORCH_CUDA_ALLOC_CONF")
    import torch
    from torch_memory_saver import torch_memory_saver as tms
    tms.hook_mode = "torch"
    b = Bench(torch, a.size_gib)
    for keep in (True, False):
        tag = f"bench_keep{int(keep)}"
        with tms.region(tag=tag, enable_cpu_backup=keep):
            ts = b.make()
        b.fill(ts)
        if keep:
            b.link(ts, "tms", a.reps)
        b.pause_resume(ts, "tms", a.reps, keep, lambda: tms.pause(tag), lambda: tms.resume(tag))
        del ts
        torch.cuda.empty_cache()
    return b.results


def run_pinned(a):
    import torch
    b = Bench(torch, a.size_gib)
    b.link(b.fill(b.make()), "pinned", a.reps)
    return b.results


def format_table(results):
    rows = [("impl", "what", "median", "min-max", "unit", "")]
    for r in results:
        med, lo, hi = spread(r["values"])
        fmt = "{:.2f}" if r["unit"] != "ms" else "{:.1f}"
        rows.append((r["impl"], r["what"], fmt.format(med), f"{fmt.format(lo)}-{fmt.format(hi)}", r["unit"],
                     r.get("note", "")))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row[:5], widths)) + ("  " + row[5] if row[5] else "")
                     for row in rows)


# The markdown table's rows: (label, what, unit, the link's row for the
# same direction).
MARKDOWN_ROWS = (
    ("pause, contents kept", "pause keep=True", "GiB/s", "link D2H (pinned copy_)"),
    ("resume, contents kept", "resume keep=True", "GiB/s", "link H2D (pinned copy_)"),
    ("pause, contents discarded", "pause keep=False", "ms", None),
    ("resume, contents discarded", "resume keep=False", "ms", None),
    ("driver memory given back by pause", "freed by pause keep=True", "% of tag", None),
)
IMPL_NAMES = {"cudapool": "cudapool", "tms": "torch_memory_saver 0.0.10", "pinned": "pinned copy_"}


def format_markdown(results, size_gib):
    """One markdown table: medians (min-max) per implementation, and the
    plain pinned copy_ of the same bytes beside the copying rows."""
    by = {(r["impl"], r["what"]): r for r in results}
    impls = [i for i in ("cudapool", "tms") if any(r["impl"] == i for r in results)]
    link_impl = next((i for i in ("cudapool", "pinned", "tms") if (i, "link D2H (pinned copy_)") in by), None)

    def cell(r):
        if r is None:
            return "-"
        med, lo, hi = spread(r["values"])
        fmt = "{:.1f}" if r["unit"] in ("ms", "% of tag") else "{:.2f}"
        out = fmt.format(med)
        if len(r["values"]) > 1:
            out += f" ({fmt.format(lo)}-{fmt.format(hi)})"
        return out

    head = [f"{size_gib} GiB"] + [IMPL_NAMES[i] for i in impls] + (["pinned copy_ (the link)"] if link_impl else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, what, unit, link in MARKDOWN_ROWS:
        row = [f"{label} ({unit})"] + [cell(by.get((i, what))) for i in impls]
        if link_impl:
            row.append(cell(by.get((link_impl, link))) if link else "")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv=None):
    a = parse_args(argv)
    impls = ("cudapool", "tms") if a.impl == "all" else (a.impl,)
    if a.dry_run:
        for impl in impls:
            print(f"{impl}: {a.size_gib} GiB in {a.size_gib * GIB // TENSOR} tensors of 256 MiB, {a.reps} reps"
                  f"{'' if impl == 'pinned' else ', pause keep=True and keep=False'}")
        return 0
    if a.impl != "all":
        results = {"cudapool": run_cudapool, "tms": run_tms, "pinned": run_pinned}[a.impl](a)
        print(RESULT + json.dumps(results), flush=True)
        print(format_table(results))
        print("\n" + format_markdown(results, a.size_gib))
        return 0
    results = []
    for impl in impls:
        cmd = [sys.executable, os.path.abspath(__file__), "--impl", impl,
               "--size-gib", str(a.size_gib), "--reps", str(a.reps)]
        print("running:", " ".join(cmd), flush=True)
        p = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith(RESULT)]
        if p.returncode != 0 or not lines:
            print(f"{impl} failed (exit {p.returncode}):\n{p.stderr.strip()[-2000:]}", file=sys.stderr)
            continue
        results += json.loads(lines[-1][len(RESULT):])
    if not results:
        return 1
    print(format_table(results))
    print("\n" + format_markdown(results, a.size_gib))
    return 0


if __name__ == "__main__":
    sys.exit(main())
