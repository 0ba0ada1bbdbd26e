# SPDX-License-Identifier: Apache-2.0
"""Generate a synthetic LLM-inference allocation trace: many variable-length
requests whose KV-cache tensors grow and die out of order (continuous
batching with a growing, reallocated KV cache, as in Hugging Face style
generation with torch.cat). Seeded and reproducible: the same arguments give
the same trace, byte for byte.

    python3 bench/kvcache.py OUT_FILE [--seed 1] [--requests 300] ...

The format is the replay format of demo/trace.txt (capi/ctest/replay.c,
bench/workloads.h):

    a <id> <size> <stream>    allocate
    f <id>                    free

What it models, per engine step:
  - admission: while fewer than --max-batch requests run, the next waiting
    request is prefilled: per layer, its K and V caches (capacity: the prompt
    rounded up to --grow tokens) and the prefill temporaries (QKV, attention
    output, MLP intermediate; sized by the prompt length), freed at once;
  - decode: one token for every running request: per layer an MLP
    intermediate for the batch; then, for each request whose cache is full,
    per layer and for K and V, a new tensor --grow tokens larger is allocated
    and the old one freed (torch.cat);
  - completion: a request that has produced its output frees all its
    caches, in the middle of the others'.
Prompt and output lengths are drawn from log-uniform distributions, so a few
long requests hold large caches while many short ones come and go. Weights
(per layer: QKV, output, MLP up and down; the embedding) are allocated first
and stay live (the replayer frees them at the end).
"""
import argparse
import math
import random
import sys

BF16 = 2


def loguniform(rng, lo, hi):
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def roundup(n, k):
    return (n + k - 1) // k * k


class Trace:
    def __init__(self, out):
        self.out = out
        self.next_id = 0
        self.ops = 0
        self.live = 0
        self.peak = 0
        self.sizes = {}

    def alloc(self, size, stream):
        i = self.next_id
        self.next_id += 1
        self.out.write(f"a {i} {size} {stream}\n")
        self.ops += 1
        self.sizes[i] = size
        self.live += size
        self.peak = max(self.peak, self.live)
        return i

    def free(self, i):
        self.out.write(f"f {i}\n")
        self.ops += 1
        self.live -= self.sizes.pop(i)


def generate(args, out):
    rng = random.Random(args.seed)
    h, layers = args.hidden, args.layers
    kv_token = h * BF16  # bytes of K (or V) per token per layer
    t = Trace(out)
    out.write(
        f"# Synthetic LLM inference trace (bench/kvcache.py --seed {args.seed} --requests {args.requests} "
        f"--layers {layers} --hidden {h} --max-batch {args.max_batch} --grow {args.grow} "
        f"--prompt {args.prompt_min}-{args.prompt_max} --output {args.output_min}-{args.output_max} "
        f"--prefill-stream {args.prefill_stream}).\n"
        "# Requests with variable prompt and output lengths; KV caches grow by reallocation and die out of order.\n"
    )
    t.alloc(args.vocab * h * BF16, 0)  # embedding
    for _ in range(layers):
        for shape in ((h, 3 * h), (h, h), (h, 4 * h), (4 * h, h)):
            t.alloc(shape[0] * shape[1] * BF16, 0)

    waiting = []
    for r in range(args.requests):
        waiting.append((loguniform(rng, args.prompt_min, args.prompt_max),
                        loguniform(rng, args.output_min, args.output_max)))
    waiting.reverse()  # pop() takes them in order
    running = []  # dicts: length, left, cap, kv (list of [k_id, v_id] per layer)

    def kv_alloc(tokens, stream):
        return t.alloc(tokens * kv_token, stream)

    steps = 0
    while waiting or running:
        # Admission and prefill.
        while waiting and len(running) < args.max_batch:
            prompt, output = waiting.pop()
            cap = roundup(prompt + 1, args.grow)
            s = args.prefill_stream
            kv = []
            for _ in range(layers):
                x = t.alloc(prompt * h * BF16, s)  # normalized input
                qkv = t.alloc(prompt * 3 * h * BF16, s)
                k = kv_alloc(cap, s)
                v = kv_alloc(cap, s)
                kv.append([k, v])
                attn = t.alloc(prompt * h * BF16, s)
                t.free(qkv)
                up = t.alloc(prompt * 4 * h * BF16, s)
                t.free(attn)
                t.free(x)
                t.free(up)
            logits = t.alloc(args.vocab * 4, s)  # fp32 logits of the last token
            t.free(logits)
            running.append({"length": prompt, "left": output, "cap": cap, "kv": kv})
        # One decode step for the batch.
        b = len(running)
        hidden = t.alloc(b * h * BF16, 0)
        for _ in range(layers):
            up = t.alloc(b * 4 * h * BF16, 0)
            t.free(up)
        logits = t.alloc(b * args.vocab * 4, 0)
        t.free(logits)
        t.free(hidden)
        for r in running:
            r["length"] += 1
            r["left"] -= 1
            if r["length"] >= r["cap"] and r["left"] > 0:
                new_cap = r["cap"] + args.grow
                for pair in r["kv"]:
                    for j in range(2):
                        n = kv_alloc(new_cap, 0)
                        t.free(pair[j])
                        pair[j] = n
                r["cap"] = new_cap
        # Completion, in whatever order the requests finish.
        done = [r for r in running if r["left"] <= 0]
        running = [r for r in running if r["left"] > 0]
        for r in done:
            for k, v in r["kv"]:
                t.free(k)
                t.free(v)
        steps += 1
    return t, steps


def parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="trace file to write ('-' for stdout)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--max-batch", type=int, default=24)
    ap.add_argument("--grow", type=int, default=128, help="KV cache growth step, tokens")
    ap.add_argument("--prompt-min", type=int, default=16)
    ap.add_argument("--prompt-max", type=int, default=3072)
    ap.add_argument("--output-min", type=int, default=8)
    ap.add_argument("--output-max", type=int, default=768)
    ap.add_argument("--prefill-stream", type=int, default=0,
                    help="trace stream of the prefills (0: the decode stream)")
    return ap


def main(argv=None):
    ap = parser()
    args = ap.parse_args(argv)
    if min(args.requests, args.layers, args.hidden, args.vocab, args.max_batch, args.grow,
           args.prompt_min, args.output_min) < 1 or args.prompt_max < args.prompt_min \
            or args.output_max < args.output_min or args.prefill_stream < 0:
        ap.error("sizes and counts must be positive, and each max at least its min")
    out = sys.stdout if args.out == "-" else open(args.out, "w")
    try:
        t, steps = generate(args, out)
    finally:
        if out is not sys.stdout:
            out.close()
    print(f"kvcache: {t.ops} operations, {t.next_id} allocations, {steps} steps, "
          f"peak live {t.peak / 2**30:.2f} GiB -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
