#!/usr/bin/env bash
# gpu/diag_runtime_threads.sh - the Go runtime's threads, one by one, under a
# C caller allocating through Go every 50 us (gpu/runtime_threads.c, on the
# simulator so that every other thread is Go's): lib/ against
# build/lib_tick (make lib-tick), the keeper on and off, GOMAXPROCS as the
# host gives it and 2 (docs/hot-path.md 22). Carry lib and build/lib_tick.
set -u
cd "$(dirname "$0")/.." || exit 1
mkdir -p build/bench
gcc -O2 -Wall -I include gpu/runtime_threads.c -o build/bench/runtime_threads -L lib -lcudapool \
    -Wl,-rpath,"$PWD/lib" -pthread || exit 1
unset PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF CUDAPOOL_CONF GODEBUG
echo "host: $(nproc) CPUs; A: lib $(tr '\n' ' ' <lib/BUILD_COMMIT); B: build/lib_tick"
for gm in "" 2; do
    for keeper in True False; do
        for lib in lib build/lib_tick; do
            echo "== $lib keeper=$keeper GOMAXPROCS=${gm:-default}"
            env ${gm:+GOMAXPROCS=$gm} LD_LIBRARY_PATH=$PWD/$lib CUDAPOOL_BACKEND=sim \
                CUDAPOOL_CONF=warm_runtime:$keeper ./build/bench/runtime_threads "${SECS:-2}" 50000
        done
    done
done
