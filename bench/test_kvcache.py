# SPDX-License-Identifier: Apache-2.0
"""bench/kvcache.py: the trace is reproducible, well formed, and has what
makes it hard (caches that grow by reallocation and die out of order)."""
import io
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import kvcache  # noqa: E402


def gen(*args):
    out = io.StringIO()
    t, steps = kvcache.generate(kvcache.parser().parse_args(["-", *args]), out)
    return out.getvalue(), t, steps


def parse(text):
    live, order, frees_out_of_order, ops = {}, [], 0, 0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        f = line.split()
        ops += 1
        if f[0] == "a":
            assert len(f) == 4 and int(f[2]) > 0
            i = int(f[1])
            assert i not in live
            live[i] = int(f[2])
            order.append(i)
        else:
            assert f[0] == "f" and len(f) == 2
            i = int(f[1])
            assert i in live, f"free of {i}, not live"
            if order and order[-1] != i:
                frees_out_of_order += 1
            del live[i]
            order.remove(i)
    return ops, live, frees_out_of_order


def test_reproducible_and_well_formed():
    a, t, steps = gen("--requests", "20", "--layers", "2", "--hidden", "256")
    b, _, _ = gen("--requests", "20", "--layers", "2", "--hidden", "256")
    assert a == b
    c, _, _ = gen("--requests", "20", "--layers", "2", "--hidden", "256", "--seed", "2")
    assert a != c
    ops, live, ooo = parse(a)
    assert ops == t.ops > 0 and steps > 0
    # Only the weights stay live: embedding + 4 per layer.
    assert len(live) == 1 + 4 * 2
    assert ooo > 0, "caches die out of order"


def test_caches_grow_by_reallocation():
    text, _, _ = gen("--requests", "4", "--layers", "1", "--hidden", "64", "--grow", "16",
                     "--prompt-min", "16", "--prompt-max", "32", "--output-min", "200", "--output-max", "300")
    sizes = {int(f.split()[2]) for f in text.splitlines() if f.startswith("a ")}
    kv_token = 64 * 2
    # K/V tensors of growing capacities, 16 tokens apart.
    caps = sorted(s // kv_token for s in sizes if s % (16 * kv_token) == 0)
    assert len(caps) >= 10 and all(b - a >= 16 for a, b in zip(caps, caps[1:]))


def test_prefill_stream_and_cli(tmp_path):
    text, _, _ = gen("--requests", "5", "--layers", "1", "--hidden", "64", "--prefill-stream", "1")
    streams = {f.split()[3] for f in text.splitlines() if f.startswith("a ")}
    assert streams == {"0", "1"}
    out = tmp_path / "t.txt"
    p = subprocess.run([sys.executable, os.path.join(HERE, "kvcache.py"), str(out), "--requests", "3", "--layers", "1"],
                       capture_output=True, text=True)
    assert p.returncode == 0 and out.read_text().startswith("# Synthetic LLM inference trace")
    bad = subprocess.run([sys.executable, os.path.join(HERE, "kvcache.py"), str(out), "--requests", "0"],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "must be positive" in bad.stderr
