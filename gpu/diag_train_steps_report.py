"""Summarizes gpu/diag_train_steps.py's JSON lines (one per process).

    python3 gpu/diag_train_steps_report.py FILE

Per process: the bench's timed steps (5-64) split by whether the length was
new to the process and whether the allocator went to the driver; the
steady-state steps (every length seen); then the driver's times by size."""
import json
import statistics
import sys


def summary(rec):
    timed = [s for s in rec["steps"] if 5 <= s["i"] < 65]
    steady = [s for s in rec["steps"] if s["i"] >= 1000]
    new = [s for s in timed if s["new"]]
    old = [s for s in timed if not s["new"]]
    dev = [s for s in timed if s["dev_alloc"] or s["dev_free"]]
    old_nodev = [s for s in old if not (s["dev_alloc"] or s["dev_free"])]
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    return {
        "timed mean": sum(s["ms"] for s in timed) / len(timed),
        "new len n": len(new), "new len ms": med([s["ms"] for s in new]),
        "seen len ms": med([s["ms"] for s in old]),
        "seen, no drv": med([s["ms"] for s in old_nodev]),
        "drv steps": len(dev), "drv allocs": sum(s["dev_alloc"] for s in timed),
        "drv frees": sum(s["dev_free"] for s in timed),
        "share new": sum(s["ms"] for s in new) / sum(s["ms"] for s in timed),
        "steady med": med([s["ms"] for s in steady]),
        "steady drv": sum(s["dev_alloc"] + s["dev_free"] for s in steady),
    }


def main(path):
    recs = [json.loads(ln) for ln in open(path) if ln.startswith("{")]
    cols = list(summary(recs[0]).keys()) if recs else []
    print("| process | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for r in recs:
        s = summary(r)
        name = r["config"] + (" EAGER" if r.get("module_loading") == "EAGER" else "")
        print(f"| {name} | " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in s.values()) + " |")
    if recs and "pipeline" in recs[0]:
        print("\nunsynchronized blocks (every length once per block), per step: CPU loop ms / block ms; allocations")
        for r in recs:
            print(" ", r["config"], "; ".join(f"{b['cpu_ms']:.1f}/{b['total_ms']:.1f}" for b in r["pipeline"]),
                  f"; {r['pipeline'][-1]['allocs_per_step']:.0f} allocations per step"
                  + (f", {r['pipeline'][-1]['front_hits_per_step']:.0f} served by the front"
                     if "front_hits_per_step" in r["pipeline"][-1] else ""))
    if recs:
        print("\ndriver us (median of 8), alloc / free, per size MiB, per process:")
        for r in recs:
            print(" ", r["config"], ", ".join(f"{k}: {a:.0f}/{f:.0f}" for k, (a, f) in r["driver_us"].items()))


if __name__ == "__main__":
    main(sys.argv[1])
