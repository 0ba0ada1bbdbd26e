#!/usr/bin/env python3
"""Paired ratios of two torch_bench.py processes that took turns on one CPU.

    python3 bench/turns.py LIST

LIST has one line per pair of processes: "KIND ROUND BASE.jsonl TEST.jsonl"
(the JSON lines of torch_bench.py run with BENCH_TURNS; BASE is the
reference, e.g. native, TEST e.g. cudapool). With turns, rep k of the two
processes ran back to back, so TEST_k / BASE_k compares them in one state of
the host; a pair's figure is the median of those per-rep ratios (as
bench/pair_bench.c does for the C loops). Prints every pair, then per KIND
and metric the median (min-max) over rounds and the spread (standard
deviation of the log of the per-pair figures): where a KIND of equals
(e.g. cudapool against cudapool) has a small spread, the pairing works.
"""
import json
import math
import statistics
import sys

# label, the JSON field holding the per-rep values (a list)
METRICS = (
    ("training step", "train_block_ms_per_step"),
    ("capture", "graph_capture_reps_ms"),
    ("torch.empty 4 KiB", "empty_small_reps_us"),
    ("torch.empty mixed", "empty_mixed_reps_us"),
)


def load(path):
    """The fields of every record of a torch_bench.py output file, merged."""
    out = {}
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line.startswith("{"):
                    try:
                        out.update(json.loads(line))
                    except ValueError:
                        pass
    except OSError:
        pass
    return out


def paired(base, test):
    """{label: (median of test_k/base_k, base median, test median, n)} for
    the metrics both processes measured, over the same number of reps."""
    res = {}
    for label, key in METRICS:
        a, b = base.get(key), test.get(key)
        if not isinstance(a, list) or not isinstance(b, list) or len(a) != len(b) or not a:
            continue
        if any(x <= 0 for x in a + b):
            continue
        ratios = [y / x for x, y in zip(a, b)]
        res[label] = (statistics.median(ratios), statistics.median(a), statistics.median(b), len(a))
    return res


def broken(base, test):
    """Why two processes' turns cannot be trusted ("" if they can). The
    partner of the one that finishes last has always ended; a pair is
    sound when neither waited in vain and both took the same turns."""
    for name, rec in (("base", base), ("test", test)):
        if "turns" not in rec:
            return f"{name}: no turns (BENCH_TURNS unset, or the process did not finish)"
        gone = rec.get("turns_partner_gone", "")
        if gone not in ("", "ended"):
            return f"{name}: partner gave {gone}"
    if base["turns"] != test["turns"]:
        return f"turns differ: {base['turns']} and {test['turns']}"
    return ""


def summarize(rows):
    """rows: [(kind, round, base_rec, test_rec)]. Returns the report's lines."""
    lines = ["==== per pair: kind round metric ratio (base median, test median, reps) ===="]
    per = {}
    for kind, rnd, base, test in rows:
        why = broken(base, test)
        if why:
            lines.append(f"{kind} {rnd} not paired: {why}")
            continue
        for label, (r, a, b, n) in paired(base, test).items():
            lines.append(f"{kind} {rnd} {label}: {r:.3f} ({a:.4g}, {b:.4g}, {n})")
            per.setdefault((kind, label), []).append(r)
    lines.append("==== per kind and metric: median (min-max) of the pairs, spread = stdev of log ====")
    for (kind, label), v in per.items():
        sd = statistics.stdev(math.log(x) for x in v) if len(v) > 1 else float("nan")
        lines.append(f"{kind:24} {label:18} n={len(v)} {statistics.median(v):.3f} "
                     f"({min(v):.3f}-{max(v):.3f}) spread {sd:.3f}")
    return lines


def main(argv):
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    rows = []
    with open(argv[1]) as f:
        for line in f:
            p = line.split()
            if len(p) == 4:
                rows.append((p[0], p[1], load(p[2]), load(p[3])))
    print("\n".join(summarize(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
