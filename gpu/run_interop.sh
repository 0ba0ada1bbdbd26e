#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# CuPy and Numba on cudapool, on a GPU machine, in one command (docs/interop.md):
#   1. python/tests/gpu/test_gpu_interop.py through python/gpu/run_gpu_tests.sh
#      (PyTorch on cudapool, CuPy and Numba adapters, a fresh process),
#   2. bench/interop_bench.py (fresh processes per measurement).
# Needs lib/libcudapool.so built where Go is (`make`; copy lib/). Logs in
# $OUT (default /tmp/cudapool-interop-out). Ends with the test summary line
# and the benchmark's tables.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cudapool-interop-out}
mkdir -p "$OUT"
export CUDAPOOL_LIBRARY=$PWD/lib/libcudapool.so
[ -f "$CUDAPOOL_LIBRARY" ] || { echo "FATAL: lib/libcudapool.so missing: run make where Go is and copy lib/ here"; exit 1; }
PY=${PYTHON:-python3}
"$PY" -c 'import cupy, numba.cuda, torch; print("cupy", cupy.__version__, "| numba-cuda", getattr(numba.cuda, "__version__", "?"), "| torch", torch.__version__)' 2>&1 | tail -1

echo "=== GPU tests (test_gpu_interop.py)"
GPU_TESTS=interop bash python/gpu/run_gpu_tests.sh >"$OUT/tests.log" 2>&1
trc=$?
grep -E "^(FAILED|ERROR|SKIPPED)|Error|assert" "$OUT/tests.log" | head -40

echo "=== benchmark (bench/interop_bench.py ${BENCH_ARGS:-})"
# shellcheck disable=SC2086
timeout ${BENCH_TIMEOUT:-480} "$PY" bench/interop_bench.py ${BENCH_ARGS:-} >"$OUT/bench.log" 2>&1
brc=$?
grep -vE '^\| |^peak checksums|^One device|^CuPy allocation|^\|---' "$OUT/bench.log" | tail -20

echo
echo "tests: rc=$trc; $(grep -E '^test_gpu_interop' "$OUT/tests.log" | tail -1)"
echo "  (columns: test file, passed, failed, skipped, time, status)"
sed -n '/^One device/,$p' "$OUT/bench.log"
echo "benchmark: rc=$brc"
[ "$trc" -eq 0 ] && [ "$brc" -eq 0 ]
