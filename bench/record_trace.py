# SPDX-License-Identifier: Apache-2.0
"""Record the allocation trace of real GPT training steps with PyTorch's
native allocator, in the replay format of demo/trace.txt:

    a <id> <size> <stream>    allocate
    f <id>                    free

Run on the GPU machine: python3 bench/record_trace.py OUT_FILE [steps | bench]

With "bench", the steps are those of torch_bench.py's training row with its
defaults: the warm-up (workloads.warmup_lens: 5 steps, then one at every
timed length not yet seen) and the 60 timed steps, so that a replay sees the
lengths vary as the benchmark's 75 steps do (a front or fit policy that
fragments over many lengths shows only over many steps: docs/hot-path.md,
"Holding blocks across calls"); the recording then starts before the model is made, so the
weights are in the trace as in the benchmark's process.
"""
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import workloads  # noqa: E402

# torch_bench.py's defaults for the training row.
BENCH_WARMUP, BENCH_STEPS = 5, 60


def step_lens(arg):
    """The sequence lengths to record: n steps of seq_lens, or with "bench"
    the training row's warm-up lengths followed by its timed ones."""
    from model import seq_lens  # model imports torch: only when recording

    if arg == "bench":
        lens = seq_lens(BENCH_WARMUP + BENCH_STEPS, seed=1)
        return workloads.warmup_lens(lens, BENCH_WARMUP) + lens[BENCH_WARMUP:]
    return seq_lens(int(arg), seed=1)


def main():
    import torch
    from model import GPT, batch  # torch here, so that the converter below imports without it

    out = sys.argv[1]
    arg = sys.argv[2] if len(sys.argv) > 2 else "3"
    bench = arg == "bench"
    lens = step_lens(arg)
    steps = len(lens)
    torch.manual_seed(0)
    if bench:
        # From the start, as torch_bench.py's process: the weights are the
        # first segments, and the steps' blocks are placed around them.
        torch.cuda.memory._record_memory_history(max_entries=4_000_000)
    model = GPT().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    if not bench:
        torch.cuda.memory._record_memory_history(max_entries=4_000_000)
    for i, t in enumerate(lens):
        x, y = batch(t, 8, 16384, "cuda", seed=i)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    lines, nallocs, nstreams = snapshot_ops(finish_recording(torch))
    write_trace(out, lines, [
        f"Recorded from {steps} GPT-2-small training steps (bf16 autocast, AdamW, batch 8,",
        f"variable sequence length) with PyTorch {torch.__version__}'s native allocator on",
        f"{torch.cuda.get_device_name()} by bench/record_trace.py. {len(lines)} operations;",
        "The recording starts %s the model is made; blocks still live at the end" % ("before" if bench else "after"),
        "(weights, optimizer state) are freed by the replayer."])
    print(f"recorded {len(lines)} operations, {nallocs} allocations, {nstreams} streams -> {out}")


def finish_recording(torch):
    """The snapshot of the memory history recorded so far; stops recording."""
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    return snap


def snapshot_ops(snap, device=0):
    """A snapshot's trace of device as replay lines ("a ID SIZE STREAM",
    "f ID"; streams numbered in order of first use), with the number of
    allocations and of streams. A free counts when it is requested, as the
    caller frees it: the replayer's allocator does its own stream waiting."""
    live, next_id, lines, streams = {}, 0, [], {}
    for e in snap["device_traces"][device]:
        if e["action"] == "alloc":
            live[e["addr"]] = next_id
            s = streams.setdefault(e["stream"], len(streams))
            lines.append(f"a {next_id} {e['size']} {s}")
            next_id += 1
        elif e["action"] == "free_requested" and e["addr"] in live:
            lines.append(f"f {live.pop(e['addr'])}")
    return lines, next_id, len(streams)


def write_trace(out, lines, header):
    """Writes a replay trace: header as "# " comment lines, then lines."""
    with open(out, "w") as f:
        f.write("".join(f"# {h}\n" for h in header))
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
