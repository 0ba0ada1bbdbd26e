#!/usr/bin/env bash
# gpu/diag_train_steps.sh - the training row step by step (issue 11;
# gpu/diag_train_steps.py says what one process measures).
#   bash gpu/diag_train_steps.sh      (carry lib; results in $OUT or build/diag)
# CONFIGS: processes in this order; EAGER_CONFIGS (empty: none): more, with
# CUDA_MODULE_LOADING=EAGER (every kernel loaded at start, so that a new
# length's first step pays no module load).
set -u
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
P=${OUT:-$PWD/build/diag}
mkdir -p "$P"
export PYTHONUNBUFFERED=1 CUDAPOOL_LIBRARY=$PWD/lib/libcudapool.so
R=$P/train_steps.jsonl
: > "$R"
T0=$(date +%s)
echo "library $(cat lib/BUILD_COMMIT 2>/dev/null | tr '\n' ' ')"
for c in ${CONFIGS-native cudapool expandable cudapool_exp native cudapool}; do
    timeout 240 $PY gpu/diag_train_steps.py "$c" >> "$R" 2> "$P/train_steps_$c.err" || echo "$c failed: $(tail -3 "$P/train_steps_$c.err")"
    echo "$c done at $(($(date +%s) - T0))s"
done
for c in ${EAGER_CONFIGS-native cudapool}; do
    CUDA_MODULE_LOADING=EAGER timeout 300 $PY gpu/diag_train_steps.py "$c" >> "$R" 2> "$P/train_steps_eager_$c.err" || echo "eager $c failed: $(tail -3 "$P/train_steps_eager_$c.err")"
    echo "eager $c done at $(($(date +%s) - T0))s"
done
$PY gpu/diag_train_steps_report.py "$R"
