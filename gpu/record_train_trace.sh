#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# gpu/record_train_trace.sh - record the training row's 75 steps (warm-up and
# timed lengths as torch_bench.py runs them) as an allocation trace, for
# replaying front and fit policies on the simulator (c_bench --trace; a
# policy that fragments shows only over many lengths). make test-c replays
# the committed copy, demo/train75.txt.gz. Result: $OUT/train75.txt.gz (or
# build/trace).
set -u
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
P=${OUT:-$PWD/build/trace}
mkdir -p "$P"
T0=$(date +%s)
timeout 400 $PY bench/record_trace.py "$P/train75.txt" bench || exit 1
gzip -9 "$P/train75.txt"
echo "recorded in $(($(date +%s) - T0))s: $(ls -l "$P/train75.txt.gz" | awk '{print $5}') bytes gzipped"
