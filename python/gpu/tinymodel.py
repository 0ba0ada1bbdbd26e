# SPDX-License-Identifier: Apache-2.0
"""A tiny GPT-style transformer and a deterministic training loop, for the
GPU tests (no downloads: synthetic data from a fixed Markov chain).

As a script it trains and writes the losses as JSON:

    python gpu/tinymodel.py --steps 40 --out native.json
    python -m cudapool gpu/tinymodel.py --steps 40 --out cudapool.json
"""

import argparse
import json
import math
import os
import sys

# Deterministic cuBLAS; read when cuBLAS starts, so set before any GPU work.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

VOCAB, DIM, HEADS, LAYERS, CTX = 256, 128, 4, 2, 64


class Attention(nn.Module):
    """Causal self-attention written out (deterministic, no fused kernel)."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d), Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab=VOCAB, d=DIM, heads=HEADS, layers=LAYERS, ctx=CTX):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def batches(steps, batch=16, ctx=CTX, seed=0, vary_length=True):
    """Token batches from a fixed sparse Markov chain (learnable), with
    sequence lengths that vary from step to step to exercise the allocator."""
    g = torch.Generator().manual_seed(1234)
    nxt = torch.randint(0, VOCAB, (VOCAB, 4), generator=g)  # 4 likely successors per token
    g.manual_seed(seed)
    for step in range(steps):
        t = 16 + (step * 11) % (ctx - 15) if vary_length else ctx
        seq = torch.empty(batch, t + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(0, VOCAB, (batch,), generator=g)
        choice = torch.randint(0, 4, (batch, t), generator=g)
        for i in range(t):
            seq[:, i + 1] = nxt[seq[:, i], choice[:, i]]
        yield seq[:, :-1], seq[:, 1:]


def train(steps=40, seed=0, device="cuda", batch=16):
    """Train from a fixed seed; return the per-step losses."""
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    model = TinyGPT().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for x, y in batches(steps, batch=batch, seed=seed):
        x, y = x.to(device), y.to(device)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write {losses, cudapool, peak_allocated} here as JSON")
    args = ap.parse_args(argv)
    losses = train(args.steps, args.seed)
    cp = sys.modules.get("cudapool")
    result = {
        "losses": losses,
        "cudapool": bool(cp is not None and cp.installed()),
        # torch's function: cudapool's number when python -m cudapool patched it
        "peak_allocated": torch.cuda.max_memory_allocated(),
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f)
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {len(losses)} steps; cudapool={result['cudapool']}")


if __name__ == "__main__":
    main()
