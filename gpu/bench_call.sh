#!/usr/bin/env bash
# gpu/bench_call.sh - one device call of the full benchmark, run in parts
# whose results add up across calls (bench/run_bench.sh's BENCH_PARTS,
# BENCH_REPEAT_FROM, BENCH_KEEP): the results live in build/bench-out, which
# each call returns as $OUT/bench-out.tgz with the regenerated README.md,
# bench/RESULTS.md and docs/charts; unpack it here and carry build/bench-out
# (and lib) to the next call. The trace replay records the memory series for
# the third chart (--trace-series 2000). Example, three calls:
#   BENCH_PARTS=c bash gpu/bench_call.sh
#   BENCH_PARTS="torch floor" BENCH_REPEATS=2 bash gpu/bench_call.sh
#   BENCH_PARTS="torch floor train" BENCH_REPEAT_FROM=3 bash gpu/bench_call.sh
set -u
cd "$(dirname "$0")/.." || exit 1
RET=${OUT:-/tmp/bench-call}
mkdir -p "$RET" build/bench-out
OUT=$PWD/build/bench-out BENCH_KEEP=1 BENCH_C_ARGS="--trace-series 2000 ${BENCH_C_ARGS:-}" bash bench/run_bench.sh
rc=$?
tar czf "$RET/bench-out.tgz" build/bench-out README.md bench/RESULTS.md docs/charts 2>/dev/null
exit $rc
