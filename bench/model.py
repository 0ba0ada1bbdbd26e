# SPDX-License-Identifier: Apache-2.0
"""A GPT-2-style decoder used by the benchmarks and the trace recorder.

Defined here so nothing is downloaded. Sizes default to GPT-2 small
(12 layers, 768 wide, 12 heads); vocab is smaller to keep the embedding
from dominating memory.

GPT.decode is one step of cached decoding, as transformers' models run it
with a static KV cache (StaticKV, their StaticCache): the cache's tensors
keep their addresses for the whole generation and each step writes its
token's keys and values in place at its position (index_copy_), so that
torch.compile(mode="reduce-overhead") captures the step once and replays it
(bench/torch_bench.py, section altcompile).
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

    def decode(self, x, pos, kc, vc, mask):
        """forward for x (b, t, d) at positions pos (t positions, int64):
        their keys and values are written into this layer's cache (kc, vc:
        (b, heads, max_len, d / heads)) in place, and the queries attend
        to the cache under mask (True: attend)."""
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        kc.index_copy_(2, pos, k)
        vc.index_copy_(2, pos, v)
        y = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class StaticKV(nn.Module):
    """A static KV cache: per layer a key and a value tensor of (batch,
    heads, max_len, d / heads), zeroed once and written in place by
    GPT.decode. Buffers, and marked static for torch.compile, so that CUDA
    graphs read them where they are instead of copying them in."""

    def __init__(self, model, batch, max_len, dtype=None, device=None):
        super().__init__()
        blk = model.blocks[0]
        d = blk.qkv.in_features
        shape = (batch, blk.heads, max_len, d // blk.heads)
        dtype = dtype or blk.qkv.weight.dtype
        device = device or blk.qkv.weight.device
        self.layers = len(model.blocks)
        self.max_len = max_len
        for i in range(self.layers):
            self.register_buffer(f"k{i}", torch.zeros(shape, dtype=dtype, device=device))
            self.register_buffer(f"v{i}", torch.zeros(shape, dtype=dtype, device=device))
        mark = getattr(getattr(torch, "_dynamo", None), "mark_static_address", None)
        if mark is not None:
            for t in self.buffers():
                mark(t)

    def layer(self, i):
        return getattr(self, f"k{i}"), getattr(self, f"v{i}")


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

    def decode(self, idx, pos, cache):
        """The logits of idx (b, t) at positions pos (t positions, int64, on
        idx's device), attending to everything cache (a StaticKV) holds up
        to each position, and writing idx's keys and values into it."""
        length = cache.max_len
        # (t, length): position p attends to cache slots 0..p.
        mask = (torch.arange(length, device=idx.device)[None, :] <= pos[:, None]).view(1, 1, -1, length)
        x = self.tok(idx) + self.pos(pos)[None]
        for i, blk in enumerate(self.blocks):
            kc, vc = cache.layer(i)
            x = blk.decode(x, pos, kc, vc, mask)
        return self.head(self.ln(x))


def seq_lens(steps, seed=0, lo=128, hi=1024):
    """Variable sequence lengths, the same for every allocator compared."""
    g = torch.Generator().manual_seed(seed)
    return [int(x) for x in torch.randint(lo // 64, hi // 64 + 1, (steps,), generator=g) * 64]


def batch(step_len, bsz, vocab, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randint(0, vocab, (bsz, step_len + 1), device=device, generator=g)
    return x[:, :-1], x[:, 1:]
