#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""PyTorch-level benchmarks of one allocator configuration, in this process.

    python3 bench/torch_bench.py CONFIG [--sections train,graph,empty] [...]

CONFIG is one of
    native      PyTorch's caching allocator (PYTORCH_CUDA_ALLOC_CONF unset)
    expandable  the same with expandable_segments:True
    async       backend:cudaMallocAsync
    cudapool    cudapool.install() (libcudapool.so from $CUDAPOOL_LIBRARY or
                the repository's lib/), before CUDA is initialized, with its
                defaults (expandable segments with stitching); cudapool_exp,
                cudapool_segments and the others below set their
                configuration
The allocator variables of the environment are replaced by the config's.
Run each config in a fresh process (bench/run_bench.sh does).

Sections, in this order (the same for every config):
  train  GPT-2 small (bench/model.py), bf16 autocast, AdamW, batch 8,
         variable sequence lengths from model.seq_lens (seed 1): warm-up
         steps, then one step at each timed length not yet seen
         (workloads.warmup_lens), then timed steps (synchronized wall time,
         mean ms/step).
         Peak allocated / reserved over the whole section, which runs first
         in a fresh process (torch.cuda.max_memory_allocated/reserved;
         cudapool.install() routes these to cudapool).
  graph  torch.cuda.graph capture of the same model's forward (bf16 weights,
         no_grad, batch 8, sequence 512) after a warm-up on a side stream,
         --graph-captures times, each into a new graph and private pool while
         the earlier graphs stay alive (so each capture takes new segments, as
         the first does): capture time (the whole `with torch.cuda.graph`
         block and a synchronize, instantiation included) as the median of
         the process's captures, with the first capture and every capture's
         time also reported; mean replay time of the last graph; and the
         private pool's size: reserved bytes after the first capture minus
         before (the cache is emptied first). The
         cudaMallocAsync backend's graph memory is not in its reserved
         statistic, so for it the pool size is the drop of free device memory
         (torch.cuda.mem_get_info) from before the capture to after the first
         replay; that drop is reported for every config too.
  empty  torch.empty + free: 4 KiB (median us/pair of reps), and the C
         benchmark's mixed sequence (bench/workloads.py: 256 live tensors,
         512 B - 144 MiB) after one warm-up cycle.
  alt    (cudapool's configurations) the empty section's loops, and with
         --alt-captures the graph section's captures, PyTorch's allocator
         and cudapool alternating rep by rep (capture by capture) in this
         process: cudapool's class hands the native reps to the allocator it
         replaced (passthrough, a switch of the benchmark's build of the
         class: bench/bench_ext.py, installed instead of cudapool.install()
         when this section runs). Per-pair ratios. With an expandable
         configuration (cudapool_exp) the native side has
         expandable_segments:True too (PYTORCH_CUDA_ALLOC_CONF).
  altcompile (cudapool's configurations; not run unless asked for)
         torch.compile(mode="reduce-overhead") through CUDA graph trees,
         native and cudapool alternating rep by rep in this process as in
         alt: --alt-decode pairs of greedy decoding with a static KV cache
         (GPT.decode of bench/model.py, ms per token) and --alt-compiled
         pairs of calls of a small compiled MLP (us per call). Each side has
         its own model, compiled function, graph tree and graph pool, made
         during its own turns (altcompile_sides), so a rep measures the
         side's replays and the eager work around them (every allocate()
         there is the side's); a counted rep per side gives the allocator
         calls per token or call.

BENCH_TURNS=IN:OUT:first|second (two FIFOs) makes two processes on one CPU
take turns (bench/turn_pair.sh starts such a pair, tagging its lines with
BENCH_TURNS_TAG, and pins them or, with BENCH_TURNS_PIN=CPUS, has this
script pin its main thread): only one main thread runs at a time, and each
passes the turn after every timed rep (training block, capture, empty rep),
so rep k of the two processes runs back to back (docs/benchmarks.md, "The
measures"). The times exclude the waits.

Output: one JSON line per section on stdout ("kind":"torch"); a failing
section prints its "<section>_error" and the next one still runs.
"""
import argparse
import builtins
import gc
import json
import os
import select
import statistics
import sys
import time
import traceback
import types

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import workloads  # noqa: E402

CONFIGS = {
    "native": "",
    "expandable": "expandable_segments:True",
    "async": "backend:cudaMallocAsync",
    "cudapool": None,
    # cudapool with expandable segments without stitching, as native's
    # expandable_segments:True (set through cudapool.configure); "cudapool"
    # is its default, expandable segments with stitching.
    "cudapool_exp": None,
    # The same mapping page by page (expandable_map_unit_mb:2), and
    # stitch:True named (docs/fragmentation.md): gpu/bench_stitch_train.sh.
    "cudapool_exp2": None,
    # cudapool with ordinary segments (expandable_segments:False): native's
    # default layout, and cudapool's before stitching became the default;
    # and with stitch:True named (the default's settings, named).
    "cudapool_segments": None,
    "cudapool_stitch": None,
    # cudapool with the large pool stitched in 4 MiB allocations
    # (stitch_chunk_mb:4; docs/fragmentation.md, "Chunks").
    "cudapool_chunk4": None,
    # cudapool without its front cache (allocator/front.go): for diagnostics.
    "cudapool_nofront": None,
    # cudapool with the treap free set (free_set:treap), and with the Go
    # runtime's sysmon kept out of its deep sleep (GODEBUG=schedtrace in the
    # environment the process starts with: sched_reexec): diagnostics.
    "cudapool_treap": None,
    "cudapool_sched": None,
    # cudapool with capi/warm's keeper off (warm_runtime:False): diagnostics.
    "cudapool_cold": None,
    # cudapool from the library $CUDAPOOL_LIBRARY_B names (another build, for
    # an A/B in one ring): diagnostics.
    "cudapool_b": None,
    "cudapool_exp_b": None,  # the same as cudapool_exp
    # A trivial C pluggable allocator (bench/floor_alloc.c): what PyTorch's
    # CUDAPluggableAllocator path costs by itself. Only the 4 KiB loop.
    "floor": None,
}
# cudapool's configurations and their settings (through cudapool.configure).
CUDAPOOL_CONFS = {
    "cudapool": "",
    "cudapool_exp": "expandable_segments:True,stitch:False",
    "cudapool_segments": "expandable_segments:False",
    "cudapool_exp2": "expandable_segments:True,stitch:False,expandable_map_unit_mb:2",
    "cudapool_stitch": "stitch:True",
    "cudapool_chunk4": "stitch_chunk_mb:4",
    "cudapool_nofront": "front_cache:False",
    "cudapool_treap": "free_set:treap",
    "cudapool_sched": "",
    "cudapool_b": "",
    "cudapool_exp_b": "expandable_segments:True,stitch:False",
    "cudapool_cold": "warm_runtime:False",
}
SECTIONS = ("train", "graph", "empty", "alt", "altcompile")
# "alt" and "altcompile" (cudapool's configurations only) alternate native
# and cudapool within one process: not run unless asked for.
ALT_SECTIONS = ("alt", "altcompile")
DEFAULT_SECTIONS = ("train", "graph", "empty")
VOCAB = 16384


def turns_tag(environ=None):
    """BENCH_TURNS_TAG=KIND:ROUND:ROLE (bench/turn_pair.sh) names a process
    of a pair taking turns: its lines are "kind":"torch_turns" with these
    fields, so that the report keeps them apart from the unpaired runs."""
    v = (os.environ if environ is None else environ).get("BENCH_TURNS_TAG", "")
    if not v:
        return {}
    kind, _, rest = v.partition(":")
    rnd, _, role = rest.partition(":")
    if not kind or role not in ("base", "test"):
        raise ValueError(f"BENCH_TURNS_TAG={v!r}: want KIND:ROUND:base|test")
    return {"turns_kind": kind, "turns_round": rnd, "turns_role": role}


TAG = {}  # set in main() from BENCH_TURNS_TAG


def emit(config, section, **fields):
    rec = {"kind": "torch_turns" if TAG else "torch", "config": config, "section": section}
    rec.update(TAG)
    rec.update(fields)
    print(json.dumps(rec), flush=True)


def short_error(e):
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("config", choices=sorted(CONFIGS))
    p.add_argument("--sections", default=",".join(DEFAULT_SECTIONS),
                   help="comma-separated subset of " + ",".join(SECTIONS))
    p.add_argument("--warmup", type=int, default=5, help="training warm-up steps (then one more at each timed length not yet seen)")
    p.add_argument("--steps", type=int, default=60, help="timed training steps")
    p.add_argument("--train-blocks", type=int, default=6,
                   help="timed training steps run in this many synchronized blocks (one turn each; "
                        "at most --steps)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--graph-seq", type=int, default=512)
    p.add_argument("--graph-replays", type=int, default=50)
    p.add_argument("--graph-captures", type=int, default=6,
                   help="captures per process (the reported time is their median)")
    p.add_argument("--empty-pairs", type=int, default=100_000, help="4 KiB pairs per rep")
    p.add_argument("--mixed-pairs", type=int, default=50_000, help="mixed pairs per rep")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--alt-timing", nargs="?", const="on", choices=("on", "cross"),
                   help="alt section: also time each allocate() and deleter call of both allocators "
                        "(bench_ext.timing; adds two clock reads per call), and with --alt-captures each "
                        "capture's phases and calls (timed_captures); cross: native's allocate() "
                        "is followed by a near-empty call into cudapool's Go code")
    p.add_argument("--alt-captures", type=int, default=6,
                   help="alt section: pairs of graph captures (the graph section's forward), native and "
                        "cudapool alternating in this process after one discarded capture each (0: none)")
    p.add_argument("--alt-decode", type=int, default=6,
                   help="altcompile section: pairs of decoding reps, native and cudapool alternating after one "
                        "discarded rep each (0: none)")
    p.add_argument("--decode-tokens", type=int, default=64, help="altcompile: tokens decoded per rep")
    p.add_argument("--decode-prompt", type=int, default=16, help="altcompile: prompt tokens (prefilled once)")
    p.add_argument("--decode-batch", type=int, default=1, help="altcompile: sequences decoded together")
    p.add_argument("--alt-compiled", type=int, default=6,
                   help="altcompile section: pairs of reps of compiled calls, native and cudapool alternating "
                        "after one discarded rep each (0: none)")
    p.add_argument("--compiled-calls", type=int, default=500, help="altcompile: calls per rep")
    p.add_argument("--compiled-batch", type=int, default=32, help="altcompile: the MLP's batch")
    p.add_argument("--compiled-width", type=int, default=1024, help="altcompile: the MLP's width")
    p.add_argument("--compiled-layers", type=int, default=4, help="altcompile: the MLP's blocks")
    p.add_argument("--model-layers", type=int, default=12, help="(for quick tests) GPT layers")
    args = p.parse_args(argv)
    secs = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in secs if s not in SECTIONS]
    if bad or not secs:
        p.error(f"unknown section(s) {bad}; choose from {','.join(SECTIONS)}")
    args.sections = [s for s in SECTIONS if s in secs]
    args.train_blocks = min(args.train_blocks, args.steps)  # a block has a step at least
    for name in ("warmup", "steps", "train_blocks", "batch", "graph_seq", "graph_replays", "graph_captures", "empty_pairs", "mixed_pairs", "reps",
                 "alt_decode", "decode_tokens", "decode_prompt", "decode_batch", "alt_compiled", "compiled_calls",
                 "compiled_batch", "compiled_width", "compiled_layers", "model_layers"):
        if getattr(args, name) < (0 if name in ("warmup", "alt_decode", "alt_compiled") else 1):
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.decode_prompt + args.decode_tokens > 1024:  # GPT's position table (bench/model.py)
        p.error("--decode-prompt plus --decode-tokens must be at most 1024")
    return args


def wait_start(environ=None, clock=time.time, sleep=time.sleep):
    """BENCH_START_AT (Unix time in seconds): the sections start then, not
    before (at most 60 s from now), so that two processes started together
    time the same seconds of the host. Returns the
    seconds waited (negative: how late the sections began)."""
    v = (os.environ if environ is None else environ).get("BENCH_START_AT", "")
    if not v:
        return 0.0
    wait = min(float(v) - clock(), 60.0)
    if wait > 0:
        sleep(wait)
    else:
        print(f"BENCH_START_AT passed {-wait:.2f} s before the sections began", file=sys.stderr)
    return wait


def cpu_list(text):
    """The CPUs of a taskset-style list ("2", "2,4", "2-5")."""
    cpus = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


class Turns:
    """Two processes on one CPU taking turns (BENCH_TURNS=IN:OUT:ROLE, two
    FIFOs, the first process's IN being the second's OUT). begin() is a
    barrier, after which the "second" waits; turn() hands the CPU to the
    other process and waits for it back; end() hands it over for good. A
    process whose partner has ended, or has not answered within timeout
    seconds (default BENCH_TURNS_TIMEOUT, else 300: it failed), stops
    waiting. Without BENCH_TURNS every call does nothing."""

    def __init__(self, spec="", timeout=None):
        self.on = bool(spec)
        self.count = 0        # turns taken
        self.waited = 0.0     # seconds spent waiting for the partner
        self.partner_gone = ""  # why the partner no longer takes turns
        if not self.on:
            return
        # Under torchrun every rank has its own pair of FIFOs: {rank} in
        # their names is the rank (bench/fsdp2_bench.py).
        parts = spec.replace("{rank}", os.environ.get("LOCAL_RANK", "0")).split(":")
        if len(parts) != 3 or parts[2] not in ("first", "second"):
            raise ValueError(f"BENCH_TURNS={spec!r}: want IN:OUT:first|second")
        # O_RDWR: opening a FIFO so never blocks, and it never reads EOF.
        self.fin = os.open(parts[0], os.O_RDWR)
        self.fout = os.open(parts[1], os.O_RDWR)
        self.second = parts[2] == "second"
        self.timeout = float(os.environ.get("BENCH_TURNS_TIMEOUT", "300")) if timeout is None else timeout

    def _pass(self, mark):
        if self.on and not self.partner_gone:
            os.write(self.fout, mark)

    def _wait(self):
        if not self.on or self.partner_gone:
            return
        t0 = time.perf_counter()
        ready, _, _ = select.select([self.fin], [], [], self.timeout)
        if not ready:
            self.partner_gone = f"no answer in {self.timeout:.0f} s"
        elif os.read(self.fin, 1) == b"e":
            self.partner_gone = "ended"
        self.waited += time.perf_counter() - t0

    def begin(self):
        self._pass(b"r")
        self._wait()
        if self.on and self.second:
            self._wait()

    def turn(self):
        if self.on:
            self.count += 1
        self._pass(b"t")
        self._wait()

    def end(self):
        self._pass(b"e")

    def summary(self):
        if not self.on:
            return {}
        return {"turns": self.count, "turns_waited_s": round(self.waited, 3),
                "turns_partner_gone": self.partner_gone}


TURNS = Turns()  # replaced in main() from BENCH_TURNS


def set_allocator_env(config, environ=None):
    """Replaces the allocator variables of environ with the config's."""
    env = os.environ if environ is None else environ
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CUDAPOOL_CONF", "CUDAPOOL_BACKEND"):
        env.pop(key, None)
    conf = CONFIGS[config]
    if conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf


def alt_native_conf(config, sections):
    """The PYTORCH_CUDA_ALLOC_CONF of the alt sections' native side (the
    allocator cudapool's class hands the native reps to), or "": with
    cudapool's expandable configurations, expandable_segments:True, so that
    the pair compares like with like (cudapool reads the variable too, and
    configure() then sets its whole configuration)."""
    if any(sec in sections for sec in ALT_SECTIONS) and "expandable_segments:True" in (CUDAPOOL_CONFS.get(config) or ""):
        return "expandable_segments:True"
    return ""


def cleanup(torch):
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def bench_train(torch, args):
    from model import GPT, batch, seq_lens

    torch.manual_seed(0)
    model = GPT(layers=args.model_layers).cuda()
    model_bytes = torch.cuda.memory_allocated()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    lens = seq_lens(args.warmup + args.steps, seed=1)
    # Every length the timed steps use is seen once in the warm-up: a new
    # length's first step is 4-9x an ordinary one, for every allocator.
    warm = workloads.warmup_lens(lens, args.warmup)

    def step(n, seed):
        x, y = batch(n, args.batch, VOCAB, "cuda", seed=seed)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    t0 = time.perf_counter()
    for j, n in enumerate(warm):
        step(n, j if j < args.warmup else 100_000 + j)
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    # The timed steps in synchronized blocks, a turn after each (the waits
    # are not timed).
    loss = None
    blocks = []
    h0 = front_hits()
    n0 = device_calls(torch)["allocation.all.allocated"]
    bounds = [args.warmup + args.steps * b // args.train_blocks for b in range(args.train_blocks + 1)]
    for lo, hi in zip(bounds, bounds[1:]):
        t0 = time.perf_counter()
        for i in range(lo, hi):
            loss = step(lens[i], i)
        torch.cuda.synchronize()
        blocks.append(((time.perf_counter() - t0) * 1e3, hi - lo))
        TURNS.turn()
    dt = sum(ms for ms, _ in blocks) / 1e3
    h1 = front_hits()
    n1 = device_calls(torch)["allocation.all.allocated"]
    final_loss = float(loss.detach())
    out = {
        "train_ms_per_step": dt * 1e3 / args.steps,
        "train_block_ms_per_step": [ms / n for ms, n in blocks],
        "train_steps": args.steps,
        "train_warmup_steps": len(warm),
        "train_warmup_every_len": True,
        "train_warmup_s": warm_s,
        "train_batch": args.batch,
        "train_tokens_timed": args.batch * sum(lens[args.warmup:]),
        "train_peak_allocated": int(torch.cuda.max_memory_allocated()),
        "train_peak_reserved": int(torch.cuda.max_memory_reserved()),
        "train_model_bytes": int(model_bytes),
        "train_final_loss": final_loss,
        "train_allocs_per_step": (n1 - n0) / args.steps,
    }
    if h0 is not None and h1 is not None:
        out["train_front_hits_per_step"] = (h1 - h0) / args.steps
    del model, opt, loss
    return out


def warm_forward(torch, model, x, n=3):
    """Runs model(x) n times on a side stream and waits for it: the warm-up
    PyTorch's CUDA graph documentation asks for before a capture (cuBLAS
    handles, workspaces and the allocator's cache made outside the graph)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(n):
            model(x)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


# memory_stats counters read around the graph captures and the mixed
# torch.empty reps: the allocations, and the driver's allocations and frees.
COUNTED = ("allocation.all.allocated", "num_device_alloc", "num_device_free", "num_alloc_retries")


def front_hits(dev=0):
    """cudapool's front cache hits on device dev so far (mallocs served
    without entering Go), or None for another allocator."""
    mod = sys.modules.get("cudapool")
    if mod is None:
        return None
    try:
        return int(mod.front_counters(dev)["hits"])
    except Exception:  # noqa: BLE001  (an older library without the counters)
        return None


def use_library_b(cfg):
    """For the configurations ending in _b (a second build, to compare two):
    point $CUDAPOOL_LIBRARY at the library $CUDAPOOL_LIBRARY_B names, before
    cudapool loads it."""
    if not cfg.endswith("_b"):
        return
    if not os.environ.get("CUDAPOOL_LIBRARY_B"):
        raise RuntimeError(f"{cfg} loads the library $CUDAPOOL_LIBRARY_B names, and it is not set")
    os.environ["CUDAPOOL_LIBRARY"] = os.environ["CUDAPOOL_LIBRARY_B"]


def device_calls(torch, dev=0):
    """The COUNTED counters of device dev now (0 where an allocator lacks one)."""
    st = torch.cuda.memory_stats(dev)
    return {k: int(st.get(k, 0)) for k in COUNTED}


def graph_model(torch, args):
    """The graph section's model (GPT-2 small, bf16 weights, eval) and its
    input (batch x graph_seq tokens)."""
    from model import GPT

    torch.manual_seed(0)
    model = GPT(layers=args.model_layers).cuda().to(torch.bfloat16).eval()
    gen = torch.Generator(device="cuda").manual_seed(1234)
    x = torch.randint(0, VOCAB, (args.batch, args.graph_seq), device="cuda", generator=gen)
    return model, x


def timed_capture(torch, model, x):
    """One capture of the graph rows: torch.cuda.graph of model(x) into a
    new graph (and private pool), timed in phases, ms: enter
    (graph.__enter__: synchronize, empty_cache, capture_begin), forward
    (the captured forward), exit (__exit__: capture_end and instantiation),
    sync (the synchronize after it) and total. Returns the graph, its output
    and the phases."""
    g = torch.cuda.CUDAGraph()
    pc = time.perf_counter
    t0 = pc()
    with torch.cuda.graph(g):
        t1 = pc()
        y = model(x)
        t2 = pc()
    t3 = pc()
    torch.cuda.synchronize()
    t4 = pc()
    return g, y, {"enter": (t1 - t0) * 1e3, "forward": (t2 - t1) * 1e3, "exit": (t3 - t2) * 1e3,
                  "sync": (t4 - t3) * 1e3, "total": (t4 - t0) * 1e3}


def bench_graph(torch, args):
    model, x = graph_model(torch, args)
    out = {"graph_batch": args.batch, "graph_seq": args.graph_seq, "graph_replays": args.graph_replays}
    with torch.no_grad():
        warm_forward(torch, model, x)
        t0 = time.perf_counter()
        for _ in range(args.graph_replays):
            ref = model(x)
        torch.cuda.synchronize()
        out["graph_eager_ms"] = (time.perf_counter() - t0) * 1e3 / args.graph_replays

        # torch.cuda.graph empties the cache itself before capturing; do it
        # first so that "before" is what the capture starts from. Every graph
        # and its output stay alive until the end, so each capture takes new
        # segments for its new private pool, as the first does. One capture
        # per process would time the process's one-off costs and little else
        # (docs/benchmarks.md, "The host").
        caps = []
        phases = {k: [] for k in ("enter", "forward", "exit", "sync")}
        counts = {k: [] for k in COUNTED}
        hits = []  # cudapool's front hits per capture
        kept = []
        # PyTorch 2.11's cudaMallocAsync backend aborts (CUDA "invalid
        # argument" in its free_impl) in this loop: it captures once, as this
        # section did before (it has no target).
        n_caps = 1 if args.config == "async" else args.graph_captures
        for i in range(n_caps):
            cleanup(torch)
            if i == 0:
                reserved0 = torch.cuda.memory_reserved()
                free0 = torch.cuda.mem_get_info()[0]
            c0 = device_calls(torch)
            h0 = front_hits()
            g, y, ph = timed_capture(torch, model, x)
            caps.append(ph["total"])
            # Where the capture's time went (its enter phase is about 0.3
            # ms, so no full gc.collect), and what the allocator did: read
            # after the timing, so that nothing is added to it.
            for k in phases:
                phases[k].append(ph[k])
            c1 = device_calls(torch)
            for k in COUNTED:
                counts[k].append(c1[k] - c0[k])
            if h0 is not None:
                hits.append(front_hits() - h0)
            kept.append((g, y))
            if i == 0:
                reserved1 = torch.cuda.memory_reserved()
                g.replay()
                torch.cuda.synchronize()
                free1 = torch.cuda.mem_get_info()[0]
            # After mem_get_info, which sees the whole device: the partner's
            # memory must not change between free0 and free1.
            TURNS.turn()
        out["graph_capture_ms"] = statistics.median(caps)
        out["graph_capture_first_ms"] = caps[0]
        out["graph_capture_reps_ms"] = caps
        out["graph_captures"] = len(caps)
        for k, v in phases.items():
            out[f"graph_{k}_reps_ms"] = v
        for k, v in counts.items():
            out[f"graph_{k}_reps"] = v
        if hits:
            out["graph_front_hits_reps"] = hits
        g.replay()
        torch.cuda.synchronize()
        out["graph_max_abs_diff"] = float((y.float() - ref.float()).abs().max())
        t0 = time.perf_counter()
        for _ in range(args.graph_replays):
            g.replay()
        torch.cuda.synchronize()
        out["graph_replay_ms"] = (time.perf_counter() - t0) * 1e3 / args.graph_replays
        out["graph_pool_reserved_delta"] = int(reserved1 - reserved0)
        out["graph_devmem_delta"] = int(free0 - free1)
        if args.config == "async":
            out["graph_pool_bytes"] = out["graph_devmem_delta"]
            out["graph_pool_source"] = "mem_get_info"
        else:
            out["graph_pool_bytes"] = out["graph_pool_reserved_delta"]
            out["graph_pool_source"] = "reserved"
        # The outputs go before their graphs.
        graphs = [k[0] for k in kept]
        del y, ref
        kept.clear()
        del g
        graphs.clear()
    del model, x
    return out


def empty_loops(torch):
    """The timed torch.empty loops of bench_empty and bench_alt: small(n),
    n pairs of 4 KiB, and mixed(live, start, n), n pairs of the mixed
    sequence from position start over the 256 tensors in live; each
    returns us per pair; and fill(), the 256 tensors the mixed loop starts
    from."""
    dev = torch.device("cuda", 0)
    u8 = torch.uint8
    empty = torch.empty
    size = workloads.HOT_SIZE
    sizes, slots = workloads.mixed_sequence()
    mask = workloads.SEQ - 1

    def small(n):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            empty(size, dtype=u8, device=dev)
        return (time.perf_counter_ns() - t0) / n / 1e3

    def mixed(live, start, n):
        t0 = time.perf_counter_ns()
        for i in range(start, start + n):
            j = i & mask
            s = slots[j]
            live[s] = None
            live[s] = empty(sizes[j], dtype=u8, device=dev)
        return (time.perf_counter_ns() - t0) / n / 1e3

    def fill():
        return [empty(sizes[s], dtype=u8, device=dev) for s in range(workloads.LIVE)]

    return small, mixed, fill


def bench_empty(torch, args):
    small, mixed, fill = empty_loops(torch)
    small(10_000)
    reps = []
    for _ in range(args.reps):
        reps.append(small(args.empty_pairs))
        TURNS.turn()
    out = {"empty_small_us": statistics.median(reps), "empty_small_reps_us": reps,
           "empty_pairs": args.empty_pairs}
    if args.config == "floor":  # it caches by exact size: the mixed loop would exhaust memory
        return out

    live = fill()
    t0 = time.perf_counter()
    mixed(live, 0, workloads.SEQ)
    out["empty_mixed_warmup_ms"] = (time.perf_counter() - t0) * 1e3
    start = workloads.SEQ
    mreps = []
    c0 = device_calls(torch)
    for _ in range(args.reps):
        mreps.append(mixed(live, start, args.mixed_pairs))
        TURNS.turn()
        start += args.mixed_pairs
    c1 = device_calls(torch)
    out.update({"empty_mixed_us": statistics.median(mreps), "empty_mixed_reps_us": mreps,
                "empty_mixed_pairs": args.mixed_pairs})
    # Driver allocations and frees during the timed reps: the same best fit
    # makes the same number, so a difference is a difference of algorithm.
    for k in COUNTED:
        out[f"empty_mixed_{k}"] = c1[k] - c0[k]
    live.clear()
    return out


def bench_alt(torch, args):
    """The torch.empty loops of bench_empty, PyTorch's allocator and cudapool
    alternating rep by rep within this process (A B, B A, ...), as
    bench/pair_bench.c does in C: cudapool's C++ class hands allocate() to
    the allocator it replaced while a native rep runs (bench_ext.passthrough).
    Both reps of a pair meet the host in the same state; what the switch
    itself costs (one predictable branch in the class) falls on native's
    side. Per loop: each side's per-rep us, the per-pair ratios
    cudapool/native and their median. Then, with --alt-captures, the graph
    section's captures alternating the same way (alt_captures)."""
    if args.config not in CUDAPOOL_CONFS:
        raise RuntimeError("the alt section needs one of cudapool's configurations")
    import bench_ext as ext

    small, mixed, fill = empty_loops(torch)
    sides = ("native", "cudapool")
    live = {}
    timed = getattr(args, "alt_timing", False)
    try:
        if timed:
            ext.timing(True, cross=timed == "cross")
        for side in sides:
            ext.passthrough(side == "native")
            small(10_000)
            live[side] = fill()
            mixed(live[side], 0, workloads.SEQ)
        out = {}
        for loop, n in (("small", args.empty_pairs), ("mixed", args.mixed_pairs)):
            reps = {side: [] for side in sides}
            calls = {}  # (allocator, call) -> ([ns], timed calls), over the loop's reps
            if timed:
                ext.timing_take()  # the warm-up's and the last loop's stragglers
            start = workloads.SEQ
            for i in range(args.reps):
                for side in (sides if i % 2 == 0 else sides[::-1]):
                    ext.passthrough(side == "native")
                    reps[side].append(small(n) if loop == "small" else mixed(live[side], start, n))
                    if timed:
                        for key, (ns, c) in ext.timing_take().items():
                            acc = calls.setdefault(key, ([], [0]))
                            acc[0].extend(ns)
                            acc[1][0] += c
                start += n
            ratios = [c / b for b, c in zip(reps["native"], reps["cudapool"])]
            out.update({f"alt_{loop}_ratio": statistics.median(ratios), f"alt_{loop}_ratio_reps": ratios,
                        f"alt_{loop}_native_reps_us": reps["native"], f"alt_{loop}_cudapool_reps_us": reps["cudapool"],
                        f"alt_{loop}_pairs": n})
            if timed:
                out.update(call_summary(f"alt_{loop}", calls))
        if args.alt_captures:
            try:
                out.update(timed_captures(torch, args, ext) if timed else alt_captures(torch, args, ext))
            except Exception as e:  # noqa: BLE001  (the loops' results stand)
                traceback.print_exc()
                out["alt_capture_error"] = short_error(e)
        return out
    finally:
        live.clear()
        try:
            ext.passthrough(False)
            if timed:
                ext.timing(False)
        except ext.ExtensionUnavailable:
            pass  # never switched: the error that brought us here is the one to see


def alt_captures(torch, args, ext, before=None, after=None):
    """The graph section's capture (torch.cuda.graph of the forward, each
    into a new private pool, every graph kept), PyTorch's allocator and
    cudapool alternating capture by capture in this process (N C, C N, ...)
    after one discarded capture each: while passthrough is on, cudapool's
    class hands the capture (its allocations, empty_cache, the pool hooks
    and the pool's release) to the allocator it replaced. Both captures of a
    pair meet the host in the same state, which the graph row's processes
    do not (docs/benchmarks.md, "The measures"). Per side each capture's ms, the
    per-pair ratios cudapool/native and their median.

    A caller may look inside: before(side) runs just before a
    capture's clock starts, after(side, row) just after it stops, with row
    the capture's phases in ms (enter: synchronize, empty_cache and
    capture_begin; forward; exit: capture_end and instantiation; sync;
    total), which it may add to; with after, the rows of the captures that
    count are returned too (alt_capture_rows)."""
    sides = ("native", "cudapool")
    ext.passthrough(False)
    model, x = graph_model(torch, args)
    rows = []
    kept = []
    order = list(sides)
    for k in range(args.alt_captures):
        order += sides if k % 2 else sides[::-1]
    try:
        with torch.no_grad():
            for side in sides:  # each allocator's cache and cuBLAS's workspaces made outside a graph
                ext.passthrough(side == "native")
                warm_forward(torch, model, x)
            for i, side in enumerate(order):
                ext.passthrough(side == "native")
                cleanup(torch)
                if before:
                    before(side)
                g, y, ph = timed_capture(torch, model, x)
                row = {"side": side, **ph}
                if after:
                    after(side, row)
                if i >= len(sides):
                    rows.append(row)
                kept.append((g, y))
                del g, y
    finally:
        ext.passthrough(False)
        graphs = [k[0] for k in kept]
        kept.clear()  # the outputs before their graphs
        graphs.clear()  # a graph of native's releases its pool to native whatever the switch says
    caps = {side: [r["total"] for r in rows if r["side"] == side] for side in sides}
    ratios = [c / n for n, c in zip(caps["native"], caps["cudapool"])]
    out = {"alt_capture_ratio": statistics.median(ratios), "alt_capture_ratio_reps": ratios,
           "alt_capture_native_reps_ms": caps["native"], "alt_capture_cudapool_reps_ms": caps["cudapool"],
           "alt_capture_pairs": len(ratios)}
    if after:
        out["alt_capture_rows"] = rows
    return out


CAPTURE_PHASES = ("enter", "forward", "exit", "sync")


def timed_captures(torch, args, ext, top=8):
    """alt_captures with the class's call timing on (--alt-timing), to see
    where a capture's time goes. Per side, the median over the captures
    that count of each phase (alt_capture_<side>_<phase>_ms), of the device
    allocations a capture made (..._device_allocs: a side that makes more
    segments pays more driver calls) and of the MiB its reserved memory
    grew by (..._reserved_mib); per timed call kind, the median per capture
    of the calls' total and of its top slowest calls' (..._per_capture_ms,
    ..._top<top>_per_capture_ms: where a few calls that reach the driver
    carry the time, the two are close), the median of each of those
    slowest calls by rank (..._top_us, slowest first, as deep as the
    capture with the fewest calls: whether a side has more slow calls or
    slower ones), and call_summary's figures over all those captures'
    calls. Native's counts come from the benchmark's build of the class
    (bench_ext.native_counts); without it they are left out."""
    def counts(side):
        if side == "native":
            try:
                return ext.native_counts(torch.cuda.current_device())
            except ext.ExtensionUnavailable:
                return None
        s = torch.cuda.memory_stats()
        return (s.get("num_device_alloc", 0), s.get("num_device_free", 0), s.get("reserved_bytes.all.current", 0))

    before_counts = {}

    def before(side):
        ext.timing_take()  # what ran between captures is not the capture's
        before_counts[side] = counts(side)

    def after(side, row):
        row["timing"] = ext.timing_take()
        c0, c1 = before_counts.pop(side, None), counts(side)
        if c0 is not None and c1 is not None:
            row["device_allocs"] = c1[0] - c0[0]
            row["reserved_mib"] = (c1[2] - c0[2]) / 2**20

    out = alt_captures(torch, args, ext, before=before, after=after)
    rows = out.pop("alt_capture_rows")
    calls = {}  # (allocator, call) -> ([ns], [calls]) over every capture that counts
    per = {}  # (allocator, call) -> ([ms per capture], [ms of its top calls per capture], [[us of each top call]])
    for row in rows:
        for key, (ns, n) in row.pop("timing").items():
            if not n:
                continue
            acc = calls.setdefault(key, ([], [0]))
            acc[0].extend(ns)
            acc[1][0] += n
            slowest = sorted(ns, reverse=True)[:top]
            sums = per.setdefault(key, ([], [], []))
            sums[0].append(sum(ns) / 1e6)
            sums[1].append(sum(slowest) / 1e6)
            sums[2].append([v / 1e3 for v in slowest])
    for side in ("native", "cudapool"):
        mine = [r for r in rows if r["side"] == side]
        for phase in CAPTURE_PHASES + ("total",) if mine else ():
            out[f"alt_capture_{side}_{phase}_ms"] = statistics.median(r[phase] for r in mine)
        for k in ("device_allocs", "reserved_mib"):
            vals = [r[k] for r in mine if k in r]
            if vals:
                out[f"alt_capture_{side}_{k}"] = statistics.median(vals)
    for (side, call), (total, tops, ranks) in sorted(per.items()):
        out[f"alt_capture_{side}_{call}_per_capture_ms"] = statistics.median(total)
        out[f"alt_capture_{side}_{call}_top{top}_per_capture_ms"] = statistics.median(tops)
        depth = min(len(r) for r in ranks)
        out[f"alt_capture_{side}_{call}_top_us"] = [statistics.median(r[i] for r in ranks) for i in range(depth)]
    out.update(call_summary("alt_capture", calls))
    return out


# ---- altcompile: torch.compile(mode="reduce-overhead"), paired in one process

class GraphTrees:
    """Each side's CUDA graph trees. torch._inductor.cudagraph_trees keeps
    one tree manager, with one graph pool, per device, in a thread-local
    dict of containers; a compiled function binds to the manager there when
    it first runs (its warm-up and recording). use(side) puts the side's
    container there, or none the first time, so that the side's first
    compiled call makes its own manager and pool, during its own turn (its
    pool then belongs to its allocator: bench/torch_allocator_bench.cpp).
    shutdown(side) ends the side's manager (its graphs, so its pool)."""

    def __init__(self, device=0, trees=None):
        if trees is None:
            from torch._inductor import cudagraph_trees as trees
        self.trees = trees
        try:
            self.containers = trees.get_obj(trees.local, "tree_manager_containers")
        except (AttributeError, AssertionError) as e:
            raise RuntimeError("this torch's CUDA graph trees keep no per-device containers where "
                               f"torch._inductor.cudagraph_trees had them ({type(e).__name__}: {e})") from e
        self.device = device
        if self.containers.get(device) is not None:
            raise RuntimeError(f"a CUDA graph tree exists already on device {device}: the sides would share it")
        self.kept = {}  # side -> its container while another side's is in place
        self.side = None

    def use(self, side):
        if side == self.side:
            return
        if self.side is not None:
            self.kept[self.side] = self.containers.pop(self.device, None)
        container = self.kept.pop(side, None)
        if container is not None:
            self.containers[self.device] = container
        else:
            self.containers.pop(self.device, None)
        self.side = side

    def manager(self, side):
        c = self.containers.get(self.device) if side == self.side else self.kept.get(side)
        return getattr(c, "tree_manager", None)

    def graphs(self, side):
        """The graphs recorded in side's tree so far (None if unknown)."""
        mgr = self.manager(side)
        roots = getattr(mgr, "roots", None)
        if roots is None:
            return None if mgr is None else 0
        n, nodes = 0, [node for rs in roots.values() for node in rs]
        while nodes:
            node = nodes.pop()
            n += 1
            nodes.extend(child for cs in getattr(node, "children", {}).values() for child in cs)
        return n

    def shutdown(self, side):
        """Ends side's tree (its graphs and pool); side must be in use."""
        assert side == self.side
        container = self.containers.pop(self.device, None)
        mgr = getattr(container, "tree_manager", None)
        if mgr is not None:
            mgr.shutdown()
            container.tree_manager = None
        self.side = None


def side_function(fn, side, **names):
    """A copy of fn with a code object of its own, running with names as its
    globals: torch.compile keeps compiled code per code object, so each
    side's copy is compiled (and its CUDA graphs recorded) apart."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{side}")
    return types.FunctionType(code, {"__builtins__": builtins, **names}, f"{fn.__name__}_{side}")


def _decode_step(idx, pos):
    return MODEL.decode(idx, pos, CACHE)  # noqa: F821  (side_function's globals)


def _compiled_call(x):
    return MODEL(x)  # noqa: F821  (side_function's globals)


# The decode loop's sampling, as transformers' generate() does it for greedy
# search: EOS is never produced (the vocabulary's ids are below it).
PAD, EOS = 0, VOCAB


def column(torch, t):
    """t (b,) as a (b, 1) tensor of its own with contiguous strides: every
    token the compiled step gets has the same strides, as torch.compile
    guards on them (another stride would compile and record again)."""
    return t.reshape(-1, 1).clone(memory_format=torch.contiguous_format)


def decode_setup(torch, args, side):
    """One side's decoder: GPT (bench/model.py, bf16, eval) with a static
    KV cache, its compiled decode step, and the prompt prefilled through it
    token by token (the step's warm-up, recording and first replays)."""
    from model import GPT, StaticKV

    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = GPT(layers=args.model_layers).to(dev, torch.bfloat16).eval()
    b, n_prompt = args.decode_batch, args.decode_prompt
    cache = StaticKV(model, b, n_prompt + args.decode_tokens)
    step = torch.compile(side_function(_decode_step, side, MODEL=model, CACHE=cache), mode="reduce-overhead",
                         fullgraph=True)
    gen = torch.Generator(device=dev).manual_seed(1234)
    prompt = torch.randint(0, VOCAB, (b, n_prompt), device=dev, generator=gen)
    for i in range(n_prompt):
        logits = step(column(torch, prompt[:, i]), torch.tensor([i], device=dev))
    del logits
    torch.cuda.synchronize()
    return types.SimpleNamespace(model=model, cache=cache, step=step, prompt=prompt,
                                 pos0=torch.tensor([n_prompt - 1], device=dev),
                                 ones=torch.ones(b, dtype=torch.long, device=dev))


def decode_rep(torch, st, n):
    """n greedy tokens after the prompt, as generate() makes them: each a
    replay of the compiled step and the eager sampling, cache position and
    stopping check around it (the check reads the GPU, so a token ends
    there). Returns (ms per token, the token ids)."""
    ids = st.prompt.clone()
    tok = column(torch, ids[:, -1])
    pos = st.pos0.clone()  # the last prompt token's step again, then the new ones
    unfinished = st.ones.clone()
    step, cat = st.step, torch.cat
    t0 = time.perf_counter()
    for _ in range(n):
        logits = step(tok, pos)
        nxt = logits[:, -1, :].argmax(dim=-1)
        nxt = nxt * unfinished + PAD * (1 - unfinished)
        ids = cat([ids, nxt[:, None]], dim=-1)
        unfinished = unfinished & (nxt != EOS)
        pos = pos + 1
        if unfinished.max() == 0:
            break
        tok = nxt[:, None]  # (b, 1), strides (1, 1): as column()'s
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / n, ids


def compiled_setup(torch, args, side):
    """One side's small compiled model: an MLP of --compiled-layers blocks
    (width, 4x width, width; bf16, eval) under reduce-overhead, called
    three times (warm-up, recording, first replay), and 8 inputs."""
    nn = torch.nn
    dev = torch.device("cuda", 0)
    w = args.compiled_width
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(w, 4 * w), nn.GELU(), nn.Linear(4 * w, w))
                            for _ in range(args.compiled_layers))).to(dev, torch.bfloat16).eval()
    step = torch.compile(side_function(_compiled_call, side, MODEL=model), mode="reduce-overhead", fullgraph=True)
    gen = torch.Generator(device=dev).manual_seed(1234)
    inputs = [torch.randn(args.compiled_batch, w, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(8)]
    for i in range(3):
        y = step(inputs[i].clone())
    ref = step(inputs[0].clone()).clone()
    del y
    torch.cuda.synchronize()
    return types.SimpleNamespace(model=model, step=step, inputs=inputs, ref=ref)


def compiled_rep(torch, st, n):
    """n calls of the compiled model, each on a fresh input (a copy of one
    of the 8: one allocation per call, as a caller's new batch), the output
    held until the next call. Returns us per call."""
    step, inputs = st.step, st.inputs
    t0 = time.perf_counter()
    for i in range(n):
        y = step(inputs[i & 7].clone())
    del y
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / n


def altcompile_sides(torch, ext, trees, setup, rep, result, pairs, n):
    """The paired measure of one reduce-overhead row. Each side is set up
    during its own turn (passthrough on for native, its graph tree in
    place), so its model, compiled function, graph tree and graph pool are
    its allocator's. Then one discarded rep each, pairs of timed reps (N C,
    C N, ...), and per side one rep counted with bench_ext's call timing on
    (what each allocator was called for) and result(state), a tensor to
    compare the sides by. Returns ({side: [rep values]}, {side: counts},
    {side: [graphs after set-up, graphs after the reps]}, {side: result}).
    Every side's tree is ended, in its turn, before returning."""
    sides = ("native", "cudapool")
    states, graphs, counts, results = {}, {}, {}, {}
    reps = {side: [] for side in sides}

    def turn(side):
        ext.passthrough(side == "native")
        trees.use(side)

    try:
        for side in sides:
            turn(side)
            gc.collect()
            states[side] = setup(side)
            graphs[side] = [trees.graphs(side)]
        order = list(sides)
        for k in range(pairs):
            order += sides if k % 2 else sides[::-1]
        for i, side in enumerate(order):
            turn(side)
            v = rep(states[side], n)
            if i >= len(sides):
                reps[side].append(v)
        for side in sides:
            turn(side)
            graphs[side].append(trees.graphs(side))
            ext.timing(True)
            try:
                ext.timing_take()
                rep(states[side], n)
                counts[side] = {key: c for key, (_, c) in ext.timing_take().items()}
            finally:
                ext.timing(False)
            results[side] = result(states[side])
    finally:
        for side in sides:
            try:
                turn(side)
                # The tree first: its shutdown drops the cached outputs it
                # registered with torch (which dropping the compiled
                # function would not), then its graphs, so its pool.
                trees.shutdown(side)
                states.pop(side, None)
                gc.collect()
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001  (the other side still ends)
                traceback.print_exc()
        ext.passthrough(False)
    return reps, counts, graphs, results


def altcompile_fields(prefix, unit, per, reps, counts, graphs, n):
    """The JSON fields of one reduce-overhead row."""
    sides = ("native", "cudapool")
    ratios = [c / b for b, c in zip(reps["native"], reps["cudapool"])]
    out = {f"{prefix}_ratio": statistics.median(ratios), f"{prefix}_ratio_reps": ratios,
           f"{prefix}_pairs": len(ratios)}
    for side in sides:
        out[f"{prefix}_{side}_reps_{unit}"] = reps[side]
        out[f"{prefix}_{side}_{unit}"] = statistics.median(reps[side])
        g = graphs.get(side) or []
        if len(g) == 2 and None not in g:
            out[f"{prefix}_{side}_graphs"] = g[1]
            out[f"{prefix}_{side}_graphs_recorded_in_reps"] = g[1] - g[0]
        c = counts.get(side)
        if c:
            other = "cudapool" if side == "native" else "native"
            out[f"{prefix}_{side}_allocs_per_{per}"] = c.get((side, "alloc"), 0) / n
            out[f"{prefix}_{side}_frees_per_{per}"] = c.get((side, "free"), 0) / n
            # Pool hooks and empty_cache in steady replay: a re-recording.
            out[f"{prefix}_{side}_pool_calls"] = sum(c.get((side, k), 0) for k in ("begin_pool", "end_pool",
                                                                                  "empty_cache"))
            # The other allocator's calls during this side's rep: none if the sides are apart.
            out[f"{prefix}_{side}_other_allocs"] = c.get((other, "alloc"), 0)
    return out


def bench_altcompile(torch, args):
    """torch.compile(mode="reduce-overhead") paired in one process: the
    decoding row (--alt-decode pairs, ms per token) and the compiled-call row
    (--alt-compiled pairs, us per call); see altcompile_sides. A row that
    fails gives its error, and the other still runs."""
    if args.config not in CUDAPOOL_CONFS:
        raise RuntimeError("the altcompile section needs one of cudapool's configurations")
    import bench_ext as ext

    out = {}
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        counters = None
    rows = []  # (prefix, unit, per, setup, rep, result, pairs, n)
    if args.alt_decode:
        rows.append(("alt_decode", "ms", "token", lambda side: decode_setup(torch, args, side),
                     lambda st, n: decode_rep(torch, st, n)[0],
                     lambda st: decode_rep(torch, st, args.decode_tokens)[1], args.alt_decode, args.decode_tokens))
    if args.alt_compiled:
        rows.append(("alt_compiled", "us", "call", lambda side: compiled_setup(torch, args, side),
                     lambda st, n: compiled_rep(torch, st, n), lambda st: st.ref, args.alt_compiled,
                     args.compiled_calls))
    out.update({"alt_decode_tokens": args.decode_tokens, "alt_decode_prompt": args.decode_prompt,
                "alt_decode_batch": args.decode_batch, "alt_decode_layers": args.model_layers,
                "alt_decode_width": 768, "alt_compiled_calls": args.compiled_calls,
                "alt_compiled_batch": args.compiled_batch, "alt_compiled_width": args.compiled_width,
                "alt_compiled_layers": args.compiled_layers})
    with torch.no_grad():
        for prefix, unit, per, setup, rep, result, pairs, n in rows:
            try:
                skips0 = counters["inductor"]["cudagraph_skips"] if counters is not None else 0
                reps, counts, graphs, results = altcompile_sides(torch, ext, GraphTrees(), setup, rep, result,
                                                                 pairs, n)
                out.update(altcompile_fields(prefix, unit, per, reps, counts, graphs, n))
                # Same weights, same inputs: the same tokens (outputs) on both sides.
                out[f"{prefix}_same_results"] = bool(torch.equal(results["native"], results["cudapool"]))
                if counters is not None:
                    # Functions torch.compile ran without CUDA graphs: then
                    # the row would not measure graph trees.
                    out[f"{prefix}_cudagraph_skips"] = counters["inductor"]["cudagraph_skips"] - skips0
            except Exception as e:  # noqa: BLE001  (the other row still runs)
                traceback.print_exc()
                out[f"{prefix}_error"] = short_error(e)
            finally:
                try:
                    torch._dynamo.reset()
                except Exception:  # noqa: BLE001
                    traceback.print_exc()
                cleanup(torch)
    return out


def call_summary(prefix, calls):
    """Per (allocator, call) of the alt section's timing: the median, mean
    and 90th percentile of the calls' ns and their number. The mean carries
    the rare calls that reach the driver; the median is a typical call."""
    out = {}
    for (side, call), (ns, n) in sorted(calls.items()):
        key = f"{prefix}_{side}_{call}"
        out[f"{key}_calls"] = n[0]
        if ns:
            q = sorted(ns)
            out.update({f"{key}_median_ns": statistics.median(q), f"{key}_mean_ns": statistics.fmean(q),
                        f"{key}_p90_ns": q[int(0.9 * (len(q) - 1))]})
    return out


SCHED_GODEBUG = "schedtrace=2147483647"


def sched_reexec(cfg, environ=None, argv=None, execve=os.execve):
    """cudapool_sched keeps the Go runtime's sysmon out of its deep sleep
    (GODEBUG schedtrace; docs/hot-path.md, "The Go runtime between calls"). A c-shared Go
    runtime reads the environment the process started with, not os.environ,
    so the setting must be there at exec: the process execs itself once with
    it (same pid, so turn_pair/turn_ring keep track of it)."""
    environ = os.environ if environ is None else environ
    if cfg != "cudapool_sched" or "schedtrace=" in environ.get("GODEBUG", ""):
        return
    env = dict(environ)
    env["GODEBUG"] = ",".join(filter(None, (env.get("GODEBUG"), SCHED_GODEBUG)))
    argv = sys.argv if argv is None else argv
    execve(sys.executable, [sys.executable] + list(argv), env)


def main(argv=None):
    args = parse_args(argv)
    cfg = args.config
    sched_reexec(cfg, argv=None if argv is None else [sys.argv[0]] + list(argv))
    global TAG, TURNS
    try:
        TAG = turns_tag()
        TURNS = Turns(os.environ.get("BENCH_TURNS", ""))
        pin = cpu_list(os.environ["BENCH_TURNS_PIN"]) if os.environ.get("BENCH_TURNS_PIN") else None
    except (OSError, ValueError) as e:
        print(e, file=sys.stderr)
        return 2
    set_allocator_env(cfg)
    t_start = time.perf_counter()
    meta = {"alloc_conf": CONFIGS[cfg] if CONFIGS[cfg] is not None else "cudapool"}
    native_conf = alt_native_conf(cfg, args.sections)
    if native_conf:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = native_conf
        meta["alt_native_conf"] = native_conf
    try:
        if cfg in CUDAPOOL_CONFS:
            sys.path.insert(0, os.path.join(REPO, "python"))
            import cudapool

            use_library_b(cfg)
            if cfg == "cudapool_sched":
                meta["alloc_conf"] = "cudapool GODEBUG=" + os.environ.get("GODEBUG", "")
            if any(sec in args.sections for sec in ALT_SECTIONS):
                # The alt sections' switches are the benchmark's build's:
                # installed instead of the shipped class, for the whole process.
                import bench_ext

                bench_ext.install()
                meta["cudapool_class"] = "benchmark build"
            else:
                cudapool.install()
            if CUDAPOOL_CONFS[cfg]:
                cudapool.configure(CUDAPOOL_CONFS[cfg])
                meta["alloc_conf"] = "cudapool " + CUDAPOOL_CONFS[cfg]
            meta["cudapool_library"] = cudapool.library_path()
        import torch

        if cfg == "floor":
            lib = os.environ["FLOOR_LIB"]
            floor = torch.cuda.memory.CUDAPluggableAllocator(lib, "floor_malloc", "floor_free")
            torch.cuda.memory.change_current_allocator(floor)
            meta["floor_library"] = lib

        if not torch.cuda.is_available():
            raise RuntimeError("torch.cuda.is_available() is False")
        torch.cuda.init()
        meta.update({
            "torch_version": torch.__version__,
            "torch_cuda": torch.version.cuda,
            "device_name": torch.cuda.get_device_name(0),
            "device_total_bytes": int(torch.cuda.get_device_properties(0).total_memory),
        })
        try:
            meta["allocator_backend"] = torch.cuda.get_allocator_backend()
        except Exception as e:  # noqa: BLE001
            meta["allocator_backend"] = f"? ({short_error(e)})"
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        emit(cfg, "meta", meta_error=short_error(e), **meta)
        TURNS.end()  # the partner need not wait for a process that never starts
        return 1
    emit(cfg, "meta", **meta)

    funcs = {"train": bench_train, "graph": bench_graph, "empty": bench_empty, "alt": bench_alt,
             "altcompile": bench_altcompile}
    if pin:
        # This thread alone (Linux: pid 0 is the calling thread), after the
        # library, torch and CUDA started theirs: those stay free, the
        # threads started from here on (autograd's) follow this one.
        os.sched_setaffinity(0, pin)
    wait_start()
    TURNS.begin()
    failed = 0
    for name in args.sections:
        t0 = time.perf_counter()
        try:
            res = funcs[name](torch, args)
            res[f"{name}_section_s"] = time.perf_counter() - t0
            emit(cfg, name, **res)
            print(f"[{cfg}] {name}: " + ", ".join(
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                for k, v in res.items() if not isinstance(v, list)), file=sys.stderr, flush=True)
        except Exception as e:  # noqa: BLE001
            failed += 1
            traceback.print_exc()
            emit(cfg, name, **{f"{name}_error": short_error(e)})
        try:
            cleanup(torch)
            if name == "train":
                torch.cuda.reset_peak_memory_stats()
        except Exception as e:  # noqa: BLE001
            print(f"[{cfg}] cleanup after {name}: {short_error(e)}", file=sys.stderr, flush=True)
    TURNS.end()
    emit(cfg, "done", torch_total_s=time.perf_counter() - t_start, **TURNS.summary())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
