# SPDX-License-Identifier: Apache-2.0
"""bench/pause_bench.py without a GPU: arguments, the message when cudapool
lacks pause, the bookkeeping of a pause/resume measurement (over a fake
torch), and the table."""
import os
import subprocess
import sys
import types

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import pause_bench  # noqa: E402

GIB = pause_bench.GIB


def test_arguments():
    a = pause_bench.parse_args([])
    assert (a.size_gib, a.reps, a.impl) == (16, 5, "all")
    a = pause_bench.parse_args(["--size-gib", "2", "--reps", "3", "--impl", "tms"])
    assert (a.size_gib, a.reps, a.impl) == (2, 3, "tms")
    for bad in (["--reps", "0"], ["--size-gib", "0"], ["--impl", "native"]):
        with pytest.raises(SystemExit):
            pause_bench.parse_args(bad)


def test_dry_run():
    out = subprocess.run([sys.executable, os.path.join(HERE, "pause_bench.py"), "--dry-run", "--size-gib", "4"],
                         capture_output=True, text=True, check=True).stdout
    assert "cudapool: 4 GiB in 16 tensors of 256 MiB, 5 reps" in out
    assert out.count("\n") == 2 and "tms:" in out


def test_missing_pause_api():
    old = types.SimpleNamespace(__version__="0.1.0", __file__="/x/cudapool/__init__.py", region=None)
    with pytest.raises(SystemExit) as e:
        pause_bench.require_pause_api(old)
    assert "cudapool.pause, cudapool.resume" in str(e.value) and "0.1.0" in str(e.value)
    pause_bench.require_pause_api(types.SimpleNamespace(region=1, pause=1, resume=1))


class FakeCuda:
    def __init__(self):
        self.free = 10 * GIB

    def synchronize(self):
        pass

    def mem_get_info(self):
        return self.free, 80 * GIB


class FakeTorch:
    def __init__(self):
        self.cuda = FakeCuda()

    @staticmethod
    def equal(a, b):
        return a == b


def test_pause_resume_bookkeeping():
    torch = FakeTorch()
    b = pause_bench.Bench(torch, 1)
    b.expected = lambda i: i
    ts = list(range(b.n))
    assert b.n == 4 and b.bytes == GIB

    def pause():
        torch.cuda.free += GIB - (1 << 20)  # 1 MiB short of what the tag held: within 1%

    def resume():
        torch.cuda.free -= GIB - (1 << 20)

    assert b.pause_resume(ts, "x", 3, True, pause, resume)
    names = [r["what"] for r in b.results]
    assert names == ["pause keep=True", "resume keep=True", "freed by pause keep=True"]
    assert len(b.results[0]["values"]) == 3, "the first pause is reported apart"
    assert "first pause" in b.results[0]["note"]
    assert b.results[1]["note"] == "contents intact"
    assert b.results[2]["note"] == "within 1%" and len(b.results[2]["values"]) == 4

    ts[2] = "clobbered"
    b.results = []
    assert not b.pause_resume(ts, "x", 2, True, pause, resume)
    assert b.results[1]["note"] == "CONTENTS DIFFER"

    b.results = []
    b.pause_resume(ts, "x", 2, False, lambda: None, lambda: None)
    assert [r["unit"] for r in b.results] == ["ms", "ms", "% of tag"]
    assert b.results[2]["note"] == "NOT within 1%"


def test_table():
    rows = [
        {"impl": "cudapool", "what": "pause keep=True", "unit": "GiB/s", "values": [40.0, 44.0, 42.0], "note": "n"},
        {"impl": "tms", "what": "pause keep=False", "unit": "ms", "values": [10.04, 9.0]},
    ]
    t = pause_bench.format_table(rows).splitlines()
    assert t[0].split()[:4] == ["impl", "what", "median", "min-max"]
    assert "42.00" in t[1] and "40.00-44.00" in t[1] and t[1].endswith("  n")
    assert "9.5" in t[2] and "9.0-10.0" in t[2]


def test_markdown_table():
    rows = [
        {"impl": "cudapool", "what": "pause keep=True", "unit": "GiB/s", "values": [44.0, 45.0, 46.0]},
        {"impl": "cudapool", "what": "link D2H (pinned copy_)", "unit": "GiB/s", "values": [48.0]},
        {"impl": "cudapool", "what": "pause keep=False", "unit": "ms", "values": [3.0, 4.0]},
        {"impl": "tms", "what": "pause keep=True", "unit": "GiB/s", "values": [2.09]},
    ]
    t = pause_bench.format_markdown(rows, 16).splitlines()
    assert t[0] == "| 16 GiB | cudapool | torch_memory_saver 0.0.10 | pinned copy_ (the link) |"
    assert t[1] == "|---|---|---|---|"
    assert t[2] == "| pause, contents kept (GiB/s) | 45.00 (44.00-46.00) | 2.09 | 48.00 |"
    assert t[4] == "| pause, contents discarded (ms) | 3.5 (3.0-4.0) | - |  |"
    assert len(t) == 2 + len(pause_bench.MARKDOWN_ROWS)
