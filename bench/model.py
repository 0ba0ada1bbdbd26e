"""A GPT-2-style decoder used by the benchmarks and the trace recorder.

Defined here so nothing is downloaded. Sizes default to GPT-2 small
(12 layers, 768 wide, 12 heads); vocab is smaller to keep the embedding
from dominating memory.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab=16384, d=768, layers=12, heads=12, max_len=1024):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02 / math.sqrt(2))

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def seq_lens(steps, seed=0, lo=128, hi=1024):
    """Variable sequence lengths, the same for every allocator compared."""
    g = torch.Generator().manual_seed(seed)
    return [int(x) for x in torch.randint(lo // 64, hi // 64 + 1, (steps,), generator=g) * 64]


def batch(step_len, bsz, vocab, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randint(0, vocab, (bsz, step_len + 1), device=device, generator=g)
    return x[:, :-1], x[:, 1:]
