"""Ratios within rings of bench/turn_ring.py, per capture phase (issue 11).

    python3 gpu/ring_phases.py DIR BASE TEST [TEST ...]

DIR holds torch_bench.py JSON lines as turn_ring.py writes them, one file
per process, named CONFIG_rK.json (K: the ring). For each TEST against BASE
and each ring: the graph section's captures paired one by one (capture k of
both ran in one round of turns; the first, a process's one-off, left out),
the median of the per-capture ratios TEST/BASE of the whole capture and of
each phase (enter: synchronize, gc.collect, empty_cache, capture_begin;
forward; exit: capture_end, instantiation; sync), and the ratio of the
training step and of the two torch.empty loops. Then the median (min-max)
over the rings. Prints a table; no files.
"""
import glob
import json
import os
import re
import statistics
import sys

PHASES = (("capture", "graph_capture_reps_ms"), ("enter", "graph_enter_reps_ms"),
          ("forward", "graph_forward_reps_ms"), ("exit", "graph_exit_reps_ms"), ("sync", "graph_sync_reps_ms"))
SCALARS = (("train step", "train_ms_per_step"), ("empty 4 KiB", "empty_small_us"), ("empty mixed", "empty_mixed_us"))


def load(d):
    """{(config, ring): merged JSON fields} of the files in d."""
    out = {}
    for f in glob.glob(os.path.join(d, "*.json")):
        m = re.fullmatch(r"(.+)_r(\d+)", os.path.basename(f)[:-5])
        if not m:
            continue
        fields = {}
        with open(f) as fh:
            for line in fh:
                line = line.strip()
                if line.startswith("{"):
                    fields.update(json.loads(line))
        out[(m.group(1), int(m.group(2)))] = fields
    return out


def ratios(base, test):
    """{metric: ratio} of one ring's TEST process to its BASE process."""
    r = {}
    for name, key in PHASES:
        a, b = base.get(key), test.get(key)
        if a and b and len(a) > 1 and len(b) > 1:
            r[name] = statistics.median(y / x for x, y in zip(a[1:], b[1:]) if x > 0)
    for name, key in SCALARS:
        if base.get(key) and test.get(key):
            r[name] = test[key] / base[key]
    return r


def main(argv):
    if len(argv) < 3:
        sys.exit(__doc__.split("\n\n")[1])
    d, base, tests = argv[0], argv[1], argv[2:]
    runs = load(d)
    rings = sorted({k for (c, k) in runs if c == base})
    names = [n for n, _ in PHASES] + [n for n, _ in SCALARS]
    for test in tests:
        per = {n: [] for n in names}
        for k in rings:
            if (test, k) in runs:
                for n, v in ratios(runs[(base, k)], runs[(test, k)]).items():
                    per[n].append(v)
        print(f"\n{test} / {base}, per ring (captures paired one by one), then median (min-max)")
        for n in names:
            v = per[n]
            if v:
                print(f"  {n:12} " + " ".join(f"{x:.3f}" for x in v)
                      + f"   median {statistics.median(v):.3f} ({min(v):.3f}-{max(v):.3f}, {len(v)} rings)")
    print("\nmedians of each process's captures (ms), per ring: " + ", ".join(
        f"{c}: " + " ".join(f"{statistics.median(runs[(c, k)]['graph_capture_reps_ms'][1:]):.2f}"
                            for k in rings if (c, k) in runs and runs[(c, k)].get('graph_capture_reps_ms'))
        for c in [base] + tests))
    # What each process's allocator did: the training's peak reserved (a
    # placement change shows there first) and cudapool's front hits.
    print("\nper process: train peak reserved GiB, front hits per step / allocations per step, front hits per capture (median)")
    for c in [base] + tests:
        for k in rings:
            f = runs.get((c, k))
            if not f:
                continue
            pr = f.get("train_peak_reserved")
            hs, al = f.get("train_front_hits_per_step"), f.get("train_allocs_per_step")
            gh = f.get("graph_front_hits_reps")
            print(f"  {c}_r{k:<3} " + (f"{pr / 2**30:.3f}" if pr else "-")
                  + (f"  {hs:.0f}/{al:.0f}" if hs is not None and al else "  -")
                  + (f"  {statistics.median(gh[1:] or gh):.0f}" if gh else "  -"))


if __name__ == "__main__":
    main(sys.argv[1:])
