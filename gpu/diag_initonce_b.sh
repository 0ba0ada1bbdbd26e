#!/usr/bin/env bash
# One GPU call (nineteenth session): the crossing into Go with and without
# the runtime's init-once (capi/build_lib.sh): bench/hot_path.c on the
# driver for this library and $CUDAPOOL_LIBRARY_B (default
# build/lib_b/libcudapool.so), ROUNDS interleaved runs of 3 rounds each;
# then torch_bench.py's alt section, ALT_RUNS processes per build. Carry lib
# and build/lib_b.
set -u
cd "$(dirname "$0")/.." || exit 1
B=${CUDAPOOL_LIBRARY_B:-$PWD/build/lib_b/libcudapool.so}
O=${OUT:-/tmp/initonce-b}; mkdir -p "$O" build/bench
gcc -std=c11 -O2 -Wall -I include bench/hot_path.c -o build/bench/hot_path -L lib -lcudapool -ldl -pthread || exit 1
unset CUDAPOOL_BACKEND CUDAPOOL_CONF PYTORCH_CUDA_ALLOC_CONF
for r in $(seq "${ROUNDS:-2}"); do
    for L in "$PWD/lib" "$(dirname "$B")"; do
        echo "== $L"
        LD_LIBRARY_PATH=$L timeout 120 ./build/bench/hot_path 3 2>&1 |
            grep -E 'near no-op|front off|after 1 ms|caller.s call'
    done
done > "$O/hot_path.txt"
ALT_RUNS=${ALT_RUNS:-2} ROUNDS=0 bash gpu/diag_initonce.sh > "$O/alt.txt" 2>&1
cat "$O/hot_path.txt"
grep -E '^alt |^A:' "$O/alt.txt"
