# SPDX-License-Identifier: Apache-2.0
"""FSDP2 training step of a small GPT-2 on 2 GPUs, timed for the benchmark:

    python3 -m torch.distributed.run --standalone --nproc_per_node=2 bench/fsdp2_bench.py CONFIG [--steps N]

CONFIG: native, expandable, cudapool, cudapool_exp, cudapool_chunk4 or
cudapool_b (as bench/torch_bench.py: cudapool_chunk4 stitches the large pool
in 4 MiB allocations; cudapool_b is cudapool from the library
$CUDAPOOL_LIBRARY_B names, another build, for comparing two builds).
Rank 0 prints one result line {"kind": "torch", "config": CONFIG, "section":
"fsdp", "fsdp_ms_per_step": ..., ...} (bench/report.py reads it).

How it keeps the noise down (a first try, 3 runs with wall-clock timing,
spread 31.7-56.4 ms per step, hid anything under ~30%):
- each rank pins itself to its own half of the CPUs it may use (before
  torch starts its threads), so the two ranks' Python threads and the NCCL
  proxies do not compete for the same cores;
- a step is timed with CUDA events on the compute stream (start event
  recorded before the forward, end after the optimizer step), read after
  the last step, so a timing never synchronizes inside the loop;
- a step's time is the slower rank's, the result the median over the timed
  steps (after warm-up steps that also compile nothing: no torch.compile;
  the warm-up includes a step at every timed length, workloads.warmup_lens);
- run_bench.sh runs each configuration in several fresh launches,
  interleaved, and the report gives the median and min-max of the launches.
Sequence lengths vary per step as in the training benchmark (same list for
every configuration), so the allocator sees varied sizes.

Taking turns (BENCH_TURNS, started by bench/turn_pair.sh with TURN_RANKS=2):
two launches on the same GPUs and CPUs alternate step by step, rank r of
one handing over to rank r of the other after each step (synchronized), so
step k of both meets the host in the same state; rank 0's line is then
"kind":"torch_turns" (bench/turns.py pairs the steps).
"""
import argparse
import atexit
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch_bench  # noqa: E402  (Turns, the turns tag, the allocator counters; it imports no torch itself)
REPO = os.path.dirname(HERE)
CONFIGS = ("native", "expandable", "cudapool", "cudapool_exp", "cudapool_chunk4", "cudapool_b")
VOCAB = 16384  # the model's default vocabulary


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("config", choices=CONFIGS)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=8, help="per rank")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--record-trace", metavar="OUT", help="rank 0 records its allocations from before the model "
                   "is made to the end (native allocator: the replay format of bench/record_trace.py)")
    p.add_argument("--no-pin", action="store_true", help="do not pin each rank to its own CPUs")
    return p.parse_args(argv)


def rank_cpus(rank, world, cpus):
    """Rank's share of cpus: world equal, disjoint, contiguous slices."""
    cpus = sorted(cpus)
    n = len(cpus) // world
    if n == 0:
        return cpus
    return cpus[rank * n:(rank + 1) * n]


def counters(torch, dev):
    """The allocator counters of device dev now, by short name (allocation,
    num_device_alloc, num_device_free, num_alloc_retries: torch_bench.COUNTED)
    and, under cudapool, front_hits."""
    out = {k.split(".")[0]: float(v) for k, v in torch_bench.device_calls(torch, dev).items()}
    hits = torch_bench.front_hits(dev)
    if hits is not None:
        out["front_hits"] = float(hits)
    return out


def thread_times():
    """This process's threads: tid -> (name, CPU seconds, voluntary and
    involuntary context switches), from /proc (empty where it is absent)."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    base = "/proc/self/task"
    for tid in os.listdir(base) if os.path.isdir(base) else ():
        try:
            with open(f"{base}/{tid}/stat") as f:
                st = f.read()
            name = st[st.index("(") + 1:st.rindex(")")]
            fields = st[st.rindex(")") + 2:].split()
            cpu = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
            sw = {}
            with open(f"{base}/{tid}/status") as f:
                for line in f:
                    k, _, v = line.partition(":")
                    if k in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"):
                        sw[k] = int(v)
            out[int(tid)] = (name, cpu, sw.get("voluntary_ctxt_switches", 0), sw.get("nonvoluntary_ctxt_switches", 0))
        except (OSError, ValueError, IndexError):
            continue
    return out


def thread_deltas(before, after, steps):
    """Per thread active over the timed steps: [name, is main, CPU ms, voluntary and involuntary switches],
    each per step, busiest first."""
    rows = []
    for tid, (name, cpu, vol, inv) in after.items():
        _, cpu0, vol0, inv0 = before.get(tid, (name, 0.0, 0, 0))
        d = [(cpu - cpu0) * 1e3 / steps, (vol - vol0) / steps, (inv - inv0) / steps]
        if any(d):
            rows.append([name, tid == os.getpid()] + [round(v, 2) for v in d])
    return sorted(rows, key=lambda r: -r[2])


def main():
    args = parse_args()
    rank, world = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    pinned = "no"
    if not args.no_pin and hasattr(os, "sched_setaffinity"):
        mine = rank_cpus(rank, world, os.sched_getaffinity(0))
        os.sched_setaffinity(0, mine)
        pinned = f"{mine[0]}-{mine[-1]}" if mine else "no"
    for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CUDAPOOL_CONF"):
        os.environ.pop(k, None)
    if args.config == "expandable":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if args.config.startswith("cudapool"):
        sys.path.insert(0, os.path.join(REPO, "python"))
        import cudapool

        torch_bench.use_library_b(args.config)
        cudapool.install()
        if args.config in torch_bench.CUDAPOOL_CONFS and torch_bench.CUDAPOOL_CONFS[args.config]:
            cudapool.configure(torch_bench.CUDAPOOL_CONFS[args.config])
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import model as gpt
    import workloads

    tag = torch_bench.turns_tag()
    turns = torch_bench.Turns(os.environ.get("BENCH_TURNS", ""))
    atexit.register(turns.end)  # on any exit, the partner stops waiting for this rank

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    if args.record_trace and rank == 0:
        torch.cuda.memory._record_memory_history(max_entries=4_000_000)
    torch.manual_seed(0)
    net = gpt.GPT(layers=args.layers).cuda()
    for blk in net.blocks:
        fully_shard(blk)
    fully_shard(net)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    all_lens = gpt.seq_lens(args.warmup + args.steps, seed=1, lo=128, hi=1024)
    # Every timed length is seen once in the warm-up (a new length's first
    # step is 4-9x an ordinary one, for every allocator).
    warm = workloads.warmup_lens(all_lens, args.warmup)
    lens = warm + all_lens[args.warmup:]
    total = len(lens)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(total)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(total)]
    cpu = [0.0] * total  # host time to issue each step (its enqueue)
    counted = None
    turns.begin()
    t0 = time.perf_counter()
    for i in range(total):
        if i == len(warm):
            counted = counters(torch, rank)
            threads0 = thread_times()
        x, y = gpt.batch(lens[i], args.batch, VOCAB, "cuda", 1000 * i + rank)
        if turns.on:
            # Both ranks of this launch hold their turn before the step
            # starts: else one rank's wait for its partner would be timed in
            # the other rank's first collective.
            dist.barrier()
            torch.cuda.synchronize()
        c0 = time.perf_counter()
        starts[i].record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = net(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ends[i].record()
        cpu[i] = (time.perf_counter() - c0) * 1e3
        if turns.on:  # the GPUs are the partner's only once this step is done
            torch.cuda.synchronize()
            turns.turn()
    torch.cuda.synchronize()
    turns.end()
    counted = {k: (v - counted[k]) / args.steps for k, v in counters(torch, rank).items()}
    threads = thread_deltas(threads0, thread_times(), args.steps)
    wall = (time.perf_counter() - t0) / total * 1e3
    mine = torch.tensor([starts[i].elapsed_time(ends[i]) for i in range(len(warm), total)], device="cuda")
    slowest = mine.clone()
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    steps = [float(v) for v in slowest.cpu()]
    if turns.on:  # every rank's turns must be sound, not rank 0's alone
        bad = turns.partner_gone not in ("", "ended")
        t = torch.tensor([turns.count, -turns.count, int(bad)], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if not bad and (int(t[2]) or int(t[0]) != -int(t[1])):
            turns.partner_gone = "another rank's turns broke, or the ranks' turns differ"
    if args.record_trace and rank == 0:
        import record_trace

        ops, nallocs, nstreams = record_trace.snapshot_ops(record_trace.finish_recording(torch))
        record_trace.write_trace(args.record_trace, ops, [
            f"Recorded from {total} FSDP2 steps of GPT-2 small on {world} GPU(s), rank 0 ({len(warm)} warm-up, batch",
            f"{args.batch} per rank, {args.layers} layers) with PyTorch {torch.__version__}'s {args.config} allocator",
            f"on {torch.cuda.get_device_name()} by bench/fsdp2_bench.py --record-trace. {len(ops)} operations,",
            f"{nallocs} allocations, {nstreams} streams; the recording starts before the model is made."])
        print(f"recorded {len(ops)} operations, {nallocs} allocations, {nstreams} streams -> {args.record_trace}",
              file=sys.stderr)
    if rank == 0:
        rec = {"kind": "torch_turns" if tag else "torch", "config": args.config, "section": "fsdp", **tag,
               **turns.summary(),
               "fsdp_ms_per_step": statistics.median(steps), "fsdp_world": world,
               "fsdp_device": torch.cuda.get_device_name(), "fsdp_steps": args.steps, "fsdp_warmup_steps": len(warm), "fsdp_batch": args.batch, "fsdp_layers": args.layers,
               "fsdp_wall_ms_per_step": wall,
               # Rank 0's host time to issue a step, median: near the step's
               # GPU time when the host is what the step waits for (with
               # turns every step starts on idle GPUs).
               "fsdp_cpu_ms_per_step": statistics.median(cpu[len(warm):]),
               **{f"fsdp_{k}_per_step": v for k, v in counted.items()},
               # rank 0's threads over the timed steps, per step: name, main?, CPU ms, switches
               "fsdp_threads": threads, "fsdp_pinned_rank0": pinned,
               "fsdp_peak_allocated": torch.cuda.max_memory_allocated(),
               "fsdp_step_ms": [round(v, 3) for v in steps]}
        print(json.dumps(rec), flush=True)
        print(f"[{args.config}] FSDP2 x{world}: median step {rec['fsdp_ms_per_step']:.2f} ms "
              f"(steps {min(steps):.2f}-{max(steps):.2f}), pinned rank 0 to CPUs {pinned}", file=sys.stderr)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
