#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Builds the benchmark comparison from the JSON result lines of a run.

    python3 bench/report.py --results DIR [--md bench/RESULTS.md] [--readme README.md]

Reads every *.json / *.jsonl file under DIR (one JSON object per line, as
printed by bench/c_bench, bench/native_bench, bench/torch_bench.py and
bench/run_bench.sh), prints the comparison table, writes the markdown
results file and replaces the README's performance section: the text
between the lines `<!-- perf:start -->` and `<!-- perf:end -->` (left alone,
with a note, when the README or its markers are missing).

Result lines: {"kind": "c"|"torch", "config": CONFIG, "section": ..., ...}
merged per (kind, config); {"kind": "meta", ...} describes the machine;
{"kind": "step", "name": ..., "status": ..., ...} tells how each step of
run_bench.sh ended, to explain missing numbers; {"kind": "pair", ...} is
bench/pair_bench.c's (both allocators in one process, reps alternated);
{"kind": "torch_turns", ...} bench/turn_pair.sh's (two torch_bench.py
processes taking turns on one CPU: bench/turns.py). Nothing here needs torch;
a missing or broken result is shown as "n/a" with its reason.
"""
import argparse
import datetime
import glob
import statistics
import os
import random
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import turns  # noqa: E402  (bench/turns.py)

CONFIGS = ["native", "expandable", "async", "cudapool", "cudapool_exp"]
LABELS = {
    "native": "native",
    "expandable": "native expandable",
    "async": "native cudaMallocAsync",
    "cudapool": "cudapool",
    "cudapool_exp": "cudapool expandable",
}
START = "<!-- perf:start -->"
END = "<!-- perf:end -->"

GiB = float(1 << 30)
MiB = float(1 << 20)


class Metric:
    """One row: value(record) -> number or None."""

    def __init__(self, label, kind, key, unit, scale=1.0, digits=2, better="lower", target=None,
                 section=None, errkey=None, paired=None):
        self.label = label
        self.kind = kind
        self.key = key  # a record key, or a function(record) -> value or None
        self.unit = unit
        self.scale = scale
        self.digits = digits
        self.better = better  # "lower", "higher" or None
        self.target = target  # max (lower) / min (higher) cudapool/native ratio
        self.section = section  # the result section that holds the value
        self.errkey = errkey  # its "<errkey>_error" explains a missing value (default: section)
        # (alt configuration, key): the row is judged by this paired in-process
        # ratio (one per process of torch_bench.py's alt sections), not by
        # the ratio of the medians, which is shown beside it.
        self.paired = paired

    def value(self, rec):
        if rec is None:
            return None
        v = self.key(rec) if callable(self.key) else rec.get(self.key)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return None
        if v != v or v < 0:  # NaN, or -1 for "unknown"
            return None
        return v / self.scale

    def fmt(self, v):
        return f"{v:,.{self.digits}f}" if v is not None else "n/a"

    def spread(self, rec):
        """(min, max) over the runs that reported this metric, or None for
        one run or a derived metric."""
        key, scale = self.key, self.scale
        if callable(key):  # derived: only a rescaled key has runs (_mpairs)
            key, scale = getattr(key, "sample_key", None), scale * getattr(key, "sample_scale", 1.0)
        if rec is None or key is None:
            return None
        v = [x for x in rec.get("_samples", {}).get(key, []) if x == x and x >= 0]
        if len(v) < 2:
            return None
        return min(v) / scale, max(v) / scale

    def cell(self, rec):
        """The median, with the min-max of the runs when there are several."""
        v = self.value(rec)
        sp = self.spread(rec) if v is not None else None
        if sp is None or self.fmt(sp[0]) == self.fmt(sp[1]):
            return self.fmt(v)
        return f"{self.fmt(v)} ({self.fmt(sp[0])}-{self.fmt(sp[1])})"

    def target_text(self):
        if self.target is None:
            return "-"
        op = "<=" if self.better == "lower" else ">="
        return f"{op} {self.target:g}x" + (" paired" if self.paired else "")


class AltMetric(Metric):
    """A row measured only with both allocators in one process, their reps
    alternating (torch_bench.py's altcompile section): each process gives
    each side's median per rep (native_key, cudapool_key) and the median of
    its per-pair ratios (ratio_key, the row's judge). A cell is the median
    (min-max) over the processes; the other configurations have none."""

    def __init__(self, label, unit, native_key, cudapool_key, ratio_key, digits=2, target=1.0, errkey=None):
        super().__init__(label, "alt", None, unit, digits=digits, target=target, section="altcompile",
                         errkey=errkey, paired=("cudapool", ratio_key))
        self.side_keys = {"native": native_key, "cudapool": cudapool_key}

    def side_values(self, res, side):
        """Each process's value of side ("native" or "cudapool")."""
        key = self.side_keys[side]
        return [float(x[key]) for x in res.alts.get(self.paired[0]) or []
                if isinstance(x.get(key), (int, float)) and not isinstance(x.get(key), bool) and x[key] > 0]

    def side_cell(self, res, side):
        v = self.side_values(res, side)
        if not v:
            return None, None
        med = statistics.median(v)
        if len(v) < 2 or self.fmt(min(v)) == self.fmt(max(v)):
            return med, self.fmt(med)
        return med, f"{self.fmt(med)} ({self.fmt(min(v))}-{self.fmt(max(v))})"


def _ratio(num, den):
    def f(rec):
        a, b = rec.get(num), rec.get(den)
        if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or a < 0 or b <= 0:
            return None
        return a / b
    return f


def _mpairs(key):
    def f(rec):
        v = rec.get(key)
        return v / 1e6 if isinstance(v, (int, float)) and v >= 0 else None
    f.sample_key, f.sample_scale = key, 1e6
    return f


METRICS = [
    Metric("C: malloc+free, 4 KiB hot loop", "c", "hot_ns_per_pair", "ns/pair", digits=0, target=0.5,
           section="hot"),
    Metric("C: malloc+free, mixed 512 B-144 MiB, 256 live", "c", "mixed_ns_per_pair", "ns/pair", digits=0,
           target=0.6, section="mixed"),
    Metric("C: 4 threads, own streams, 4 KiB pairs", "c", _mpairs("threads4_pairs_per_s"), "M pairs/s",
           better="higher", section="threads", errkey="threads4"),
    Metric("C: 8 threads, own streams, 4 KiB pairs", "c", _mpairs("threads8_pairs_per_s"), "M pairs/s",
           better="higher", section="threads", errkey="threads8"),
    Metric("torch.empty + free, 4 KiB", "torch", "empty_small_us", "us/pair", target=0.95, section="empty"),
    Metric("torch.empty + free, mixed sizes", "torch", "empty_mixed_us", "us/pair", target=0.95, section="empty"),
    Metric("GPT-2 training step, variable seq len", "torch", "train_ms_per_step", "ms/step", target=1.0,
           section="train"),
    Metric("training peak allocated", "torch", "train_peak_allocated", "GiB", scale=GiB, better=None,
           section="train"),
    Metric("training peak reserved", "torch", "train_peak_reserved", "GiB", scale=GiB, target=1.0,
           section="train"),
    Metric("training reserved / allocated", "torch", _ratio("train_peak_reserved", "train_peak_allocated"), "x",
           digits=3, section="train"),
    # Judged by the paired in-process measure (docs/benchmarks.md, "The host"):
    # the ratio of medians over fresh processes moves by tens of percent here.
    Metric("CUDA graph capture (forward)", "torch", "graph_capture_ms", "ms", digits=1, target=1.02,
           section="graph", paired=("cudapool", "alt_capture_ratio")),
    Metric("CUDA graph replay", "torch", "graph_replay_ms", "ms", digits=2, better=None, section="graph"),
    AltMetric("graph-tree decoding, static KV cache (reduce-overhead)", "ms/token", "alt_decode_native_ms",
              "alt_decode_cudapool_ms", "alt_decode_ratio", digits=3, errkey="alt_decode"),
    AltMetric("compiled model call (reduce-overhead)", "us/call", "alt_compiled_native_us",
              "alt_compiled_cudapool_us", "alt_compiled_ratio", digits=1, errkey="alt_compiled"),
    Metric("CUDA graph private pool", "torch", "graph_pool_bytes", "MiB", scale=MiB, digits=1, target=1.0,
           section="graph"),
    Metric("graph: device memory taken (mem_get_info)", "torch", "graph_devmem_delta", "MiB", scale=MiB,
           digits=1, better=None, section="graph"),
    Metric("trace replay: peak allocated", "c", "trace_peak_allocated", "GiB", scale=GiB, better=None,
           section="trace"),
    Metric("trace replay: peak reserved", "c", "trace_peak_reserved", "GiB", scale=GiB, section="trace"),
    Metric("trace replay: reserved / allocated", "c", _ratio("trace_peak_reserved", "trace_peak_allocated"), "x",
           digits=3, section="trace"),
    Metric("trace replay: time per op (cached)", "c", "trace_ns_per_op", "ns/op", digits=0, section="trace"),
]

# The other allocation traces (run_bench.sh's part "traces"): label -> the
# trace's name. Their lines come from ctrace_LABEL_CFG[_rN].json, with the
# trace section's keys renamed trace_X -> LABEL_X on loading.
TRACES = {
    "kv1": "LLM serving, 1 stream",
    "kv2": "LLM serving, prefill stream",
    "fsdp2": "FSDP2 training, rank 0",
}
for _label, _name in TRACES.items():
    METRICS += [
        Metric(f"{_name}: peak reserved", "c", f"{_label}_peak_reserved", "GiB", scale=GiB,
               section=f"trace_{_label}"),
        Metric(f"{_name}: reserved / allocated", "c", _ratio(f"{_label}_peak_reserved", f"{_label}_peak_allocated"),
               "x", digits=3, section=f"trace_{_label}"),
    ]


# The expandable pair's capture (cudapool expandable against native
# expandable), judged like the capture row by the paired in-process ratio:
# torch_bench.py's alt section run as cudapool_exp, whose native side has
# expandable segments too. Reported in the expandable note and the README.
EXP_CAPTURE_LABEL = "CUDA graph capture (forward), expandable segments"
EXP_CAPTURE_PAIRED = ("cudapool_exp", "alt_capture_ratio")
EXP_CAPTURE_TARGET = 1.02

# torch_bench.py's sections whose lines are paired figures of one process
# each (both allocators alternating), not runs of a configuration.
ALT_SECTIONS = ("alt", "altcompile")

# FSDP2 on 2 GPUs: a note (build_rows) and a README row (render_readme).
FSDP = Metric("FSDP2, 2 GPUs, GPT-2 training step", "torch", "fsdp_ms_per_step", "ms/step", target=1.0,
              section="fsdp")


# ---------------------------------------------------------------------------
# Loading


class Results:
    def __init__(self):
        self.records = {}  # (kind, config) -> merged fields
        self.errors = {}  # (kind, config) -> {section: message}
        self.meta = {}
        self.steps = {}  # step name -> record
        self.bad_lines = 0
        self.files = []
        self.pairs = {}  # pair_bench section -> [its result line per process]
        self.pair_errors = []
        self.turns = {}  # (kind, round) -> {role: fields}: bench/turn_pair.sh's pairs
        self.alts = {}  # config -> [torch_bench.py's alt and altcompile lines, one per process and section]
        self.alt_errors = {}  # config -> ["<section>: <message>"] of the alt lines that failed
        self.by_run = {}  # (config, run) -> the numbers of torch_CONFIG[_rRUN].json
        self.run = None  # the run of the file being loaded (load)
        # The step base of the C results being loaded: "c" (part c's
        # c_CONFIG files), or "ctrace_LABEL" (part traces' replays of trace
        # LABEL); each C record keeps the bases it came from in "_parts".
        self.part = "c"

    def add(self, obj):
        if not isinstance(obj, dict):
            self.bad_lines += 1
            return
        kind = obj.get("kind")
        if kind == "meta":
            self.meta.update({k: v for k, v in obj.items() if k != "kind"})
            return
        if kind == "step":
            name = obj.get("name")
            if isinstance(name, str):
                self.steps[name] = obj
            return
        if kind == "torch_turns":  # bench/turn_pair.sh: two processes taking turns on one CPU
            turns.collect([obj], self.turns)
            return
        if kind == "pair":  # bench/pair_bench.c: both allocators in one process
            sec = obj.get("section")
            if "error" in obj:
                self.pair_errors.append(f"{sec}: {obj['error']}")
            elif sec in ("hot", "mixed") and isinstance(obj.get("ratio"), (int, float)):
                self.pairs.setdefault(sec, []).append(obj)
            return
        config = obj.get("config")
        if kind not in ("c", "torch") or not isinstance(config, str):
            self.bad_lines += 1
            return
        if kind == "torch" and obj.get("section") in ALT_SECTIONS:
            # One line per process, kept apart: each is a paired figure of
            # its own (torch_bench.py's alt sections), not a run to merge.
            sec = obj["section"]
            if f"{sec}_error" in obj:
                self.alt_errors.setdefault(config, []).append(f"{sec}: {obj[f'{sec}_error']}")
            else:
                self.alts.setdefault(config, []).append(obj)
            return
        if kind == "torch" and self.run is not None:
            self.by_run.setdefault((config, self.run), {}).update(
                {k: v for k, v in obj.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
        rec = self.records.setdefault((kind, config), {})
        if kind == "c":
            rec.setdefault("_parts", set()).add(self.part)
        errs = self.errors.setdefault((kind, config), {})
        section = obj.get("section") if isinstance(obj.get("section"), str) else "?"
        for k, v in obj.items():
            if k in ("kind", "config", "section"):
                continue
            if k.endswith("_error"):
                errs[k[: -len("_error")]] = str(v)
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                # Several interleaved runs per config (each a fresh
                # process): the value is the median, the runs' samples
                # are kept for the min-max.
                samples = rec.setdefault("_samples", {}).setdefault(k, [])
                samples.append(float(v) if isinstance(v, float) else v)
                valid = [x for x in samples if x == x and x >= 0]
                rec[k] = statistics.median(valid) if valid else v
                if k == "train_ms_per_step":
                    rec["_train_samples"] = samples
            else:
                rec[k] = v
        rec.setdefault("_sections", [])
        if section not in rec["_sections"]:
            rec["_sections"].append(section)

    def record(self, kind, config):
        return self.records.get((kind, config))

    def reason(self, metric, config):
        """Why the metric has no value for config (a short text)."""
        if isinstance(metric, AltMetric):
            return self.alt_reason(metric)
        kind = metric.kind
        errs = self.errors.get((kind, config), {})
        for sec in (metric.errkey, metric.section, "init", "meta"):
            if sec and sec in errs:
                return f"{sec}: {errs[sec]}"
        # A repeated step is named NAME_rN (run_bench.sh's REPEATS); a trace
        # of part "traces" is replayed by steps ctrace_LABEL_CONFIG.
        base, part = kind, kind
        label = (metric.section or "")[len("trace_"):]
        if kind == "c" and metric.section == f"trace_{label}" and label in TRACES:
            base, part = f"ctrace_{label}", "traces"
        names = [f"{base}_{config}"] + sorted(n for n in self.steps if n.startswith(f"{base}_{config}_r")
                                              and n[len(base) + len(config) + 3:].isdigit())
        if kind == "c":
            names.append("build_c" if config.startswith("cudapool") else "build_native")
        if part == "traces":
            names.append("gen_traces")
        for name in names:
            st = self.steps.get(name)
            if st and st.get("status") not in (None, "ok"):
                why = st.get("reason") or st.get("status")
                return f"{name}: {why}"
        rec = self.record(kind, config)
        if kind == "c" and rec is not None and base not in rec.get("_parts", ()):
            return f"not run (bench/run_bench.sh's part {part} was not in this run)"
        if rec is None:
            return f"no {kind} results for {config}"
        if metric.section and metric.section not in rec.get("_sections", []):
            return f"section {metric.section} did not report (crash or timeout?)"
        return "not measured"


    def alt_reason(self, metric):
        """Why an in-process row (AltMetric) has no value."""
        cfg = metric.paired[0]
        errs = [x[f"{metric.errkey}_error"] for x in self.alts.get(cfg) or [] if f"{metric.errkey}_error" in x]
        errs += [e for e in self.alt_errors.get(cfg) or [] if e.startswith(f"{metric.section}:")]
        if errs:
            return f"{metric.errkey}: {errs[0]}"
        for name in sorted(n for n in self.steps if n == f"torch_{metric.section}" or
                           n.startswith(f"torch_{metric.section}_r")):
            st = self.steps[name]
            if st.get("status") not in (None, "ok"):
                return f"{name}: {st.get('reason') or st.get('status')}"
        return (f"measured only in one process with both allocators (torch_bench.py --sections {metric.section}; "
                f"bench/run_bench.sh, part {metric.section}): not in these results")


def target_verdict(value, target):
    """A target's verdict on value: 'met' at or below it, else 'NOT met'."""
    return "met" if value <= target + 1e-12 else "NOT met"


def median_range(per):
    """'1.049x (1.045-1.126)': the median of the ratios per, with their
    min-max where there is more than one."""
    return f"{statistics.median(per):.3f}x" + (f" ({min(per):.3f}-{max(per):.3f})" if len(per) > 1 else "")


def paired_values(res, paired):
    """The per-process ratios of a paired measure (alt configuration, key)."""
    cfg, key = paired
    return [float(x[key]) for x in res.alts.get(cfg) or []
            if isinstance(x.get(key), (int, float)) and not isinstance(x.get(key), bool)]


def paired_verdict(per, target):
    """'yes (paired 0.999x, 0.992-1.017)' / 'NO (...)': a row judged by its
    paired measure (the median over processes of their per-pair ratios)."""
    r = statistics.median(per)
    spread = f", {min(per):.3f}-{max(per):.3f}" if len(per) > 1 else ""
    return f"{'yes' if r <= target + 1e-12 else 'NO'} (paired {r:.3f}x{spread})"


def ring_runs(res):
    """How many torch-level runs of every configuration took turns in a ring
    (bench/turn_ring.py: their done lines count turns), 0 if any has none."""
    counts = [len(((res.record("torch", c) or {}).get("_samples") or {}).get("turns") or [])
              for c in CONFIGS if res.record("torch", c)]
    return min(counts) if counts else 0


def _trace_renamed(obj, label):
    """A line of a replay of trace label (ctrace_LABEL_CFG.json) as that
    trace's: the trace section's line gets section trace_<label> and its
    keys trace_X become <label>_X (its error trace_<label>_error); of the
    process's other lines (init, done) only an error is kept, as the
    trace's, so that their numbers do not count as runs of the C level.
    None: nothing to keep."""
    if not isinstance(obj, dict) or obj.get("kind") != "c":
        return obj
    section = f"trace_{label}"
    if obj.get("section") != "trace":
        errs = [str(v) for k, v in obj.items() if k.endswith("_error")]
        if not errs:
            return None
        return {"kind": "c", "config": obj.get("config"), "section": section,
                f"{section}_error": f"{obj.get('section')}: {'; '.join(errs)}"}
    out = {}
    for k, v in obj.items():
        if k == "section":
            v = section
        elif k == "trace_error":
            k = f"{section}_error"
        elif k.startswith("trace_"):
            k = f"{label}_{k[len('trace_'):]}"
        out[k] = v
    return out


def load(results_dir):
    res = Results()
    paths = []
    if results_dir and os.path.isdir(results_dir):
        for pat in ("*.json", "*.jsonl"):
            paths.extend(glob.glob(os.path.join(results_dir, "**", pat), recursive=True))
    for path in sorted(set(paths)):
        res.files.append(path)
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            res.bad_lines += 1
            continue
        objs = []
        for line in text.splitlines():
            try:
                obj = turns.parse_line(line)
            except ValueError:
                res.bad_lines += 1
                continue
            if obj is not None:
                objs.append(obj)
        # A process of torch_bench.py's alt sections is a paired figure, not
        # a run: its meta and done lines must not count as one of its
        # configuration's runs (they would make "5-6 runs").
        alt = any(o.get("kind") == "torch" and o.get("section") in ALT_SECTIONS for o in objs)
        # ctrace_LABEL_CFG[_rN].json: a replay of the trace LABEL, whose keys
        # become LABEL's (they would merge into demo/trace.txt's otherwise).
        m = re.fullmatch(r"ctrace_([a-z0-9]+)_.+\.json", os.path.basename(path))
        res.part = "c"
        if m:
            if m.group(1) not in TRACES:
                res.bad_lines += len(objs)  # a trace this report does not know: its keys would mix with trace.txt's
                continue
            objs = [o for o in (_trace_renamed(o, m.group(1)) for o in objs) if o is not None]
            res.part = f"ctrace_{m.group(1)}"
        # torch_CONFIG.json is run 1, torch_CONFIG_rN.json run N (run_bench.sh).
        m = re.fullmatch(r"torch_.+?(?:_r(\d+))?\.json", os.path.basename(path))
        res.run = (int(m.group(1)) if m.group(1) else 1) if m and not alt else None
        for obj in objs:
            if alt and obj.get("kind") == "torch" and obj.get("section") not in ALT_SECTIONS:
                continue
            res.add(obj)
        res.run, res.part = None, "c"
    return res


# ---------------------------------------------------------------------------
# The table


def samples(rec, key):
    """The valid runs of key in a merged record (none: [])."""
    vals = ((rec or {}).get("_samples") or {}).get(key) or []
    return [float(x) for x in vals if isinstance(x, (int, float)) and x == x and x > 0]


def ratio_interval(base, other, iters=4000, seed=11, level=0.95):
    """The percentile bootstrap interval of median(other) / median(base),
    each configuration's runs resampled with replacement (a fixed seed, so a
    report is reproducible); None when either has fewer than 3 runs. It
    shows how far this run's processes resolve a ratio, not a guarantee:
    with 5 runs a resampled median is one of a few values."""
    if len(base) < 3 or len(other) < 3:
        return None
    rnd = random.Random(seed)
    rs = sorted(statistics.median(rnd.choices(other, k=len(other))) / statistics.median(rnd.choices(base, k=len(base)))
                for _ in range(iters))
    return rs[int((1 - level) / 2 * iters)], rs[int((1 + level) / 2 * iters) - 1]


def pair_note(res):
    """The C rows measured with both allocators in one process, their reps
    alternated (bench/pair_bench.c), or None. Each process gives the median
    of its per-pair ratios; the note gives the median of those (min-max)."""
    parts = []
    by_key = {m.key: m for m in METRICS}
    for sec, metric in (("hot", by_key["hot_ns_per_pair"]), ("mixed", by_key["mixed_ns_per_pair"])):
        lines = res.pairs.get(sec) or []
        if not lines:
            continue
        per = [float(x["ratio"]) for x in lines]
        r = statistics.median(per)
        cp = statistics.median(float(x["cudapool_ns"]) for x in lines)
        nat = statistics.median(float(x["native_ns"]) for x in lines)
        parts.append(f"{'4 KiB hot pair' if sec == 'hot' else 'mixed sizes'} {median_range(per)} "
                     f"(cudapool {cp:,.0f} ns, native {nat:,.0f} ns; target <= {metric.target:g}x: "
                     f"{target_verdict(r, metric.target)})")
    if not parts:
        return "C level in one process: failed (" + "; ".join(res.pair_errors) + ")" if res.pair_errors else None
    n = max(len(res.pairs.get(s) or []) for s in ("hot", "mixed"))
    reps = sorted({len(x.get("ratio_reps") or []) for v in res.pairs.values() for x in v})
    return (f"C level with both allocators in one process, their reps alternated so that each pair of reps meets "
            f"the host in the same state (bench/pair_bench.c; {n} processes of {'-'.join(map(str, reps))} "
            f"pairs of reps; median of the processes' median per-pair ratios, cudapool/native, with their "
            f"min-max): " + "; ".join(parts))


def alt_note(res):
    """The torch.empty rows measured with PyTorch's allocator and cudapool
    alternating rep by rep in one process (torch_bench.py's alt section), or
    None: per loop, the median (min-max) over the processes of each
    process's median per-pair ratio, with the rows' targets; then the
    captures alternating the same way (the capture row's judge), of cudapool
    against native and of the two with expandable segments."""
    lines = [x for x in res.alts.get("cudapool") or [] if "alt_small_ratio" in x or "alt_mixed_ratio" in x]
    targets = {m.key: m.target for m in METRICS}
    parts = []
    for loop, key, label in (("small", "empty_small_us", "4 KiB"), ("mixed", "empty_mixed_us", "mixed sizes")):
        per = [float(x[f"alt_{loop}_ratio"]) for x in lines if isinstance(x.get(f"alt_{loop}_ratio"), (int, float))]
        if not per:
            continue
        t = targets[key]
        parts.append(f"{label} {median_range(per)} (target <= {t:g}x: {target_verdict(statistics.median(per), t)})")
    note = ""
    if parts:
        reps = sorted({len(x.get("alt_small_ratio_reps") or []) for x in lines})
        note = (f"torch.empty with PyTorch's allocator and cudapool alternating rep by rep in one process (cudapool's "
                f"class hands allocate() to the allocator it replaced during native's reps: torch_bench.py, section "
                f"alt; {len(lines)} processes of {'-'.join(map(str, reps))} pairs of reps; median of the processes' "
                f"median per-pair ratios, cudapool/native, with their min-max): " + "; ".join(parts))
    caps = []
    for cfg, what, t in (("cudapool", "cudapool/native", targets["graph_capture_ms"]),
                         ("cudapool_exp", "cudapool expandable/native expandable", EXP_CAPTURE_TARGET)):
        per = paired_values(res, (cfg, "alt_capture_ratio"))
        if not per:
            continue
        pairs = sorted({int(x.get("alt_capture_pairs") or 0) for x in res.alts.get(cfg) or []
                        if "alt_capture_ratio" in x})
        caps.append(f"{what} {median_range(per)}, {len(per)} processes of {'-'.join(map(str, pairs))} pairs "
                    f"(target <= {t:g}x: {target_verdict(statistics.median(per), t)})")
    if caps:
        cap = ("CUDA graph capture (forward), the two allocators alternating capture by capture in one process "
               "(the capture, its empty_cache and its pool handed over too; the capture rows' judge): "
               + "; ".join(caps))
        note = f"{note}. {cap}" if note else cap
    return note or None


def altcompile_note(res):
    """What the in-process torch.compile rows measured (torch_bench.py's
    altcompile section), or None: their sizes, and the calls each allocator
    got per token or per call in a counted rep."""
    lines = [x for x in res.alts.get("cudapool") or [] if "alt_decode_ratio" in x or "alt_compiled_ratio" in x]
    if not lines:
        return None

    def one(key):
        vals = sorted({x[key] for x in lines if isinstance(x.get(key), (int, float))})
        return "-".join(f"{v:g}" for v in vals) if vals else "?"

    def calls(prefix, per):
        out = []
        for side in ("native", "cudapool"):
            a, f = one(f"{prefix}_{side}_allocs_per_{per}"), one(f"{prefix}_{side}_frees_per_{per}")
            if a != "?":
                out.append(f"{side} {a} allocate() and {f} frees")
        return f" ({', '.join(out)} per {per})" if out else ""

    parts = []
    if any("alt_decode_ratio" in x for x in lines):
        parts.append(f"decoding: a GPT ({one('alt_decode_layers')} layers, {one('alt_decode_width')} wide, bf16) with "
                     f"a static KV cache, batch {one('alt_decode_batch')}, {one('alt_decode_tokens')} greedy tokens "
                     f"per rep after a {one('alt_decode_prompt')}-token prompt, each token a graph-tree replay of the "
                     f"compiled decode step and the eager sampling around it" + calls("alt_decode", "token"))
    if any("alt_compiled_ratio" in x for x in lines):
        parts.append(f"compiled call: an MLP ({one('alt_compiled_layers')} layers, {one('alt_compiled_width')} wide), "
                     f"batch {one('alt_compiled_batch')}, {one('alt_compiled_calls')} calls per rep, each on a fresh "
                     f"input" + calls("alt_compiled", "call"))
    # What would make a row measure something else: said, not hidden.
    for prefix, what in (("alt_decode", "decoding"), ("alt_compiled", "compiled call")):
        odd = []
        for key, text in (("same_results", "the two sides' results differed"),
                          ("cudagraph_skips", "torch.compile ran without CUDA graphs"),
                          ("native_graphs_recorded_in_reps", "native recorded graphs during its reps"),
                          ("cudapool_graphs_recorded_in_reps", "cudapool recorded graphs during its reps"),
                          ("native_other_allocs", "cudapool was called during native's counted rep"),
                          ("cudapool_other_allocs", "native was called during cudapool's counted rep")):
            vals = [x.get(f"{prefix}_{key}") for x in lines]
            if key == "same_results":
                bad = [v for v in vals if v is False]
            else:  # counts: any above 0
                bad = [v for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0]
            if bad:
                odd.append(f"{text} in {len(bad)} of {len(lines)} processes")
        if odd:
            parts.append(f"{what}: " + ", ".join(odd))
    pairs = one("alt_decode_pairs") if any("alt_decode_pairs" in x for x in lines) else one("alt_compiled_pairs")
    return ("torch.compile(mode=\"reduce-overhead\") rows, measured only in one process with both allocators "
            "(torch_bench.py, section altcompile; each side its own model, compiled function, CUDA graph tree and "
            "graph pool, made in its own turns; then the sides alternate rep by rep, N C, C N, ...; "
            f"{len(lines)} processes of {pairs} pairs; a cell is the median (min-max) over the processes of each "
            "side's median rep, the row is judged by the median of the processes' median per-pair ratios): "
            + "; ".join(parts))


def ring_note(res):
    """The torch rows' targeted ratios within each ring (bench/turn_ring.py),
    or None: a ring's processes took turns rep by rep, so the ratio of its
    cudapool process to its native one pairs them, where the table's ratio
    of medians (most targets' measure) takes each median from whichever run
    it falls in. Per metric, the median (min-max) of the rings' ratios."""
    rings = sorted({r for (c, r), v in res.by_run.items() if c == "native" and "turns" in v})
    if not rings:
        return None
    parts = []
    for m in METRICS:
        if m.kind != "torch" or m.target is None or not isinstance(m.key, str):
            continue
        for base, test, label in (("native", "cudapool", m.label), ("expandable", "cudapool_exp", None)):
            if label is None:  # of the expandable pair, the capture row has a target (note on cudapool expandable)
                if m.key != "graph_capture_ms":
                    continue
                label = m.label + ", cudapool expandable / native expandable"
            rs = []
            for r in rings:
                b, t = res.by_run.get((base, r), {}), res.by_run.get((test, r), {})
                if "turns" in b and "turns" in t and b.get(m.key, 0) > 0 and t.get(m.key, 0) > 0:
                    rs.append(t[m.key] / b[m.key])
            if rs:
                parts.append(f"{label} {statistics.median(rs):.3f}x ({min(rs):.3f}-{max(rs):.3f}, {len(rs)} rings)")
    if not parts:
        return None
    return ("torch rows within each ring (the ratio of a ring's cudapool process to its native one, which took turns "
            "with it rep by rep; median (min-max) over the rings; the targets' measure is the table's ratio of the "
            "medians, or for the capture rows the paired in-process one): " + "; ".join(parts))


def turns_note(res):
    """The torch rows measured by pairs of processes taking turns on one CPU
    (bench/turn_pair.sh), or None: per kind of pair, each metric's median
    (min-max) over the pairs of the pair's median per-rep ratio."""
    per, bad = turns.figures(res.turns)
    if not per and not bad:
        return None
    targets = {m.key: m.target for m in METRICS + [FSDP] if m.kind == "torch"}
    parts = []
    for kind in sorted({k for k, _ in per}, key=lambda k: (k != "native/cudapool", k)):
        items = []
        for label, _, key in turns.METRICS:
            v = per.get((kind, label))
            if not v:
                continue
            # Every row of native against cudapool has its target, except
            # those judged by their paired in-process measure (the capture
            # rows: the alt note gives their verdict).
            vs_native = kind.endswith("native/cudapool")
            t = targets.get(key) if vs_native and key not in PAIRED_KEYS else None
            verdict = f"; target <= {t:g}x: {target_verdict(statistics.median(v), t)}" if t else ""
            items.append(f"{label} {median_range(v)}{verdict}")
        n = max(len(v) for (k, _), v in per.items() if k == kind)
        parts.append(f"{kind} ({n} pair{'s' if n != 1 else ''}): " + ", ".join(items))
    if bad:
        parts.append("not paired: " + "; ".join(f"{k} {r}: {why}" for k, r, why in bad))
    return ("torch level with two processes on one CPU taking turns, handing it over after every timed "
            "rep, so that rep k of both runs back to back, to meet the host in one state (bench/turn_pair.sh; "
            "a pair of cudapool against itself checks that it does; per pair the median of the per-rep ratios, then their median "
            "(min-max) over the pairs, test/base): " + "; ".join(parts))


# The keys of the rows judged by their paired in-process measure.
PAIRED_KEYS = {m.key for m in METRICS if m.paired and isinstance(m.key, str)}


def alt_row(res, m, note):
    """The row of an AltMetric: native's and cudapool's cells from the
    processes of its section, "-" for the other configurations."""
    cells, vals = {}, {}
    for cfg in CONFIGS:
        if cfg in m.side_keys:
            vals[cfg], cells[cfg] = m.side_cell(res, cfg)
            if cells[cfg] is None:
                cells[cfg] = f"n/a [{note(res.reason(m, cfg))}]"
        else:
            cells[cfg] = "-"
    nat, cp = vals["native"], vals["cudapool"]
    ratio_text = f"{cp / nat:.3f}x" if nat and cp is not None else "n/a"
    per = paired_values(res, m.paired)
    met = paired_verdict(per, m.target) if per else "n/a"
    return (m, cells, ratio_text, m.target_text(), met)


def build_rows(res):
    """[(metric, cells{config: text}, ratio_text, target_text, met_text)], notes."""
    rows, notes = [], []

    def note(text):
        if text not in notes:
            notes.append(text)
        return notes.index(text) + 1

    for m in METRICS:
        if isinstance(m, AltMetric):
            rows.append(alt_row(res, m, note))
            continue
        cells, vals = {}, {}
        for cfg in CONFIGS:
            rec = res.record(m.kind, cfg)
            v = m.value(rec)
            vals[cfg] = v
            if v is None:
                cells[cfg] = f"n/a [{note(res.reason(m, cfg))}]"
            else:
                cells[cfg] = m.cell(rec)
        if m.key == "graph_pool_bytes" and vals["async"] is not None:
            src = (res.record("torch", "async") or {}).get("graph_pool_source")
            if src == "mem_get_info":
                cells["async"] += f" [{note('cudaMallocAsync: graph pool measured as the drop in free device memory (mem_get_info), its reserved statistic does not include graph memory')}]"
        nat, cp = vals["native"], vals["cudapool"]
        ratio = cp / nat if nat not in (None, 0) and cp is not None else None
        ratio_text = f"{ratio:.3f}x" if ratio is not None else "n/a"
        if m.target is None or m.better is None:
            met = "-"
        elif m.paired:
            per = paired_values(res, m.paired)
            met = paired_verdict(per, m.target) if per else "n/a (no paired measure)"
        elif ratio is None:
            met = "n/a"
        else:
            ok = ratio <= m.target + 1e-12 if m.better == "lower" else ratio >= m.target - 1e-12
            met = "yes" if ok else "NO"
        rows.append((m, cells, ratio_text, m.target_text() if m.better else "-", met))
    runs = {}
    for kind in ("c", "torch"):
        counts = sorted({len(v) for c in CONFIGS for k, v in ((res.record(kind, c) or {}).get("_samples") or {}).items()
                         if k != "train_ms_per_step" and not k.startswith(("fsdp_", "trace_series"))})
        # training and FSDP2 runs are counted in their own notes; a trace series may be kept for one run only
        if counts and counts[-1] > 1:
            runs[kind] = "-".join(str(n) for n in (counts[0], counts[-1]) if n) if counts[0] != counts[-1] else str(counts[0])
    ringed = ring_runs(res)
    if runs:
        how = {k: f"{'C' if k == 'c' else 'torch'} level: {n} runs" for k, n in runs.items()}
        if "torch" in how and ringed:
            how["torch"] += (f" ({ringed} of them rings: one process per configuration, all taking turns rep by "
                             "rep on one CPU, bench/turn_ring.py, so that rep k of every configuration meets the "
                             "host in the same state)")
        note("a value with a range is the median (min-max) of the runs of its configuration, each in a fresh "
             "process, the configurations interleaved (" + ", ".join(how.values()) +
             "); ratios are of the medians, and a target is met only when the medians meet it, except for the "
             "rows whose target says \"paired\": those are judged by their paired in-process measure (the alt "
             "notes), the ratio of medians shown beside")
    spans = []
    for m in METRICS:
        if m.target is None or m.better is None:
            continue
        iv = ratio_interval(samples(res.record(m.kind, "native"), m.key), samples(res.record(m.kind, "cudapool"), m.key))
        if iv:
            spans.append(f"{m.label} {iv[0]:.2f}-{iv[1]:.2f}x")
    if spans:
        note("how far the runs resolve each targeted ratio, cudapool/native: 95% percentile bootstrap interval "
             "(each configuration's runs resampled, 4,000 times): " + "; ".join(spans))
    paired = pair_note(res)
    if paired:
        note(paired)
    an = alt_note(res)
    if an:
        note(an)
    cn = altcompile_note(res)
    if cn:
        note(cn)
    rn = ring_note(res)
    if rn:
        note(rn)
    tn = turns_note(res)
    if tn:
        note(tn)
    train = {c: (res.record("torch", c) or {}).get("_train_samples") for c in CONFIGS}
    if any(train.values()):
        note("training ms/step: median of " + ", ".join(
            f"{LABELS[c]} {len(v)}" for c, v in train.items() if v) + " runs, each in a fresh process, interleaved"
            + (f" ({ringed} in rings taking turns)" if ringed else ""))
    # FSDP2 on 2 GPUs (bench/fsdp2_bench.py): a note rather than a row, so
    # that a results table without it (one GPU) keeps its rows.
    fsdp = {c: FSDP.cell(res.record("torch", c)) for c in ("native", "cudapool")
            if FSDP.value(res.record("torch", c)) is not None}
    if fsdp:
        dev = next((r.get("fsdp_device") for r in (res.record("torch", c) for c in ("native", "cudapool"))
                    if r and r.get("fsdp_device")), None)
        where = f" on 2x {dev}" if dev else ""
        launches = sorted({len(samples(res.record("torch", c), FSDP.key)) for c in fsdp})
        each = f", {'-'.join(str(n) for n in launches)} launches each" if launches and launches[-1] > 1 else ""
        text = (f"FSDP2, 2 GPUs{where}, GPT-2 training step (CUDA-event timed, ranks pinned{each}), ms/step: "
                + ", ".join(f"{LABELS[c]} {v}" for c, v in fsdp.items()))
        nat, cp = (FSDP.value(res.record("torch", c)) for c in ("native", "cudapool"))
        if nat and cp:
            r = cp / nat
            per = fsdp_pairs(res)
            if per:
                # The launches taking turns judge the row (the turns note).
                med = statistics.median(per)
                text += (f"; cudapool/native {r:.3f}x (ratio of medians; the target, <= 1x, is judged by the "
                         f"{len(per)} turn pair{'s' if len(per) != 1 else ''}: {med:.3f}x, "
                         f"{target_verdict(med, FSDP.target)})")
            else:
                text += f"; cudapool/native {r:.3f}x (target <= 1x: {target_verdict(r, FSDP.target)})"
            # Resolved to 5%: the ratio's bootstrap interval no wider than
            # 0.95-1.05 around it.
            iv = ratio_interval(samples(res.record("torch", "native"), FSDP.key),
                                samples(res.record("torch", "cudapool"), FSDP.key))
            if iv:
                width = iv[1] / iv[0] - 1
                text += (f"; 95% bootstrap interval {iv[0]:.3f}-{iv[1]:.3f}x, {100 * width:.0f}% wide: "
                         + ("resolved to 5%" if width <= 0.10 + 1e-12 else "not resolved to 5%"))
        note(text)
    floor = (res.record("torch", "floor") or {}).get("empty_small_us")
    if floor is not None:
        nat = (res.record("torch", "native") or {}).get("empty_small_us")
        cp = (res.record("torch", "cudapool") or {}).get("empty_small_us")
        text = (f"floor: torch.empty + free, 4 KiB, through CUDAPluggableAllocator with a trivial C allocator "
                f"behind it (bench/floor_alloc.c): {floor:.2f} us/pair")
        if nat:
            text += f" = {floor / nat:.3f}x native"
        if cp and cp >= floor:
            text += f"; cudapool adds {1e3 * (cp - floor):.0f} ns to that floor"
        elif cp:
            # A floor above cudapool means the floor's runs met the host in a
            # slower state than cudapool's (docs/benchmarks.md, "The host").
            text += (f"; cudapool's median is {1e3 * (floor - cp):,.0f} ns below the floor's: the floor's runs met "
                     f"the host in a slower state, so this run cannot split cudapool's cost from the floor's")
        note(text)
    # Expandable segments: cudapool's against PyTorch's own (the targets:
    # reserved/allocated at or below native expandable, step time within 2%
    # of native).
    ce, ne = res.record("torch", "cudapool_exp") or {}, res.record("torch", "expandable") or {}
    nat = res.record("torch", "native") or {}
    frag = _ratio("train_peak_reserved", "train_peak_allocated")
    parts = []
    if frag(ce) is not None and frag(ne) is not None:
        parts.append(f"training reserved/allocated {frag(ce):.3f} vs native expandable {frag(ne):.3f}"
                     f" ({target_verdict(frag(ce), frag(ne))})")
    step, nstep = ce.get("train_ms_per_step"), nat.get("train_ms_per_step")
    if isinstance(step, (int, float)) and isinstance(nstep, (int, float)) and step > 0 and nstep > 0:
        parts.append(f"step time {step / nstep:.3f}x native (target <= 1.02x: {target_verdict(step / nstep, 1.02)})")
    cap, ncap = ce.get("graph_capture_ms"), ne.get("graph_capture_ms")
    per = paired_values(res, EXP_CAPTURE_PAIRED)
    if isinstance(cap, (int, float)) and isinstance(ncap, (int, float)) and cap > 0 and ncap > 0 or per:
        text = "graph capture"
        if isinstance(cap, (int, float)) and isinstance(ncap, (int, float)) and cap > 0 and ncap > 0:
            text += f" {cap:.1f} ms vs native expandable {ncap:.1f} ms = {cap / ncap:.3f}x (ratio of medians)"
        verdict = (paired_verdict(per, EXP_CAPTURE_TARGET) if per else
                   "n/a (no paired measure: torch_bench.py cudapool_exp --sections alt)")
        text += f"; target <= {EXP_CAPTURE_TARGET:g}x by the paired in-process measure: {verdict}"
        parts.append(text)
    if parts:
        note("cudapool expandable: " + "; ".join(parts))
    return rows, notes


HEADERS = ["metric", "unit"] + [LABELS[c] for c in CONFIGS] + ["cudapool/native", "target", "met?"]


def _cells(row):
    m, cells, ratio, target, met = row
    return [m.label, m.unit] + [cells[c] for c in CONFIGS] + [ratio, target, met]


def text_table(rows, notes):
    data = [HEADERS] + [_cells(r) for r in rows]
    widths = [max(len(r[i]) for r in data) for i in range(len(HEADERS))]
    out = []
    for n, r in enumerate(data):
        parts = []
        for i, c in enumerate(r):
            parts.append(c.ljust(widths[i]) if i < 2 else c.rjust(widths[i]))
        out.append("  ".join(parts).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    for i, t in enumerate(notes, 1):
        out.append(f"[{i}] {t}")
    return "\n".join(out)


def _md_escape(s):
    return s.replace("|", "\\|")


def md_table(rows, notes):
    out = ["| " + " | ".join(HEADERS) + " |",
           "|" + "|".join(["---", "---"] + ["---:"] * (len(HEADERS) - 2)) + "|"]
    for r in rows:
        out.append("| " + " | ".join(_md_escape(c) for c in _cells(r)) + " |")
    if notes:
        out.append("")
        for i, t in enumerate(notes, 1):
            out.append(f"[{i}] {_md_escape(t)}  ")
    return "\n".join(out)


# ---------------------------------------------------------------------------
# Header and methodology


def machine_lines(res):
    meta = dict(res.meta)
    torch_meta = {}
    for cfg in CONFIGS:
        rec = res.record("torch", cfg) or {}
        for k in ("torch_version", "torch_cuda", "device_name"):
            if rec.get(k) and k not in torch_meta:
                torch_meta[k] = rec[k]
    date = meta.get("date_utc") or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    gpu = meta.get("gpu") or torch_meta.get("device_name") or "unknown GPU"
    if meta.get("gpu_memory"):
        gpu += f" ({meta['gpu_memory']})"
    torch_v = meta.get("torch_version") or torch_meta.get("torch_version") or "unknown"
    cuda_v = meta.get("torch_cuda") or torch_meta.get("torch_cuda")
    lines = [
        f"- date: {date}",
        f"- GPU: {gpu}" + (f", driver {meta['driver']}" if meta.get("driver") else ""),
        f"- PyTorch {torch_v}" + (f" (CUDA {cuda_v})" if cuda_v else ""),
    ]
    if meta.get("git_commit"):
        lines.append(f"- cudapool: commit {meta['git_commit']}" + (" (with local changes)" if meta.get("git_dirty") else "")
                     + (f"; Go runtime: {meta['go_runtime']}" if meta.get("go_runtime") else ""))
    if meta.get("host_cpu"):
        lines.append(f"- CPU: {meta['host_cpu']}")
    backends = []
    for cfg in CONFIGS:
        rec = res.record("c", cfg) or {}
        trec = res.record("torch", cfg) or {}
        b = rec.get("backend") or trec.get("allocator_backend")
        if b:
            backends.append(f"{LABELS[cfg]}: {b}")
    if backends:
        lines.append("- allocator backends reported: " + "; ".join(backends))
    exp = res.record("c", "expandable") or {}
    if isinstance(exp.get("trace_segments_now"), int) and isinstance(exp.get("trace_expandable_segments_now"), int):
        lines.append(f"- expandable_segments check (C, after the trace): {exp['trace_expandable_segments_now']} of "
                     f"{exp['trace_segments_now']} segments are expandable")
    return lines


def params_line(res):
    c = res.record("c", "native") or res.record("c", "cudapool") or {}
    t = res.record("torch", "native") or res.record("torch", "cudapool") or {}
    parts = []
    if c.get("hot_pairs"):
        parts.append(f"C hot: {c['hot_pairs']:,} pairs x {c.get('reps', '?')} reps (median)")
    if c.get("mixed_pairs"):
        parts.append(f"C mixed: {c['mixed_pairs']:,} pairs x {c.get('reps', '?')} reps after one 65,536-pair warm-up cycle")
    if c.get("thread_secs"):
        parts.append(f"threads: {c['thread_secs']} s x {c.get('thread_reps', '?')} reps")
    if t.get("train_steps"):
        every = " (one at every timed sequence length)" if t.get("train_warmup_every_len") else ""
        parts.append(f"training: {t.get('train_warmup_steps', '?')} warm-up{every} + {t['train_steps']} timed steps, batch {t.get('train_batch', '?')}")
    if t.get("graph_seq"):
        caps = t.get("graph_captures")
        parts.append(f"graph: batch {t.get('graph_batch', '?')} x seq {t['graph_seq']}, "
                     + (f"capture time the median of {caps} captures per process (each into a new pool), " if caps else "")
                     + f"{t.get('graph_replays', '?')} replays")
    if c.get("trace_ops"):
        parts.append(f"trace: {c['trace_ops']:,} ops x {c.get('trace_repeats', '?')} passes")
    return "; ".join(parts)


METHOD = """\
How: `bench/run_bench.sh` runs every configuration several times (3 by default; training 5, FSDP2 5), each
in a fresh process, the configurations interleaved, with the same inputs; a cell with a range is the median
(min-max) of those runs, and ratios and targets use the medians, except where a target says "paired": the
capture rows and the torch.compile rows are judged by their paired measure in one process, FSDP2 by its
launches taking turns (notes).
C level: `bench/workloads.h` holds the workloads, compiled into `bench/c_bench.c` (cudapool's C ABI) and
`bench/native_bench.cpp` (PyTorch's `c10::cuda::CUDACachingAllocator::raw_alloc_with_stream`/`raw_delete`,
allocator chosen by `PYTORCH_CUDA_ALLOC_CONF`). torch level: `bench/torch_bench.py` (GPT-2 small from
`bench/model.py`, bf16 autocast, AdamW, variable sequence lengths; `torch.cuda.graph` of its forward).
Trace: `demo/trace.txt` (3 recorded GPT-2 training steps) replayed through each allocator.
Paired figures (notes): the host runs each process fast or up to 1.9x slower, so a ratio of per-process medians
moves between runs; `bench/pair_bench.c` alternates the two allocators' C reps in one process, and
`bench/turn_pair.sh` has two torch processes (or two FSDP2 launches) take turns on one CPU, rep by rep.
Where the notes say so, the torch rows' runs take turns that way too: each run is a ring of one fresh process
per configuration (`bench/turn_ring.py`).
Ratios are cudapool / native (same run); for M pairs/s higher is better, elsewhere lower is better."""


def render_markdown(res, rows, notes, title=True):
    out = []
    if title:
        out += ["# cudapool benchmark results", ""]
    out.append("Generated by `bench/run_bench.sh` (`bench/report.py`); do not edit by hand.")
    out.append("")
    out += machine_lines(res)
    out.append("")
    out.append(md_table(rows, notes))
    out.append("")
    out.append(METHOD)
    p = params_line(res)
    if p:
        out += ["", f"Sizes: {p}."]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------
# The README's section: a speed table and a memory table of the same run,
# compact; bench/RESULTS.md (render_markdown) has every row and note.

README_SPEED = [
    "C: malloc+free, 4 KiB hot loop",
    "C: malloc+free, mixed 512 B-144 MiB, 256 live",
    "C: 8 threads, own streams, 4 KiB pairs",
    "torch.empty + free, 4 KiB",
    "torch.empty + free, mixed sizes",
    "GPT-2 training step, variable seq len",
    "CUDA graph capture (forward)",
    EXP_CAPTURE_LABEL,
    "CUDA graph replay",
    "graph-tree decoding, static KV cache (reduce-overhead)",
    "compiled model call (reduce-overhead)",
]
# The README rows of part traces (left out when it did not run).
TRACE_README_LABELS = [f"{name}: reserved / allocated" for name in TRACES.values()]
# (metric label, the row's name in the README)
README_MEMORY = [
    ("training reserved / allocated", "GPT-2 training: peak reserved / peak allocated"),
    ("trace replay: reserved / allocated", "trace replay (C): peak reserved / peak allocated"),
] + [(label, f"{label.split(':')[0]} (C trace): peak reserved / peak allocated")
     for label in TRACE_README_LABELS] + [
    ("CUDA graph private pool", "CUDA graph private pool, MiB"),
]
# How each paired figure was taken, for the line under the speed table.
PAIRED_HOW = {
    "pair": "C rows: both allocators in one process, reps alternated (bench/pair_bench.c)",
    "alt": "torch.empty, graph capture and the reduce-overhead rows: PyTorch's allocator and cudapool "
           "alternating in one process (torch_bench.py, sections alt and altcompile)",
    "ring": "training step: fresh processes taking turns rep by rep on one CPU (bench/turn_ring.py)",
    "turn": "FSDP2: two launches taking turns step by step on the same GPUs and CPUs (bench/turn_pair.sh)",
}


def paired_ratios(res):
    """{metric label: (how, [per-process or per-ring ratios cudapool/native])}
    of the paired measures in res: pair_bench.c's processes, torch_bench.py's
    alt processes and the rings' training step."""
    out = {}
    for sec, label in (("hot", README_SPEED[0]), ("mixed", README_SPEED[1])):
        per = [float(x["ratio"]) for x in res.pairs.get(sec) or []]
        if per:
            out[label] = ("pair", per)
    for cfg, key, label in (("cudapool", "alt_small_ratio", "torch.empty + free, 4 KiB"),
                            ("cudapool", "alt_mixed_ratio", "torch.empty + free, mixed sizes"),
                            ("cudapool", "alt_capture_ratio", "CUDA graph capture (forward)"),
                            (*EXP_CAPTURE_PAIRED, EXP_CAPTURE_LABEL),
                            ("cudapool", "alt_decode_ratio", "graph-tree decoding, static KV cache (reduce-overhead)"),
                            ("cudapool", "alt_compiled_ratio", "compiled model call (reduce-overhead)")):
        per = paired_values(res, (cfg, key))
        if per:
            out[label] = ("alt", per)
    rings = sorted({r for (c, r), v in res.by_run.items() if c == "native" and "turns" in v})
    per = []
    for r in rings:
        b, t = res.by_run.get(("native", r), {}), res.by_run.get(("cudapool", r), {})
        if "turns" in t and b.get("train_ms_per_step", 0) > 0 and t.get("train_ms_per_step", 0) > 0:
            per.append(t["train_ms_per_step"] / b["train_ms_per_step"])
    if per:
        out["GPT-2 training step, variable seq len"] = ("ring", per)
    return out


def _runs_line(res):
    """"N fresh processes per allocator" (the C and torch levels' counts)."""
    counts = sorted({len(v) for kind in ("c", "torch") for c in CONFIGS
                     for k, v in ((res.record(kind, c) or {}).get("_samples") or {}).items()
                     if not k.startswith(("fsdp_", "trace_series"))})
    if not counts:
        return ""
    n = str(counts[-1]) if counts[0] == counts[-1] else f"{counts[0]}-{counts[-1]}"
    return f"; the median (min-max) of {n} fresh processes per allocator"


def render_readme(res, rows):
    """The README's performance section: one line on the machine, a speed
    table (native and cudapool, the ratio of the medians and the paired
    ratio) and a memory table (every configuration)."""
    by_label = {r[0].label: r for r in rows}
    meta = dict(res.meta)
    torch_meta = {}
    for cfg in CONFIGS:
        rec = res.record("torch", cfg) or {}
        for k in ("torch_version", "torch_cuda", "device_name"):
            torch_meta.setdefault(k, rec.get(k))
    gpu = meta.get("gpu") or torch_meta.get("device_name") or "unknown GPU"
    if meta.get("driver"):
        gpu += f" (driver {meta['driver']})"
    torch_v = meta.get("torch_version") or torch_meta.get("torch_version") or "unknown"
    cuda_v = meta.get("torch_cuda") or torch_meta.get("torch_cuda")
    where = f"{gpu}, PyTorch {torch_v}" + (f" (CUDA {cuda_v})" if cuda_v else "")
    if meta.get("git_commit"):
        where += f", cudapool commit {meta['git_commit']}" + (" with local changes" if meta.get("git_dirty") else "")
    if meta.get("go_runtime"):
        where += f" (Go runtime: {meta['go_runtime']})"
    if meta.get("date_utc"):
        where += f", {meta['date_utc']}"
    out = [f"Generated by `bench/report.py` from a `bench/run_bench.sh` run; do not edit by hand. {where}"
           f"{_runs_line(res)}. Every row and note: [bench/RESULTS.md](bench/RESULTS.md); how to rerun and what "
           "the measures mean: [docs/benchmarks.md](docs/benchmarks.md).", ""]
    paired = paired_ratios(res)
    out += ["| operation | unit | native | cudapool | cudapool / native | paired |",
            "|---|---|---:|---:|---:|---:|"]
    used = []
    judged = []
    for label in README_SPEED:
        r = by_label.get(label)
        if label == EXP_CAPTURE_LABEL:
            r = _exp_capture_row(res, by_label.get("CUDA graph capture (forward)"))
        if r is None:
            continue
        m, cells, ratio, _, _ = r
        p = paired.get(label)
        target = EXP_CAPTURE_TARGET if label == EXP_CAPTURE_LABEL else m.target
        pc = "-"
        if p:
            how, per = p
            pc = median_range(per)
            if how not in used:
                used.append(how)
        if isinstance(m, AltMetric) and not p and ratio == "n/a":
            continue  # not measured in this run: RESULTS.md says why
        if m.paired and target is not None:
            # Judged by the paired measure: its verdict in its cell.
            pc = (f"{pc}, target <= {target:g}x: {target_verdict(statistics.median(p[1]), target)}"
                  if p else f"n/a (target <= {target:g}x paired)")
            judged.append(label)
        native, cudapool = cells["native"], cells["cudapool"]
        if isinstance(m, AltMetric):  # no fresh-process runs: the in-process sides
            native, cudapool = (re.sub(r" \[\d+\]", "", c) for c in (native, cudapool))
        out.append(f"| {_md_escape(label)} | {m.unit} | {_md_escape(native)} | "
                   f"{_md_escape(cudapool)} | {ratio} | {pc} |")
    fsdp, fsdp_pairs = _fsdp_readme_row(res)
    if fsdp:
        out.append(fsdp)
        if fsdp_pairs:
            used.append("turn")
        judged.append(FSDP.label)
    out.append("")
    line = ("Lower is better except for M pairs/s. The host runs a process fast or up to 1.9x slower at random, "
            "so the ratio of medians moves from run to run; the paired ratio, cudapool's reps against native's "
            "in the same state of the host, is the steadier measure.")
    if judged:
        compiled = any("reduce-overhead" in j for j in judged)
        groups = [g for g, on in (("the capture rows", any("capture" in j for j in judged)),
                                  ("the reduce-overhead rows", compiled),
                                  ("FSDP2's", FSDP.label in judged)) if on]
        text = ", ".join(groups[:-1]) + (" and " if len(groups) > 1 else "") + groups[-1]
        line += (" " + text[0].upper() + text[1:]
                 + " are judged by it (the target in their paired cell)"
                 + ("; the reduce-overhead rows are measured only that way (their cells: each side's reps in "
                    "those processes)" if compiled else "")
                 + (". The expandable row compares native expandable with cudapool expandable."
                    if EXP_CAPTURE_LABEL in judged else "."))
    if used:
        how = [PAIRED_HOW[h] for h in used]
        if not any("reduce-overhead" in j for j in judged):  # those rows are not in this table
            how = [h.replace("graph capture and the reduce-overhead rows", "graph capture") for h in how]
        line += (" Paired: " + "; ".join(how) + "; each the median (min-max) over the processes"
                 + (", rings or pairs." if "turn" in used else " or rings."))
    out += [line, ""]
    out += ["| memory | " + " | ".join(LABELS[c] for c in CONFIGS) + " |",
            "|---|" + "---:|" * len(CONFIGS)]
    for label, name in README_MEMORY:
        r = by_label.get(label)
        if r is None:
            continue
        cells = r[1]
        if _trace_row_absent(res, label, r[0]):
            continue  # part traces did not run: RESULTS.md says why
        out.append(f"| {name} | " + " | ".join(_md_escape(re.sub(r" \[\d+\]", "", cells[c])) for c in CONFIGS)
                   + " |")
    margin = memory_margin(res, by_label)
    if margin:
        out += ["", margin]
    return "\n".join(out) + "\n"


def fsdp_pairs(res):
    """FSDP2's per-pair ratios cudapool / native (bench/turn_pair.sh), in
    round order: the measure that judges its row."""
    return turns.figures(res.turns)[0].get(("fsdp-native/cudapool", "FSDP2 step")) or []


def _fsdp_readme_row(res):
    """The README's FSDP2 row (two GPUs) and whether turn pairs judged it,
    or (None, False) where part fsdp did not run for both sides: each
    side's separate launches, their ratio, and the judge, the launches
    taking turns (bench/turn_pair.sh), with its verdict."""
    recs = {c: res.record("torch", c) for c in ("native", "cudapool")}
    if any(FSDP.value(r) is None for r in recs.values()):
        return None, False
    nat, cp = (FSDP.value(recs[c]) for c in ("native", "cudapool"))
    per = fsdp_pairs(res)
    if per:
        pc = (f"{median_range(per)}, {len(per)} pair{'s' if len(per) != 1 else ''}, target <= {FSDP.target:g}x: "
              + target_verdict(statistics.median(per), FSDP.target))
    else:
        pc = f"n/a (target <= {FSDP.target:g}x paired)"
    return (f"| FSDP2, 2 GPUs: GPT-2 training step | {FSDP.unit} | {_md_escape(FSDP.cell(recs['native']))} | "
            f"{_md_escape(FSDP.cell(recs['cudapool']))} | {cp / nat:.3f}x | {pc} |"), bool(per)


def _trace_row_absent(res, label, metric):
    """Whether label is a README row of part traces with no value at all
    (the part did not run): the README leaves such a row out."""
    return label in TRACE_README_LABELS and all(metric.value(res.record(metric.kind, c)) is None for c in CONFIGS)


# PyTorch's own allocators, the ones the memory margin is taken against.
NATIVE_CONFIGS = ("native", "expandable", "async")


def memory_margin(res, by_label):
    """The line under the README's memory table: by how much less cudapool's
    defaults reserve than the best of PyTorch's allocators, row by row (for
    a reserved / allocated row, the same allocations: 1 - cudapool / best),
    the smallest and largest of those margins, the rows where cudapool is
    not below them all, and the rows shown without every value. "" when no
    row could be compared."""
    margins, behind, missing, shown = [], [], [], 0
    for label, name in README_MEMORY:
        r = by_label.get(label)
        if r is None:
            continue
        m = r[0]
        if _trace_row_absent(res, label, m):
            continue  # not shown (render_readme)
        shown += 1
        ours = m.value(res.record(m.kind, "cudapool"))
        theirs = [(m.value(res.record(m.kind, c)), c) for c in NATIVE_CONFIGS]
        lacking = [LABELS[c] for v, c in theirs if v is None or v <= 0] + ([] if ours is not None else ["cudapool"])
        if lacking:
            missing.append(f"{name} (no value for {', '.join(lacking)})")
            continue
        best, cfg = min(theirs, key=lambda t: t[0])  # a tie names the first in NATIVE_CONFIGS
        if ours < best:
            margins.append((1 - ours / best, name))
        else:
            behind.append(f"{name} ({m.fmt(ours)} against {LABELS[cfg]}'s {m.fmt(best)})")
    if not margins and not behind:
        return ""
    line = ""
    if margins:
        lo, hi = min(margins), max(margins)
        rows = "every memory row" if len(margins) == shown else f"{len(margins)} of {shown} memory rows"
        line = (f"cudapool's defaults reserve less than every PyTorch allocator on {rows}: "
                + (f"{lo[0]:.1%} less than the best of them" if lo == hi else
                   f"from {lo[0]:.1%} ({lo[1]}) to {hi[0]:.1%} ({hi[1]}) less than the best of them")
                + ".")
    if behind:
        line += (" " if line else "") + "Not below them all: " + "; ".join(behind) + "."
    if missing:
        line += " Not compared: " + "; ".join(missing) + "."
    return line


def _exp_capture_row(res, capture):
    """The README's expandable capture row, from the capture row: native
    expandable and cudapool expandable under native and cudapool, and the
    ratio of their medians."""
    if capture is None:
        return None
    m, cells, _, _, _ = capture
    ne, ce = (m.value(res.record("torch", c)) for c in ("expandable", "cudapool_exp"))
    ratio = f"{ce / ne:.3f}x" if ne and ce is not None else "n/a"
    return (m, {"native": cells["expandable"], "cudapool": cells["cudapool_exp"]}, ratio, None, None)


def update_readme(path, section_md):
    """Replaces the text between the markers. Returns a message."""
    if not path:
        return "README: not requested"
    if not os.path.isfile(path):
        return f"README: {path} does not exist; performance section not updated"
    with open(path, encoding="utf-8") as f:
        text = f.read()
    i = text.find(START)
    j = text.find(END, i + len(START)) if i >= 0 else -1
    if i < 0 or j < 0:
        return f"README: {path} has no {START} ... {END} markers; performance section not updated"
    new = text[: i + len(START)] + "\n" + section_md.rstrip("\n") + "\n" + text[j:]
    if new != text:
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
        return f"README: performance section of {path} updated"
    return f"README: performance section of {path} already up to date"


def main(argv=None):
    p = argparse.ArgumentParser(description="cudapool benchmark report")
    p.add_argument("--results", required=True, help="directory with the JSON result files")
    p.add_argument("--md", default=None, help="write the markdown results here (e.g. bench/RESULTS.md)")
    p.add_argument("--readme", default=None, help="README whose perf section to replace")
    p.add_argument("--charts", default=None, help="write bench/charts.py's SVG charts here (default: docs/charts "
                   "beside --readme; needs matplotlib)")
    args = p.parse_args(argv)

    res = load(args.results)
    rows, notes = build_rows(res)
    msgs = []
    if not res.files:
        msgs.append(f"no result files under {args.results}")
    if res.bad_lines:
        msgs.append(f"{res.bad_lines} result line(s) could not be read")
    if args.md:
        try:
            d = os.path.dirname(args.md)
            if d:
                os.makedirs(d, exist_ok=True)
            with open(args.md, "w", encoding="utf-8") as f:
                f.write(render_markdown(res, rows, notes, title=True))
            msgs.append(f"wrote {args.md}")
        except OSError as e:
            msgs.append(f"could not write {args.md}: {e}")
    if args.readme:
        try:
            msgs.append(update_readme(args.readme, render_readme(res, rows)))
        except OSError as e:
            msgs.append(f"README: {e}")
    charts_dir = args.charts or (args.readme and os.path.join(os.path.dirname(os.path.abspath(args.readme)), "docs",
                                                              "charts"))
    if charts_dir:
        import charts  # bench/charts.py; writes nothing, and says why, without matplotlib

        msgs.append(charts.draw_results(res, charts_dir))
    for m in msgs:
        print(m)
    print()
    for line in machine_lines(res):
        print(line)
    print()
    print(text_table(rows, notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
