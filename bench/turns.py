#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Paired ratios of torch_bench.py processes that took turns on one CPU.

    python3 bench/turns.py FILE...

FILEs hold the JSON lines of pairs started by bench/turn_pair.sh
("kind":"torch_turns", tagged with the pair's kind, round and role: base,
the reference such as native, or test, such as cudapool). Within a pair,
rep k of the two processes ran back to back, so test_k / base_k compares
them in one state of the host; a pair's figure is the median of those
per-rep ratios (as bench/pair_bench.c does for the C loops). Prints every
pair, then per kind and metric the median (min-max) over the pairs and the
spread (standard deviation of the log of the pairs' figures): where a kind
of equals (cudapool against cudapool) has a small spread, the pairing
works. bench/report.py prints the same figures as a note.
"""
import json
import math
import statistics
import sys

from torch_bench import COUNTED  # (imports no torch at module level)

# label, the JSON field holding the per-rep values (a list), the report's key
METRICS = (
    ("training step", "train_block_ms_per_step", "train_ms_per_step"),
    ("capture", "graph_capture_reps_ms", "graph_capture_ms"),
    ("torch.empty 4 KiB", "empty_small_reps_us", "empty_small_us"),
    ("torch.empty mixed", "empty_mixed_reps_us", "empty_mixed_us"),
    ("FSDP2 step", "fsdp_step_ms", "fsdp_ms_per_step"),
)
# Where a capture's time goes (torch_bench.py's graph section): paired and
# printed here, not targets of the report.
PHASES = (
    ("capture: enter", "graph_enter_reps_ms", None),
    ("capture: forward", "graph_forward_reps_ms", None),
    ("capture: exit", "graph_exit_reps_ms", None),
    ("capture: sync", "graph_sync_reps_ms", None),
)
# What the allocator did in the paired sections (torch_bench.py's memory_stats
# counters, per capture and over the mixed reps): printed side by side, base
# then test.
COUNTS = tuple(f"graph_{k}_reps" for k in COUNTED) + tuple(f"empty_mixed_{k}" for k in COUNTED)


def collect(objs, pairs=None):
    """Adds the torch_turns lines among objs to pairs
    {(kind, round): {"base": fields, "test": fields}} (merged per role)."""
    pairs = {} if pairs is None else pairs
    for o in objs:
        if not isinstance(o, dict) or o.get("kind") != "torch_turns":
            continue
        role = o.get("turns_role")
        if role not in ("base", "test"):
            continue
        key = (str(o.get("turns_kind")), str(o.get("turns_round")))
        pairs.setdefault(key, {}).setdefault(role, {}).update(o)
    return pairs


def parse_line(line):
    """The JSON object of a result line, or None when the line is not one
    (torchrun's "[rankN]:" prefix, when it adds one, is skipped). Raises
    ValueError for a line that looks like JSON but is not; bench/report.py
    reads its lines the same way."""
    line = line.strip()
    if line.startswith("[rank") and "]:" in line[:12]:
        line = line[line.index("]:") + 2:].strip()
    return json.loads(line) if line.startswith("{") else None


def load(paths):
    objs = []
    for p in paths:
        try:
            with open(p) as f:
                for line in f:
                    try:
                        objs.append(parse_line(line))
                    except ValueError:
                        pass
        except OSError as e:
            print(f"{p}: {e}", file=sys.stderr)
    return collect(objs)


def paired(base, test):
    """{label: (median of test_k/base_k, base median, test median, n)} for
    the metrics both processes measured, over the same number of reps."""
    res = {}
    for label, key, _ in METRICS + PHASES:
        a, b = base.get(key), test.get(key)
        if not isinstance(a, list) or not isinstance(b, list) or len(a) != len(b) or not a:
            continue
        if any(not isinstance(x, (int, float)) or not x > 0 or x == float("inf") for x in a + b):  # NaN too
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


def order(pairs):
    """The pairs' keys by kind, then round (numerically where it is a number)."""
    return sorted(pairs, key=lambda k: (k[0], int(k[1]) if k[1].isdigit() else 0, k[1]))


def figures(pairs):
    """({(kind, label): [per-pair figure, in round order]}, [(kind, round, why)]
    for the pairs that could not be used)."""
    per, bad = {}, []
    for kind, rnd in order(pairs):
        roles = pairs[(kind, rnd)]
        base, test = roles.get("base", {}), roles.get("test", {})
        why = broken(base, test)
        if why:
            bad.append((kind, rnd, why))
            continue
        for label, v in paired(base, test).items():
            per.setdefault((kind, label), []).append(v[0])
    return per, bad


def spread(v):
    return statistics.stdev(math.log(x) for x in v) if len(v) > 1 else float("nan")


def summarize(pairs):
    """The lines bench/turns.py prints."""
    lines = ["==== per pair: kind round metric ratio (base median, test median, reps) ===="]
    for kind, rnd in order(pairs):
        roles = pairs[(kind, rnd)]
        why = broken(roles.get("base", {}), roles.get("test", {}))
        if why:
            lines.append(f"{kind} {rnd} not paired: {why}")
            continue
        for label, (r, a, b, n) in paired(roles["base"], roles["test"]).items():
            lines.append(f"{kind} {rnd} {label}: {r:.3f} ({a:.4g}, {b:.4g}, {n})")
        for key in COUNTS:
            a, b = roles["base"].get(key), roles["test"].get(key)
            if a is not None and b is not None:
                lines.append(f"{kind} {rnd} {key}: {a} | {b}")
    lines.append("==== per kind and metric: median (min-max) of the pairs, spread = stdev of log ====")
    per, _ = figures(pairs)
    for (kind, label), v in per.items():
        lines.append(f"{kind:24} {label:18} n={len(v)} {statistics.median(v):.3f} "
                     f"({min(v):.3f}-{max(v):.3f}) spread {spread(v):.3f}")
    return lines


def main(argv):
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    print("\n".join(summarize(load(argv[1:]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
