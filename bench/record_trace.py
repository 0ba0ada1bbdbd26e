"""Record the allocation trace of real GPT training steps with PyTorch's
native allocator, in the replay format of demo/trace.txt:

    a <id> <size> <stream>    allocate
    f <id>                    free

Run on the GPU machine: python3 bench/record_trace.py OUT_FILE [steps]
"""
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from model import GPT, batch, seq_lens  # noqa: E402


def main():
    out = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    torch.manual_seed(0)
    model = GPT().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    for i, t in enumerate(seq_lens(steps, seed=1)):
        x, y = batch(t, 8, 16384, "cuda", seed=i)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][0]
    live, next_id, lines = {}, 0, []
    streams = {}
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = next_id
            s = streams.setdefault(e["stream"], len(streams))
            lines.append(f"a {next_id} {e['size']} {s}")
            next_id += 1
        elif e["action"] == "free_requested" and e["addr"] in live:
            lines.append(f"f {live.pop(e['addr'])}")
    with open(out, "w") as f:
        f.write(f"# Recorded from {steps} GPT-2-small training steps (bf16 autocast, AdamW, batch 8,\n")
        f.write(f"# variable sequence length) with PyTorch {torch.__version__}'s native allocator on\n")
        f.write(f"# {torch.cuda.get_device_name()} by bench/record_trace.py. {len(lines)} operations;\n")
        f.write("# blocks still live at the end (weights, optimizer state) are freed by the replayer.\n")
        f.write("\n".join(lines) + "\n")
    print(f"recorded {len(lines)} operations, {next_id} allocations, {len(streams)} streams -> {out}")


if __name__ == "__main__":
    main()
