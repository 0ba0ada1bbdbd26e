# SPDX-License-Identifier: Apache-2.0
"""Per FSDP2 launch (bench/fsdp2_bench.py result lines in the files named):
the GPU step and rank 0's host time to issue it (ms, medians over the timed
steps), and per step the allocations, the driver's allocations and frees,
retries and cudapool's front hits.

    python3 gpu/fsdp_counters.py RESULT.json...
"""
import json
import sys

KEYS = ("allocation", "num_device_alloc", "num_device_free", "num_alloc_retries", "front_hits")


def rows(paths):
    for path in paths:
        with open(path) as f:
            for line in f:
                if not line.startswith("{"):
                    continue
                r = json.loads(line)
                if r.get("section") == "fsdp":
                    yield r


def main(paths):
    print(f"{'launch':36s} {'gpu ms':>7s} {'cpu ms':>7s} " + " ".join(f"{k[:10]:>10s}" for k in KEYS))
    nan = float("nan")
    for r in rows(paths):
        tag = ":".join(str(r[k]) for k in ("turns_kind", "turns_round", "turns_role") if k in r)
        tag = f"{tag} {r['config']}".strip()
        cells = " ".join(f"{r.get(f'fsdp_{k}_per_step', nan):10.1f}" for k in KEYS)
        print(f"{tag:36s} {r['fsdp_ms_per_step']:7.2f} {r.get('fsdp_cpu_ms_per_step', nan):7.2f} {cells}")
        th = r.get("fsdp_threads")
        if th:
            # per step: CPU ms of the main thread and of the others, their
            # switches; then the busiest other threads
            main = [t for t in th if t[1]]
            rest = [t for t in th if not t[1]]
            m = main[0] if main else ["?", True, nan, nan, nan]
            print(f"    threads per step: main {m[2]:.2f} ms cpu, {m[3]:.1f}+{m[4]:.1f} switches; "
                  f"{len(rest)} others {sum(t[2] for t in rest):.2f} ms cpu, "
                  f"{sum(t[3] for t in rest):.1f}+{sum(t[4] for t in rest):.1f} switches; busiest: "
                  + ", ".join(f"{t[0]} {t[2]:.2f}/{t[3]:.0f}+{t[4]:.0f}" for t in rest[:5]))


if __name__ == "__main__":
    main(sys.argv[1:])
