#!/usr/bin/env bash
# gpu/diag_runtime_tick.sh - what the Go runtime's takes of a C caller's P
# cost (docs/hot-path.md 22): A, the library as built (lib/: a call from C
# counts as a schedule tick, capi/build_lib.sh), against B, the same
# sources with the stock runtime ($CUDAPOOL_LIBRARY_B, default
# build/lib_stock/libcudapool.so, `make lib-stock`), or any other build.
# 1. bench/hot_path.c, ROUNDS rounds per library, A B A B, unpinned, then
# the whole process on one CPU; 2. RINGS training rings of native, cudapool
# and cudapool_b (gpu/diag_train_ring.sh: main threads taking turns on one
# CPU). Carry lib and build/lib_stock:
#   ROUNDS=3 RINGS=5 bash gpu/diag_runtime_tick.sh
set -u
cd "$(dirname "$0")/.." || exit 1
export CUDAPOOL_LIBRARY_B=${CUDAPOOL_LIBRARY_B:-$PWD/build/lib_stock/libcudapool.so}
B_DIR=$(dirname "$CUDAPOOL_LIBRARY_B")
[ -f lib/libcudapool.so ] && [ -f "$CUDAPOOL_LIBRARY_B" ] || { echo "carry lib and $B_DIR"; exit 1; }
echo "A: lib $(tr '\n' ' ' <lib/BUILD_COMMIT); B: $B_DIR $(tr '\n' ' ' <"$B_DIR/BUILD_COMMIT" 2>/dev/null)"
echo "host: $(grep -m 1 'model name' /proc/cpuinfo | sed 's/.*: *//'), $(nproc) CPUs; $(date -u '+%Y-%m-%d %H:%M UTC')"
mkdir -p build/bench
gcc -std=c11 -O2 -Wall -I include bench/hot_path.c -o build/bench/hot_path -L lib -lcudapool -ldl -pthread \
    -Wl,-rpath,"$PWD/lib" || exit 1
unset PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF CUDAPOOL_CONF CUDAPOOL_BACKEND GODEBUG
T0=$(date +%s)
hp() { # hp LABEL [taskset args...]: one hot_path run (the RUNPATH is lib/; LD_LIBRARY_PATH wins over it)
    local label=$1 lib=$PWD/lib
    shift
    case $label in B*) lib=$(cd "$B_DIR" && pwd) ;; esac
    echo "== $label"
    LD_LIBRARY_PATH=$lib "$@" ./build/bench/hot_path "${ROUNDS:-3}" | grep -E "Go after|class path|C API|wake-ups|caller's call"
}
for r in 1 2; do
    hp "A unpinned"
    hp "B unpinned"
done
hp "A one CPU" taskset -c 0
hp "B one CPU" taskset -c 0
echo "hot_path done at $(($(date +%s) - T0))s"
[ "${RINGS:-5}" -gt 0 ] || exit 0
STEP_CONFIGS="" CFGS="native cudapool cudapool_b" RINGS=${RINGS:-5} bash gpu/diag_train_ring.sh 2>&1 | tail -n 40
echo "total $(($(date +%s) - T0))s"
