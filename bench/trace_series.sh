#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# trace_series.sh - reserved and allocated bytes over the trace replay
# (demo/trace.txt, 5 passes as in the benchmark), sampled about SERIES_N
# times, for native, native expandable, cudapool and cudapool expandable;
# then bench/charts.py plots the charts with them.
#
#   bash bench/run_bench.sh && bash bench/trace_series.sh
#
# A run apart from the timed one (run_bench.sh with BENCH_C_ARGS="--trace-series
# 2000" records the series in the timed run instead, leaving the sampling
# time out of the replay's times). Uses the programs run_bench.sh built (build/bench/c_bench,
# build/bench/native_bench) and its results ($OUT/results). Writes
# $OUT/series/*.json and $OUT/charts/*.svg (when matplotlib is importable;
# otherwise, where it is: python3 bench/charts.py --results OUT/results
# --series OUT/series --out docs/charts). BENCH_SIM=1: cudapool's configs on
# the simulator (to test this script without a GPU). A table ends it.
set -u
cd "$(dirname "$0")/.." || exit 1
REPO=$PWD
OUT=${OUT:-/tmp/cudapool-bench-out}
PY=${PYTHON:-python3}
N=${SERIES_N:-2000}
BUILD=$REPO/build/bench
mkdir -p "$OUT/series"
rm -f "$OUT"/series/*.json
unset PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF CUDAPOOL_CONF CUDAPOOL_BACKEND
export CUDAPOOL_LIBRARY=$REPO/lib/libcudapool.so
rows=()
failed=0
for cfg in native expandable cudapool cudapool_exp; do
    envs=(env)
    case $cfg in
    native) prog=$BUILD/native_bench ;;
    expandable) prog=$BUILD/native_bench; envs+=(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) ;;
    cudapool) prog=$BUILD/c_bench ;;
    cudapool_exp) prog=$BUILD/c_bench; envs+=(CUDAPOOL_CONF=expandable_segments:True,stitch:False) ;;
    esac
    case $cfg in cudapool*) [ "${BENCH_SIM:-0}" = 1 ] && envs+=(CUDAPOOL_BACKEND=sim) ;; esac
    if [ ! -x "$prog" ]; then
        rows+=("$cfg|skipped|$(basename "$prog") not built: run bench/run_bench.sh first")
        failed=1
        continue
    fi
    f=$OUT/series/$cfg.json
    # Only the series line: the other sections stay those of the timed run.
    if timeout -k 5 120 "${envs[@]}" "$prog" --config "$cfg" --trace demo/trace.txt --sections trace \
        --trace-series "$N" 2>"$OUT/series/$cfg.log" | grep '"section":"trace_series"' >"$f"; then
        rows+=("$cfg|ok|$(tail -n 1 "$OUT/series/$cfg.log" | cut -c1-110)")
    else
        rows+=("$cfg|failed|$(tail -n 1 "$OUT/series/$cfg.log" | cut -c1-110)")
        failed=1
    fi
done
if [ -d "$OUT/results" ] && ls "$OUT"/results/*.json >/dev/null 2>&1; then
    src=(--results "$OUT/results")
else
    src=(--from-md bench/RESULTS.md)
fi
charts=$("$PY" bench/charts.py "${src[@]}" --series "$OUT/series" --out "$OUT/charts" 2>&1 | tail -n 1)
echo
printf '%-14s %-8s %s\n' config series detail
for r in "${rows[@]}"; do
    IFS='|' read -r c s d <<<"$r"
    printf '%-14s %-8s %s\n' "$c" "$s" "$d"
done
echo "$charts"
exit "$failed"
