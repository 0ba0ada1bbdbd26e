# SPDX-License-Identifier: Apache-2.0
"""A colocated RL-style loop on one GPU: a trainer and a generation engine
share the device, and the engine's memory is given back while the trainer
runs.

Each round:
  1. the engine generates (greedy) with a static KV cache; its decode step is
     compiled with torch.compile(mode="reduce-overhead"), so it replays one
     CUDA graph; the graph's memory and the KV cache are made under
     cudapool.region("engine_cache"), its weights under
     cudapool.region("engine_weights");
  2. pause: "engine_cache" with keep=False (the next replay recomputes it),
     "engine_weights" with keep=True (copied to pinned host memory);
  3. the trainer (a transformers Llama, AdamW) trains --steps steps on the
     sequences just generated;
  4. resume both tags (same addresses, so the graph replays as captured, with
     no new capture) and copy the trainer's weights into the engine's.

Reported per phase: device memory in use (torch.cuda.mem_get_info), what the
allocator reserves, and the pause and resume times. The tokens of every round
are compared with a run without pausing (--no-pause, started as a
subprocess first unless --reference or --no-compare is given): greedy
decoding with fixed seeds and deterministic kernels must give the same
tokens.

--tms runs the same loop with torch_memory_saver 0.0.10 in its PyTorch-hook
mode instead of cudapool: weights in a region with a CPU backup, the KV
cache in one without. That mode cannot pause CUDA graph memory (the graph
pool is PyTorch's own), so the graph memory stays; the report says so.

The model is built from a config (no download): no network is needed.

    python3 examples/colocated/colocated.py --rounds 3 --steps 4
    python3 examples/colocated/colocated.py --tms
"""

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

GIB = 1 << 30
CUDAPOOL_API = ("region", "pause", "resume", "paused")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="generate/train rounds (default 3)")
    p.add_argument("--steps", type=int, default=4, help="training steps per round (default 4)")
    p.add_argument("--no-pause", action="store_true", help="the reference run: same loop, nothing paused")
    p.add_argument("--tms", action="store_true", help="torch_memory_saver instead of cudapool")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--cache-len", type=int, default=4096,
                   help="static KV cache length in tokens (>= prompt + new tokens; a larger cache "
                        "makes the memory given back larger)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokens-out", help="write the generated tokens (JSON) here")
    p.add_argument("--reference", help="compare with the tokens in this file instead of running --no-pause")
    p.add_argument("--no-compare", action="store_true", help="do not compare with a run without pausing")
    p.add_argument("--json-out", help="write the phase report (JSON) here")
    p.add_argument("--dry-run", action="store_true", help="check the arguments and the API, then stop")
    a = p.parse_args(argv)
    if a.cache_len < a.prompt_len + a.new_tokens:
        p.error("--cache-len must hold --prompt-len + --new-tokens")
    if min(a.rounds, a.steps, a.batch, a.prompt_len, a.new_tokens) < 1:
        p.error("--rounds, --steps, --batch, --prompt-len and --new-tokens must be positive")
    return a


def import_cudapool():
    try:
        import cudapool
    except ImportError as e:
        raise SystemExit(f"colocated: cannot import cudapool ({e}); install it (pip install ./python) "
                         "or put its python/ directory on PYTHONPATH") from e
    return cudapool


def require_pause_api(mod):
    """Exit with a clear message when cudapool lacks pause/resume by tag."""
    missing = [name for name in CUDAPOOL_API if not hasattr(mod, name)]
    if missing:
        where = getattr(mod, "__file__", "?")
        version = getattr(mod, "__version__", "?")
        raise SystemExit(
            f"colocated: this cudapool ({version}, {where}) has no {', '.join('cudapool.' + m for m in missing)}: "
            "it predates pausing memory by tag. Build and install a cudapool with pause/resume.")


# ---- what pauses memory: cudapool, torch_memory_saver, or nothing ----

class CudapoolSaver:
    name = "cudapool"
    note = ""

    def __init__(self, pause=True):
        cudapool = import_cudapool()
        self.cp, self.pausing = cudapool, pause
        if pause:
            require_pause_api(cudapool)

    def region(self, tag, keep):
        # keep is chosen when pausing; the reference run uses regions too when
        # this cudapool has them, so that both runs allocate alike.
        if hasattr(self.cp, "region"):
            return self.cp.region(tag)
        return contextlib.nullcontext()

    def generation_region(self):
        return self.region("engine_cache", keep=False)

    def pause(self, tag, keep):
        if self.pausing:
            self.cp.pause(tag, keep=keep)

    def resume(self, tag):
        if self.pausing:
            self.cp.resume(tag)

    def reserved(self):
        return self.cp.memory_reserved()

    def paused(self):
        return repr(self.cp.paused()) if self.pausing else "-"

    def release_host(self):
        fn = getattr(self.cp, "release_host_memory", None)
        if self.pausing and fn is not None:
            fn()


class TmsSaver:
    name = "torch_memory_saver"
    note = ("torch_memory_saver (PyTorch-hook mode) cannot pause CUDA graph memory: the decode "
            "graph's pool stays on the device; only the KV cache and the weights are paused.")

    def __init__(self, pause=True):
        import torch
        self.torch, self.pausing = torch, pause
        if pause:
            from torch_memory_saver import torch_memory_saver
            torch_memory_saver.hook_mode = "torch"
            self.tms = torch_memory_saver

    def region(self, tag, keep):
        if not self.pausing:
            return contextlib.nullcontext()
        return self.tms.region(tag=tag, enable_cpu_backup=keep)

    def generation_region(self):
        return contextlib.nullcontext()  # the graph pool is PyTorch's, out of its reach

    def pause(self, tag, keep):
        if self.pausing:
            self.tms.pause(tag)

    def resume(self, tag):
        if self.pausing:
            self.tms.resume(tag)

    def reserved(self):
        return self.torch.cuda.memory_reserved()

    def paused(self):
        return "-"

    def release_host(self):
        pass


# ---- the engine: greedy decoding with a static KV cache ----

def build_engine_class(torch):
    F = torch.nn.functional

    def rotate_half(x):
        a, b = x.chunk(2, dim=-1)
        return torch.cat((-b, a), dim=-1)

    class Engine(torch.nn.Module):
        """One decode step for the whole batch over a Llama model's modules,
        with a static KV cache written at position `pos` (a 1-element tensor,
        so that every step is the same graph)."""

        def __init__(self, model, batch, cache_len):
            super().__init__()
            cfg = model.config
            self.model = model
            self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
            self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nh
            self.batch, self.cache_len = batch, cache_len
            dev = next(model.parameters()).device
            # Constants (kept when paused): rotary tables from the model's own
            # rotary embedding, and the causal mask.
            pos = torch.arange(cache_len, device=dev)[None]
            probe = torch.zeros(1, cache_len, self.hd, device=dev, dtype=next(model.parameters()).dtype)
            cos, sin = model.model.rotary_emb(probe, pos)
            self.register_buffer("cos", cos[0].contiguous(), persistent=False)
            self.register_buffer("sin", sin[0].contiguous(), persistent=False)
            self.register_buffer("causal", torch.ones(cache_len, cache_len, dtype=torch.bool, device=dev).tril(),
                                 persistent=False)
            self.caches = []

        def make_cache(self):
            """The KV cache and the step's input buffers (discarded when paused)."""
            p = next(self.model.parameters())
            shape = (self.batch, self.nkv, self.cache_len, self.hd)
            for i in range(len(self.model.model.layers)):
                for kind in "kv":
                    buf = torch.zeros(shape, dtype=p.dtype, device=p.device)
                    torch._dynamo.mark_static_address(buf)
                    self.register_buffer(f"{kind}{i}", buf, persistent=False)
                    self.caches.append(buf)
            self.cur = torch.zeros(self.batch, dtype=torch.long, device=p.device)
            self.pos = torch.zeros(1, dtype=torch.long, device=p.device)

        def step(self, tokens, pos):
            m = self.model.model
            B = tokens.shape[0]
            x = m.embed_tokens(tokens)[:, None, :]
            cos, sin = self.cos[pos], self.sin[pos]
            mask = self.causal[pos].view(1, 1, 1, self.cache_len)
            for i, layer in enumerate(m.layers):
                a = layer.self_attn
                h = layer.input_layernorm(x)
                q = a.q_proj(h).view(B, 1, self.nh, self.hd).transpose(1, 2)
                k = a.k_proj(h).view(B, 1, self.nkv, self.hd).transpose(1, 2)
                v = a.v_proj(h).view(B, 1, self.nkv, self.hd).transpose(1, 2)
                q = q * cos + rotate_half(q) * sin
                k = k * cos + rotate_half(k) * sin
                kc, vc = getattr(self, f"k{i}"), getattr(self, f"v{i}")
                kc[:, :, pos] = k
                vc[:, :, pos] = v
                o = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=self.nkv != self.nh)
                x = x + a.o_proj(o.transpose(1, 2).reshape(B, 1, self.nh * self.hd))
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            return self.model.lm_head(m.norm(x))[:, 0].argmax(-1)

    return Engine


def generate(torch, engine, step, prompt, new_tokens):
    """Greedy decoding: the prompt is fed one token per step (the same graph
    as decoding), then new_tokens are produced. Returns them on the host."""
    B, P = prompt.shape
    for c in engine.caches:
        c.zero_()  # memory after a discard holds anything; masked NaNs would still poison
    out = torch.empty(B, new_tokens, dtype=torch.long, device=prompt.device)
    for t in range(P + new_tokens - 1):
        if t < P:
            engine.cur.copy_(prompt[:, t])
        engine.pos.fill_(t)
        torch.compiler.cudagraph_mark_step_begin()
        nxt = step(engine.cur, engine.pos)
        if t >= P - 1:
            out[:, t - P + 1] = nxt
            engine.cur.copy_(nxt)
    return out.cpu()


# ---- the loop ----

class Report:
    def __init__(self, torch, saver):
        self.torch, self.saver, self.rows = torch, saver, []

    def phase(self, rnd, name, seconds=None):
        self.torch.cuda.synchronize()
        free, total = self.torch.cuda.mem_get_info()
        self.rows.append({"round": rnd, "phase": name, "used_gib": (total - free) / GIB,
                          "reserved_gib": self.saver.reserved() / GIB,
                          "ms": None if seconds is None else seconds * 1e3, "paused": self.saver.paused()})

    def timed(self, rnd, name, fn):
        self.torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        self.torch.cuda.synchronize()
        self.phase(rnd, name, time.perf_counter() - t0)

    def table(self):
        lines = [f"{'round':>5}  {'phase':<26} {'in use GiB':>10} {'reserved GiB':>12} {'time ms':>9}  paused"]
        for r in self.rows:
            ms = "" if r["ms"] is None else f"{r['ms']:.1f}"
            lines.append(f"{r['round']:>5}  {r['phase']:<26} {r['used_gib']:>10.2f} {r['reserved_gib']:>12.2f} "
                         f"{ms:>9}  {r['paused']}")
        return "\n".join(lines)


def run(a):
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    if not a.tms:
        cudapool = import_cudapool()
        if not a.no_pause:
            require_pause_api(cudapool)
        cudapool.install()  # before CUDA is initialised
    import torch
    import transformers

    if not torch.cuda.is_available():
        raise SystemExit("colocated: needs a CUDA GPU")
    torch.manual_seed(a.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    saver = (TmsSaver if a.tms else CudapoolSaver)(pause=not a.no_pause)
    dev = torch.device("cuda")
    cfg = transformers.LlamaConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.hidden * 11 // 4 // 64 * 64,
        num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.heads // 4,
        max_position_embeddings=a.cache_len)

    trainer = transformers.LlamaForCausalLM(cfg).to(dev)
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-4)
    Engine = build_engine_class(torch)
    with saver.region("engine_weights", keep=True):
        model = transformers.LlamaForCausalLM(cfg).to(dev, dtype=torch.bfloat16).eval()
        model.load_state_dict(trainer.state_dict())
        engine = Engine(model, a.batch, a.cache_len)
    with saver.region("engine_cache", keep=False):
        engine.make_cache()
    step = torch.compile(engine.step, mode="reduce-overhead", fullgraph=True)
    g = torch.Generator(device=dev).manual_seed(a.seed)
    prompt = torch.randint(0, a.vocab, (a.batch, a.prompt_len), device=dev, generator=g)
    rep = Report(torch, saver)
    rep.phase(0, "start")

    tokens = []
    for rnd in range(a.rounds):
        if rnd > 0:
            rep.timed(rnd, "resume weights (keep)", lambda: saver.resume("engine_weights"))
            rep.timed(rnd, "resume cache", lambda: saver.resume("engine_cache"))
            with torch.no_grad():
                for pe, pt in zip(model.parameters(), trainer.parameters()):
                    pe.copy_(pt)
            rep.phase(rnd, "weights synced")
        with torch.no_grad(), saver.generation_region():
            t0 = time.perf_counter()
            out = generate(torch, engine, step, prompt, a.new_tokens)
        rep.phase(rnd, "generated", time.perf_counter() - t0)
        tokens.append(out.tolist())
        rep.timed(rnd, "pause cache (discard)", lambda: saver.pause("engine_cache", keep=False))
        rep.timed(rnd, "pause weights (keep)", lambda: saver.pause("engine_weights", keep=True))
        seqs = torch.cat([prompt, out.to(dev)], dim=1)
        t0 = time.perf_counter()
        for _ in range(a.steps):
            loss = trainer(input_ids=seqs, labels=seqs).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        rep.phase(rnd, f"trained (loss {loss.item():.3f})", time.perf_counter() - t0)
        # Next round: a new prompt from the generated tokens.
        prompt = out[:, -a.prompt_len:].to(dev) if a.new_tokens >= a.prompt_len else prompt
    if a.rounds > 0:
        saver.resume("engine_weights")
        saver.resume("engine_cache")
        saver.release_host()
    return rep, tokens, saver


def strip_options(argv, names):
    """argv without the options in names ("--x v" and "--x=v" forms)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in names:
            skip = True
        elif not any(arg.startswith(n + "=") for n in names):
            out.append(arg)
    return out


def reference_tokens(a, argv):
    """The tokens of the same loop without pausing, from a subprocess."""
    if a.reference:
        with open(a.reference) as f:
            return json.load(f)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "tokens.json")
        args = strip_options(argv, ("--json-out", "--tokens-out", "--reference"))
        cmd = [sys.executable, os.path.abspath(__file__), *args, "--no-pause", "--no-compare", "--tokens-out", path]
        print("reference run:", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(path) as f:
            return json.load(f)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    mode = "torch_memory_saver" if a.tms else "cudapool"
    if a.dry_run:
        if not a.tms and not a.no_pause:
            require_pause_api(import_cudapool())
        print(f"colocated: {mode}, {'no pause' if a.no_pause else 'pausing'}, {a.rounds} rounds x {a.steps} steps, "
              f"batch {a.batch}, {a.prompt_len}+{a.new_tokens} tokens, cache {a.cache_len}, "
              f"{a.layers} layers of {a.hidden}")
        return 0
    ref = None
    if not a.no_pause and not a.no_compare:
        ref = reference_tokens(a, argv)
    rep, tokens, saver = run(a)
    if a.tokens_out:
        with open(a.tokens_out, "w") as f:
            json.dump(tokens, f)
    print(f"colocated ({saver.name}{', no pause' if a.no_pause else ''}):")
    print(rep.table())
    if saver.note and not a.no_pause:
        print("note:", saver.note)
    same = None
    if ref is not None:
        same = [t == r for t, r in zip(tokens, ref)]
        ok = len(ref) == len(tokens) and all(same)
        print(f"tokens equal to the run without pausing: {'yes' if ok else 'NO'} "
              f"(rounds {', '.join('=' if s else 'differ' for s in same)})")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"mode": saver.name, "rows": rep.rows, "tokens_equal": same, "note": saver.note}, f, indent=1)
    return 0 if same is None or (all(same) and len(same) == len(ref)) else 1


if __name__ == "__main__":
    sys.exit(main())
