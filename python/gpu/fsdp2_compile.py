# SPDX-License-Identifier: Apache-2.0
"""FSDP2 (torch.distributed.fsdp.fully_shard) training of a small residual
MLP whose blocks are compiled with torch.compile, on two (or more) GPUs:

    python -m torch.distributed.run --standalone --nproc_per_node=2 gpu/fsdp2_compile.py --mode cudapool --out cp.json
    python -m torch.distributed.run --standalone --nproc_per_node=2 gpu/fsdp2_compile.py --mode native --out native.json

--mode cudapool installs cudapool (the C++ allocator class) in every rank
before CUDA starts; --mode native never imports it. Each rank trains on its
own deterministic data; the loss logged per step is the mean over ranks.
Rank 0 writes {mode, losses, world_size, per-rank facts} as JSON to --out.
Every rank checks that its parameters are sharded DTensors, that the loss
fell (the mean of the last 3 steps below 0.8 x the first) and, with
cudapool, that cudapool served its memory; the exit status is non-zero if
any rank's check failed. test_gpu_multi_gpu.py compares the two modes'
losses.
"""

import argparse
import json
import os
import sys


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("native", "cudapool"), required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", help="rank 0 writes the results here (JSON)")
    return ap.parse_args(argv)


ARGS = parse_args()
if ARGS.mode == "cudapool":
    import cudapool

    cudapool.install(cpp_class=True)  # before anything initializes CUDA

# Deterministic cuBLAS; read when cuBLAS starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

DIM, IN, LAYERS, BATCH = 256, 16, 4, 64


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(IN, DIM)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(LAYERS))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x):
        h = self.inp(x)
        for blk in self.blocks:
            h = blk(h)
        return self.head(h)


def batches(steps, seed):
    """A learnable regression task: y = tanh(sum of the first 4 features) + 0.1 x_4 x_5."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(BATCH, IN, generator=g)
        y = torch.tanh(x[:, :4].sum(dim=1, keepdim=True)) + 0.1 * x[:, 4:5] * x[:, 5:6]
        yield x, y


def main():
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    world = dist.get_world_size()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)  # same initial weights on every rank (FSDP then shards them)
    model = Net().cuda()
    for i, blk in enumerate(model.blocks):
        # as torchtitan does: compile each block, then shard it
        model.blocks.register_module(str(i), torch.compile(blk, fullgraph=True))
    for blk in model.blocks:
        fully_shard(blk)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)

    losses = []
    for x, y in batches(ARGS.steps, seed=100 + rank):  # different data per rank
        x, y = x.cuda(), y.cuda()
        loss = F.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        losses.append(float(mean.item()))

    torch.cuda.synchronize()
    sharded = all(isinstance(p, DTensor) for p in model.parameters())
    facts = {
        "rank": rank,
        "sharded": sharded,
        "allocator": cudapool.mode() if ARGS.mode == "cudapool" else "native",
        "cudapool_allocations": cudapool.memory_stats(rank)["allocation.all.allocated"] if ARGS.mode == "cudapool" else 0,
        "peak_allocated": torch.cuda.max_memory_allocated(),
        "native_clean": ARGS.mode == "cudapool" or "cudapool" not in sys.modules,
    }
    learned = sum(losses[-3:]) / 3 < 0.8 * losses[0]
    ok = (sharded and learned and facts["peak_allocated"] > 0 and facts["native_clean"]
          and (ARGS.mode == "native" or (facts["allocator"] == "class" and facts["cudapool_allocations"] > 0)))
    facts["ok"] = bool(ok)
    gathered = [None] * world
    dist.all_gather_object(gathered, facts)
    print(f"rank {rank} [{ARGS.mode}]: loss {losses[0]:.5f} -> {losses[-1]:.5f}, sharded {sharded}, "
          f"allocator {facts['allocator']}, peak allocated {facts['peak_allocated'] / 2**20:.1f} MiB "
          f"-> {'OK' if ok else 'FAIL'}", flush=True)
    if rank == 0 and ARGS.out:
        with open(ARGS.out, "w") as f:
            json.dump({"mode": ARGS.mode, "world_size": world, "steps": ARGS.steps, "losses": losses,
                       "ranks": gathered}, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if all(g["ok"] for g in gathered) else 1


if __name__ == "__main__":
    sys.exit(main())
