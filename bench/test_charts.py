# SPDX-License-Identifier: Apache-2.0
"""Tests of bench/charts.py and of the --trace-series recording.

    python3 -m pytest bench/test_charts.py

Reading results and computing what the charts show needs no matplotlib;
the drawing tests skip, saying so, where matplotlib is not installed.
"""
import io
import json
import os
import random
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from contextlib import redirect_stdout

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import charts  # noqa: E402
import report  # noqa: E402

GiB = 1 << 30


def have_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


needs_mpl = pytest.mark.skipif(not have_matplotlib(), reason="matplotlib is not installed (pip install matplotlib)")


def synthetic_run(directory, seed=1, series=("native", "cudapool")):
    """Result lines for every configuration, with numbers drawn at random."""
    rnd = random.Random(seed)
    lines = [{"kind": "meta", "date_utc": "2026-11-23 04:00 UTC", "gpu": "NVIDIA H100 80GB HBM3"}]
    for cfg in report.CONFIGS:
        pa = rnd.uniform(4, 6) * GiB
        lines += [
            {"kind": "c", "config": cfg, "section": "trace", "trace_peak_allocated": pa,
             "trace_peak_reserved": pa * rnd.uniform(1.01, 1.3), "trace_ns_per_op": rnd.uniform(200, 2000)},
            {"kind": "c", "config": cfg, "section": "hot", "hot_ns_per_pair": rnd.uniform(200, 1500)},
            {"kind": "c", "config": cfg, "section": "mixed", "mixed_ns_per_pair": rnd.uniform(600, 4000)},
            {"kind": "c", "config": cfg, "section": "threads", "threads4_pairs_per_s": rnd.uniform(1e5, 2e6),
             "threads8_pairs_per_s": rnd.uniform(1e5, 2e6)},
            {"kind": "torch", "config": cfg, "section": "train", "train_ms_per_step": rnd.uniform(35, 45),
             "train_peak_allocated": pa, "train_peak_reserved": pa * rnd.uniform(1.01, 1.3)},
            {"kind": "torch", "config": cfg, "section": "graph", "graph_capture_ms": rnd.uniform(4, 13),
             "graph_replay_ms": rnd.uniform(2, 2.2), "graph_pool_bytes": 270 << 20},
            {"kind": "torch", "config": cfg, "section": "empty", "empty_small_us": rnd.uniform(1.5, 3),
             "empty_mixed_us": rnd.uniform(2, 7)},
        ]
        if cfg in series:
            n = 50
            lines.append({"kind": "c", "config": cfg, "section": "trace_series", "trace_series_every": 7,
                          "trace_series_op": [7 * (i + 1) for i in range(n)],
                          "trace_series_allocated": [rnd.randrange(GiB) for _ in range(n)],
                          "trace_series_reserved": [GiB + i * (1 << 20) for i in range(n)]})
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "run.json"), "w") as f:
        for o in lines:
            f.write(json.dumps(o) + "\n")
    # The other traces (run_bench.sh's part "traces"), one file per trace and configuration.
    for label in report.TRACES:
        for cfg in report.CONFIGS:
            pa = rnd.uniform(4, 14) * GiB
            with open(os.path.join(directory, f"ctrace_{label}_{cfg}.json"), "w") as f:
                f.write(json.dumps({"kind": "c", "config": cfg, "section": "trace", "trace_peak_allocated": pa,
                                    "trace_peak_reserved": pa * rnd.uniform(1.0, 1.5)}) + "\n")
    return report.load(directory)


def test_every_charted_label_is_a_report_metric():
    labels = {m.label for m in report.METRICS}
    for label, _ in charts.OPERATIONS:
        assert label in labels
    for row in charts.MEMORY:
        for label in row[:3]:
            assert label in labels


def test_markdown_table_gives_the_results_numbers(tmp_path):
    """The table report.py writes, read back, has the numbers of the run
    (to the digits it shows)."""
    res = synthetic_run(str(tmp_path / "r"))
    from_results = charts.table_from_results(res)
    rows, notes = report.build_rows(res)
    md = tmp_path / "RESULTS.md"
    md.write_text(report.render_markdown(res, rows, notes))
    from_md = charts.table_from_markdown(str(md))
    compared = 0
    for m in report.METRICS:
        for cfg in report.CONFIGS:
            want, got = from_results.value(m.label, cfg), from_md.value(m.label, cfg)
            assert (want is None) == (got is None), (m.label, cfg)
            if want is not None:
                assert abs(want - got) <= 0.5 * 10 ** -m.digits + 1e-9, (m.label, cfg, want, got)
                compared += 1
    # The rows measured only in one process (report.AltMetric) have no runs to chart.
    per_config = [m for m in report.METRICS if not isinstance(m, report.AltMetric)]
    assert compared >= len(per_config) * len(report.CONFIGS) - 5
    assert from_md.source == from_results.source == "H100 80GB HBM3, 2026-11-23 04:00 UTC"


def test_ratios_are_time_relative_to_native(tmp_path):
    t = charts.table_from_results(synthetic_run(str(tmp_path / "r"), seed=7))
    got = dict(charts.ratios(t))
    hot = got["C malloc+free, 4 KiB"]
    label = "C: malloc+free, 4 KiB hot loop"
    assert hot["cudapool"] == pytest.approx(t.value(label, "cudapool") / t.value(label, "native"))
    thr = got["C 4 threads, 4 KiB"]  # a throughput: inverted
    label = "C: 4 threads, own streams, 4 KiB pairs"
    assert thr["cudapool"] == pytest.approx(t.value(label, "native") / t.value(label, "cudapool"))
    assert "native" not in hot and set(hot) == set(report.CONFIGS[1:])


def test_series_are_read_and_inconsistent_ones_left_out(tmp_path):
    t = charts.table_from_results(synthetic_run(str(tmp_path / "r")))
    assert set(t.series) == {"native", "cudapool"} and t.series_every == 7
    ops, alloc, res = t.series["cudapool"]
    assert len(ops) == len(alloc) == len(res) == 50
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "x.json").write_text(json.dumps({"kind": "c", "config": "native", "section": "trace_series",
                                            "trace_series_op": [1, 2], "trace_series_allocated": [1],
                                            "trace_series_reserved": [1, 2]}) + "\n")
    assert charts.table_from_results(report.load(str(bad))).series == {}


def test_the_repository_results_file_parses():
    t = charts.table_from_markdown(os.path.join(HERE, "RESULTS.md"))
    assert set(t.values) == {m.label for m in report.METRICS}
    assert charts.ratios(t), "no operation has a native value"


def test_markdown_without_a_table_is_an_error(tmp_path):
    p = tmp_path / "x.md"
    p.write_text("# nothing\n")
    with pytest.raises(ValueError, match="no results table"):
        charts.table_from_markdown(str(p))


def svg_texts(path):
    root = ET.parse(path).getroot()  # also: the file is well-formed XML
    return " ".join(e.text or "" for e in root.iter() if e.tag.endswith("text"))


@needs_mpl
def test_draw_all_writes_three_svgs_deterministically(tmp_path):
    t = charts.table_from_results(synthetic_run(str(tmp_path / "r")))
    msg = charts.draw_all(t, str(tmp_path / "a"))
    assert msg.startswith("charts: wrote")
    charts.draw_all(t, str(tmp_path / "b"))
    for name in charts.CHART_FILES:
        a = (tmp_path / "a" / name).read_bytes()
        assert a == (tmp_path / "b" / name).read_bytes(), f"{name} differs between two drawings"
    ratios = svg_texts(tmp_path / "a" / "ratios.svg")
    assert "GPT-2 training step" in ratios and "cudapool expandable" in ratios and "H100 80GB HBM3" in ratios
    memory = svg_texts(tmp_path / "a" / "memory.svg")
    q = t.value("trace replay: reserved / allocated", "cudapool")
    assert f"{q:.3f}x" in memory
    trace = svg_texts(tmp_path / "a" / "trace.svg")
    assert "cudapool: reserved" in trace and "native: allocated" in trace
    assert "not recorded: native expandable" in trace


@needs_mpl
def test_report_draws_the_charts_beside_the_readme(tmp_path):
    synthetic_run(str(tmp_path / "r"))
    readme = tmp_path / "README.md"
    readme.write_text("<!-- perf:start -->\n<!-- perf:end -->\n")
    buf = io.StringIO()
    with redirect_stdout(buf):
        report.main(["--results", str(tmp_path / "r"), "--readme", str(readme)])
    assert "charts: wrote" in buf.getvalue()
    for name in charts.CHART_FILES:
        assert (tmp_path / "docs" / "charts" / name).stat().st_size > 1000


def test_report_without_matplotlib_says_so(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *a, **kw):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    synthetic_run(str(tmp_path / "r"))
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert report.main(["--results", str(tmp_path / "r"), "--charts", str(tmp_path / "c")]) == 0
    assert "charts: not drawn, matplotlib is not installed" in buf.getvalue()
    assert not (tmp_path / "c").exists()


def test_trace_series_recording_on_the_simulator(tmp_path):
    """c_bench --trace-series: samples cover every pass, reserved >= allocated
    at each, and the highest sampled reserved is the trace's peak (cudapool
    never returns memory during the replay)."""
    lib = os.path.join(REPO, "lib", "libcudapool.so")
    cc = shutil.which("gcc") or shutil.which("cc")
    if not os.path.isfile(lib) or cc is None:
        pytest.skip("needs lib/libcudapool.so (make) and a C compiler")
    exe = tmp_path / "c_bench"
    subprocess.run([cc, "-std=c11", "-O1", "-Wall", "-Werror", "-I", os.path.join(REPO, "include"), "-I", HERE,
                    os.path.join(HERE, "c_bench.c"), "-o", str(exe), "-L", os.path.dirname(lib), "-lcudapool",
                    "-ldl", "-pthread", f"-Wl,-rpath,{os.path.dirname(lib)}"], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("CUDAPOOL_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    env["CUDAPOOL_BACKEND"] = "sim"
    out = subprocess.run([str(exe), "--config", "cudapool", "--trace", os.path.join(REPO, "demo", "trace.txt"),
                          "--sections", "trace", "--trace-repeats", "2", "--trace-series", "100"],
                         env=env, capture_output=True, text=True, timeout=120, check=True).stdout
    recs = {r["section"]: r for r in map(json.loads, out.splitlines())}
    tr, s = recs["trace"], recs["trace_series"]
    ops, alloc, res = s["trace_series_op"], s["trace_series_allocated"], s["trace_series_reserved"]
    total = 2 * tr["trace_ops"]
    assert s["trace_series_every"] == total // 100
    assert 100 <= len(ops) <= 102 and ops == sorted(ops) and ops[-1] == total
    assert len(alloc) == len(res) == len(ops)
    assert all(r >= a >= 0 for a, r in zip(alloc, res))
    assert max(res) == tr["trace_peak_reserved"]
    assert 0 < max(alloc) <= tr["trace_peak_allocated"]


@pytest.mark.parametrize("script", ["bench/trace_series.sh", "gpu/wheel_check.sh", "examples/c/test_install.sh"])
def test_packaging_scripts_parse(script):
    shell = "sh" if script.startswith("examples/") else "bash"
    out = subprocess.run([shell, "-n", os.path.join(REPO, script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
