#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Charts of a benchmark run (matplotlib, SVG), for the README:

  ratios.svg  each operation's time with every allocator relative to
              PyTorch's native one (throughputs inverted: < 1 is faster)
  memory.svg  peak reserved vs peak allocated per allocator (GPT-2 training
              and the trace replay)
  trace.svg   reserved and allocated bytes over the trace replay, for
              native, native expandable and cudapool

    python3 bench/charts.py --results DIR [--out docs/charts]
    python3 bench/charts.py --from-md bench/RESULTS.md [--series DIR] [--out docs/charts]

--results reads the JSON result lines bench/run_bench.sh writes
($OUT/results), through bench/report.py's loader and metrics, so the charts
show exactly the table's numbers; bench/report.py calls draw_results() for
every report it writes. --from-md reads a results table report.py wrote,
for runs whose raw results were not kept. The reserved/allocated series
exists only where c_bench/native_bench ran with --trace-series N (section
"trace_series"; BENCH_C_ARGS="--trace-series 600" bash bench/run_bench.sh);
--series DIR adds the series from such result files to a --from-md table.
"""
import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402  (bench/report.py: configurations, labels, metrics, loader)

CHART_FILES = ("ratios.svg", "memory.svg", "trace.svg")

# The operations of the ratio chart: report.py's metric label, short name.
OPERATIONS = [
    ("C: malloc+free, 4 KiB hot loop", "C malloc+free, 4 KiB"),
    ("C: malloc+free, mixed 512 B-144 MiB, 256 live", "C malloc+free, mixed sizes"),
    ("C: 4 threads, own streams, 4 KiB pairs", "C 4 threads, 4 KiB"),
    ("C: 8 threads, own streams, 4 KiB pairs", "C 8 threads, 4 KiB"),
    ("trace replay: time per op (cached)", "C trace replay, per op"),
    ("torch.empty + free, 4 KiB", "torch.empty+free, 4 KiB"),
    ("torch.empty + free, mixed sizes", "torch.empty+free, mixed"),
    ("GPT-2 training step, variable seq len", "GPT-2 training step"),
    ("CUDA graph capture (forward)", "CUDA graph capture"),
    ("CUDA graph replay", "CUDA graph replay"),
]
# (allocated, reserved, reserved/allocated labels, panel title) of the
# memory chart; the ratio row is the table's (unrounded when from results).
MEMORY = [
    ("training peak allocated", "training peak reserved", "training reserved / allocated", "GPT-2 training"),
    ("trace replay: peak allocated", "trace replay: peak reserved", "trace replay: reserved / allocated",
     "trace replay (C)"),
]
TRACE_CONFIGS = ["native", "expandable", "cudapool"]
COLORS = {"native": "#4c72b0", "expandable": "#55a868", "async": "#8172b2", "cudapool": "#dd8452",
          "cudapool_exp": "#c44e52"}
SERIES_KEYS = ("trace_series_op", "trace_series_allocated", "trace_series_reserved")
SHORT = {"native": "native", "expandable": "native\nexpandable", "async": "native\nasync",
         "cudapool": "cudapool", "cudapool_exp": "cudapool\nexpandable"}
GiB = float(1 << 30)


class Table:
    """What the charts need: values[metric label][config] (in the table's
    units), the reserved/allocated series per config, and where they came from."""

    def __init__(self):
        self.values = {}
        self.series = {}  # config -> (ops, allocated bytes, reserved bytes)
        self.source = ""  # "H200, 2026-11-22 03:41 UTC" and the like
        self.series_source = ""
        self.series_every = None

    def value(self, label, cfg):
        return self.values.get(label, {}).get(cfg)


def _metric(label):
    for m in report.METRICS:
        if m.label == label:
            return m
    return None


def _series_from(res, table, source):
    for cfg in report.CONFIGS:
        rec = res.record("c", cfg) or {}
        cols = [rec.get(k) for k in SERIES_KEYS]
        if all(isinstance(c, list) and c for c in cols) and len({len(c) for c in cols}) == 1:
            table.series[cfg] = tuple(cols)
            table.series_every = rec.get("trace_series_every")
    if table.series:
        table.series_source = source


def _source(meta, gpu_fallback=""):
    gpu = (meta.get("gpu") or gpu_fallback or "unknown GPU").replace("NVIDIA ", "")
    return f"{gpu}, {meta.get('date_utc') or 'undated'}"


def table_from_results(res):
    """A Table from a report.Results (report.load(DIR))."""
    t = Table()
    for m in report.METRICS:
        t.values[m.label] = {cfg: m.value(res.record(m.kind, cfg)) for cfg in report.CONFIGS}
    dev = next((r.get("device_name") for r in (res.record("torch", c) for c in report.CONFIGS) if r and
                r.get("device_name")), "")
    t.source = _source(res.meta, dev)
    _series_from(res, t, t.source)
    return t


def _number(cell):
    """'1,243' -> 1243.0, '290.0 [1]' -> 290.0, 'n/a [2]' -> None."""
    m = re.match(r"\s*(-?[\d,]+(?:\.\d+)?)", cell)
    return float(m.group(1).replace(",", "")) if m else None


def table_from_markdown(path):
    """A Table from a results file or README section report.py wrote."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    t = Table()
    by_label = {v: k for k, v in report.LABELS.items()}
    meta = {}
    cols = None
    for line in lines:
        m = re.match(r"- (date|GPU): (.*)", line)
        if m:
            meta["date_utc" if m.group(1) == "date" else "gpu"] = re.sub(r" \(.*", "", m.group(2).split(", driver")[0])
            continue
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[:2] == ["metric", "unit"]:
            cols = {i: by_label[c] for i, c in enumerate(cells) if c in by_label}
            continue
        if cols is None or set(cells[0]) <= set("-: "):
            continue
        t.values[cells[0]] = {cfg: _number(cells[i]) if i < len(cells) else None for i, cfg in cols.items()}
    if cols is None:
        raise ValueError(f"{path}: no results table (a line starting with '| metric | unit |')")
    t.source = _source(meta)
    return t


# ---------------------------------------------------------------------------
# Drawing


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Text stays text (smaller, searchable files); fixed ids and no date:
    # the same data gives the same file.
    plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "cudapool", "font.size": 9})
    return plt


def _save(fig, path):
    fig.savefig(path, format="svg", metadata={"Date": None}, bbox_inches="tight")


def ratios(table):
    """[(short name, {config: time ratio vs native})] for the operations
    with a native value; throughputs (higher is better) are inverted so
    that below 1 always means faster than native."""
    out = []
    for label, short in OPERATIONS:
        m = _metric(label)
        nat = table.value(label, "native")
        if m is None or not nat:
            continue
        r = {}
        for cfg in report.CONFIGS[1:]:
            v = table.value(label, cfg)
            if v:
                r[cfg] = nat / v if m.better == "higher" else v / nat
        if r:
            out.append((short, r))
    return out


def draw_ratios(table, path):
    plt = _pyplot()
    rows = ratios(table)
    cfgs = [c for c in report.CONFIGS[1:] if any(c in r for _, r in rows)]
    fig, ax = plt.subplots(figsize=(7.5, 0.45 * max(len(rows), 1) * max(len(cfgs), 1) / 2 + 1.4))
    h = 0.8 / max(len(cfgs), 1)
    for j, cfg in enumerate(cfgs):
        ys = [i + (j - (len(cfgs) - 1) / 2) * h for i in range(len(rows))]
        xs = [r.get(cfg, float("nan")) for _, r in rows]
        ax.barh(ys, xs, height=h, color=COLORS[cfg], label=report.LABELS[cfg], left=0)
        for y, x in zip(ys, xs):
            if x == x:
                ax.text(x * 1.03, y, f"{x:.2f}", va="center", fontsize=6.5)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_yticks(range(len(rows)), [n for n, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("time relative to PyTorch native (log scale; < 1 is faster; throughputs inverted)")
    ax.set_title(f"Per-operation cost vs PyTorch's native allocator ({table.source})")
    ax.legend(fontsize=7, loc="lower right")
    _save(fig, path)
    plt.close(fig)


def draw_memory(table, path):
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(MEMORY), figsize=(9, 3.4))
    for ax, (alabel, rlabel, qlabel, title) in zip(axes, MEMORY):
        cfgs = [c for c in report.CONFIGS if table.value(alabel, c) and table.value(rlabel, c)]
        xs = range(len(cfgs))
        alloc = [table.value(alabel, c) for c in cfgs]
        res = [table.value(rlabel, c) for c in cfgs]
        ax.bar([x - 0.2 for x in xs], alloc, width=0.4, color="#b0b0b0", label="peak allocated")
        ax.bar([x + 0.2 for x in xs], res, width=0.4, color=[COLORS[c] for c in cfgs], label="peak reserved")
        for x, c, a, r in zip(xs, cfgs, alloc, res):
            q = table.value(qlabel, c) or r / a
            ax.text(x + 0.2, r, f"{q:.3f}x", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(xs), [SHORT[c] for c in cfgs], fontsize=7)
        ax.set_ylabel("GiB")
        ax.set_title(title)
        ax.set_ylim(0, max(res + [1]) * 1.35)
        if not cfgs:
            ax.text(0.5, 0.5, "not measured", ha="center", transform=ax.transAxes)
    from matplotlib.patches import Patch

    axes[0].legend(ncol=2, handles=[Patch(color="#b0b0b0", label="peak allocated"),
                            Patch(color="#505050", label="peak reserved (allocator's colour)")], fontsize=7,
                   loc="upper left")
    fig.suptitle(f"Peak reserved vs peak allocated; labels: reserved / allocated ({table.source})", fontsize=9)
    _save(fig, path)
    plt.close(fig)


def draw_trace(table, path):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    drawn = [c for c in TRACE_CONFIGS if c in table.series]
    for cfg in drawn:
        ops, alloc, res = table.series[cfg]
        ax.plot(ops, [v / GiB for v in res], color=COLORS[cfg], linewidth=1.2, label=f"{report.LABELS[cfg]}: reserved")
        ax.plot(ops, [v / GiB for v in alloc], color=COLORS[cfg], linewidth=0.8, linestyle="--",
                label=f"{report.LABELS[cfg]}: allocated")
    missing = [report.LABELS[c] for c in TRACE_CONFIGS if c not in table.series]
    if missing:
        ax.text(0.01, 0.97, "not recorded: " + ", ".join(missing), transform=ax.transAxes, va="top", fontsize=7,
                color="#a00000")
    ax.set_xlabel("operations replayed (demo/trace.txt, every pass; bytes sampled every "
                  f"{table.series_every or '?'} operations)")
    ax.set_ylabel("GiB")
    ax.set_title(f"Reserved and allocated memory over the trace replay ({table.series_source or 'no series recorded'})")
    if drawn:
        ax.legend(fontsize=7, loc="lower right", ncol=len(drawn))
    _save(fig, path)
    plt.close(fig)


def draw_all(table, out):
    """Writes the three charts into out; returns a line saying what it did."""
    try:
        _pyplot()
    except ImportError as e:
        return f"charts: not drawn, matplotlib is not installed ({e}); pip install matplotlib"
    os.makedirs(out, exist_ok=True)
    draw_ratios(table, os.path.join(out, "ratios.svg"))
    draw_memory(table, os.path.join(out, "memory.svg"))
    draw_trace(table, os.path.join(out, "trace.svg"))
    note = "" if table.series else " (no reserved/allocated series in these results: run with --trace-series)"
    return f"charts: wrote {', '.join(os.path.join(out, f) for f in CHART_FILES)}{note}"


def draw_results(res, out):
    """bench/report.py's hook: the charts of a loaded run; never raises."""
    try:
        return draw_all(table_from_results(res), out)
    except Exception as e:  # a chart must not cost the report
        return f"charts: not drawn ({type(e).__name__}: {e})"


def main(argv=None):
    ap = argparse.ArgumentParser(description="cudapool benchmark charts (SVG)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--results", help="directory with run_bench.sh's JSON result files")
    src.add_argument("--from-md", help="a results table written by bench/report.py (bench/RESULTS.md)")
    ap.add_argument("--series", help="result files holding trace_series lines, for --from-md")
    ap.add_argument("--series-source", default=None, help="what the --series data is (for the chart's title)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                  "docs", "charts"))
    args = ap.parse_args(argv)
    table = table_from_results(report.load(args.results)) if args.results else table_from_markdown(args.from_md)
    if args.series:
        sres = report.load(args.series)
        _series_from(sres, table, args.series_source or _source(sres.meta))
    msg = draw_all(table, args.out)
    print(msg)
    return 0 if msg.startswith("charts: wrote") else 1


if __name__ == "__main__":
    sys.exit(main())
