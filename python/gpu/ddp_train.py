# SPDX-License-Identifier: Apache-2.0
"""Two-process DDP training with cudapool installed in every rank:

    python -m torch.distributed.run --standalone --nproc_per_node=2 gpu/ddp_train.py

Each rank trains TinyGPT on its own data; at the end every rank checks that
the parameters are identical across ranks (DDP's all-reduce kept them in
step) and that cudapool served the memory. Exits non-zero on failure."""

import os
import sys

import cudapool

cudapool.install()  # before anything initializes CUDA

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tinymodel  # noqa: E402

STEPS = 30


def main():
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    torch.manual_seed(0)  # same initial weights on every rank
    model = tinymodel.TinyGPT().cuda()
    ddp = DDP(model, device_ids=[rank])
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    losses = []
    for x, y in tinymodel.batches(STEPS, seed=100 + rank):  # different data per rank
        x, y = x.cuda(), y.cuda()
        logits = ddp(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    same = all(torch.equal(gathered[0], g) for g in gathered[1:])
    stats = cudapool.memory_stats(rank)
    ok = (same and losses[-1] < losses[0] and cudapool.installed()
          and stats["allocation.all.allocated"] > 0 and torch.cuda.max_memory_allocated() > 0)
    print(f"rank {rank}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, params identical across ranks: {same}, "
          f"cudapool allocations: {stats['allocation.all.allocated']}, "
          f"peak allocated {stats['allocated_bytes.all.peak'] / 2**20:.1f} MiB -> {'OK' if ok else 'FAIL'}",
          flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
