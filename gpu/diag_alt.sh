#!/usr/bin/env bash
# gpu/diag_alt.sh - the torch.empty rows with PyTorch's allocator and
# cudapool alternating rep by rep in one process (bench/torch_bench.py,
# section alt: cudapool's class hands allocate() to the allocator it
# replaced during native's reps), for each cudapool configuration in
# CONFIGS, RUNS processes each, interleaved, the main thread pinned to CPU
# $CPU (BENCH_TURNS_PIN). Prints each process's median per-pair ratio
# cudapool/native for the 4 KiB and the mixed loop, with each side's
# median. TIMING=1 also times each allocate() and deleter call of both
# allocators (--alt-timing) and prints their medians and means per loop;
# TIMING=cross also follows each of native's allocate() calls with a
# near-empty call into cudapool's Go code (--alt-timing cross).
# About 4 minutes on an H100 host (carry lib/):
#   bash gpu/diag_alt.sh
set -u
cd "$(dirname "$0")/.." || exit 1
RUNS=${RUNS:-3}
CPU=${CPU:-2}
CONFIGS=${CONFIGS:-"cudapool cudapool_nofront cudapool_treap"}
DIAG_BUILD_C=0
TIMED=
[ "${TIMING:-0}" = 1 ] && TIMED=--alt-timing
[ "${TIMING:-0}" = cross ] && TIMED="--alt-timing cross"
# shellcheck source=gpu/diag_setup.sh
. gpu/diag_setup.sh
echo "CPU $CPU (main thread), library $(cat lib/BUILD_COMMIT 2>/dev/null || echo ?)"
for r in $(seq 1 "$RUNS"); do
    for c in $CONFIGS; do
        BENCH_TURNS_PIN=$CPU timeout 300 $PY bench/torch_bench.py "$c" --sections alt --reps "${REPS:-9}" $TIMED \
            >"$D/alt.$c.$r.json" 2>"$D/alt.$c.$r.log" || echo "$c run $r failed: $(tail -n 3 "$D/alt.$c.$r.log")"
        echo "$c run $r done at $(el)s"
    done
done
$PY - "$D" <<'PYEOF'
import glob, json, os, statistics, sys
print("\n==== torch.empty, native and cudapool alternating in one process: cudapool/native ====")
for p in sorted(glob.glob(os.path.join(sys.argv[1], "alt.*.json"))):
    _, cfg, run, _ = os.path.basename(p).split(".")
    for line in open(p):
        d = json.loads(line) if line.startswith("{") else {}
        if d.get("section") != "alt":
            continue
        if "alt_error" in d:
            print(f"{cfg:18} run {run}: {d['alt_error']}")
            continue
        cells = []
        for loop in ("small", "mixed"):
            r = d[f"alt_{loop}_ratio_reps"]
            cells.append(f"{loop} {d[f'alt_{loop}_ratio']:.3f} ({min(r):.3f}-{max(r):.3f}; "
                         f"native {statistics.median(d[f'alt_{loop}_native_reps_us']):.3f} us, "
                         f"cudapool {statistics.median(d[f'alt_{loop}_cudapool_reps_us']):.3f} us)")
        print(f"{cfg:18} run {run}: " + "; ".join(cells))
        for loop in ("small", "mixed"):
            calls = [f"{side} {call} {d[k]:.0f}/{d[k.replace('median', 'mean')]:.0f}"
                     for side in ("native", "cudapool") for call in ("alloc", "free", "alloc_lib", "cross")
                     for k in [f"alt_{loop}_{side}_{call}_median_ns"] if k in d]
            if calls:
                print(f"{'':18}   {loop} calls, median/mean ns: " + ", ".join(calls))
                # The pair's time outside the timed calls: the interpreter
                # and torch around them (means, as the loop's time is one).
                rest = []
                for side in ("native", "cudapool"):
                    inside = sum(d.get(f"alt_{loop}_{side}_{c}_mean_ns", 0) for c in ("alloc", "free", "cross"))
                    rest.append(f"{side} {statistics.median(d[f'alt_{loop}_{side}_reps_us']) * 1e3 - inside:.0f}")
                print(f"{'':18}   {loop} outside the calls, ns per pair: " + ", ".join(rest))
PYEOF
echo "total $(el)s"
