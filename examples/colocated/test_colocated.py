# SPDX-License-Identifier: Apache-2.0
"""examples/colocated/colocated.py without a GPU: arguments, the message
when cudapool lacks pause, the reference run's arguments and the report."""
import os
import subprocess
import sys
import types

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import colocated  # noqa: E402


def test_arguments():
    a = colocated.parse_args([])
    assert (a.rounds, a.steps, a.no_pause, a.tms) == (3, 4, False, False)
    for bad in (["--cache-len", "10"], ["--steps", "0"], ["--rounds", "-1"]):
        with pytest.raises(SystemExit):
            colocated.parse_args(bad)


@pytest.mark.parametrize("flags", [["--no-pause"], ["--tms"]])
def test_dry_run(flags):
    out = subprocess.run([sys.executable, os.path.join(HERE, "colocated.py"), "--dry-run", *flags],
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith("colocated: ") and "3 rounds x 4 steps" in out


def test_missing_pause_api():
    old = types.SimpleNamespace(__version__="0.1.0", __file__="/x/cudapool/__init__.py")
    with pytest.raises(SystemExit) as e:
        colocated.require_pause_api(old)
    msg = str(e.value)
    assert "cudapool.region, cudapool.pause, cudapool.resume, cudapool.paused" in msg and "0.1.0" in msg
    colocated.require_pause_api(types.SimpleNamespace(region=1, pause=1, resume=1, paused=1))


def test_reference_arguments():
    argv = ["--rounds", "2", "--json-out", "r.json", "--tokens-out=t.json", "--reference", "x", "--tms"]
    assert colocated.strip_options(argv, ("--json-out", "--tokens-out", "--reference")) == ["--rounds", "2", "--tms"]


def test_report_table():
    class Cuda:
        def synchronize(self):
            pass

        def mem_get_info(self):
            return 30 << 30, 80 << 30

    class Saver:
        def reserved(self):
            return 3 << 30

        def paused(self):
            return "['engine_cache']"

    rep = colocated.Report(types.SimpleNamespace(cuda=Cuda()), Saver())
    rep.phase(0, "start")
    rep.timed(1, "pause cache (discard)", lambda: None)
    lines = rep.table().splitlines()
    assert lines[0].split()[:3] == ["round", "phase", "in"]
    assert "50.00" in lines[1] and "3.00" in lines[1] and lines[1].endswith("['engine_cache']")
    assert rep.rows[1]["ms"] is not None and rep.rows[0]["ms"] is None
