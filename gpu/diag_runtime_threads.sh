#!/usr/bin/env bash
# gpu/diag_runtime_threads.sh - the Go runtime's threads, one by one, under a
# C caller allocating through Go every 50 us (bench/hot_path.c --threads, on the
# simulator so that every other thread is Go's; BACKEND=real: the driver,
# CUDA's threads named): lib/ (the runtime's callback tick) against
# build/lib_stock (make lib-stock: the stock runtime), the keeper on and off, GOMAXPROCS as the
# host gives it and 2 (GMS=default for the first only; docs/hot-path.md 22).
# Carry lib and build/lib_stock:   BACKEND=real SECS=2 bash gpu/diag_runtime_threads.sh
set -u
cd "$(dirname "$0")/.." || exit 1
mkdir -p build/bench
gcc -std=c11 -O2 -Wall -I include bench/hot_path.c -o build/bench/hot_path -L lib -lcudapool -ldl -pthread \
    -Wl,-rpath,"$PWD/lib" || exit 1
unset PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF CUDAPOOL_CONF GODEBUG CUDAPOOL_BACKEND
be=CUDAPOOL_BACKEND=sim
[ "${BACKEND:-sim}" = real ] && be=CUDAPOOL_BACKEND_IS=real
echo "host: $(nproc) CPUs; A: lib $(tr '\n' ' ' <lib/BUILD_COMMIT); B: build/lib_stock"
for gm in ${GMS:-default 2}; do
    [ "$gm" = default ] && gm=""
    for keeper in True False; do
        for lib in lib build/lib_stock; do
            echo "== $lib keeper=$keeper GOMAXPROCS=${gm:-default}"
            env ${gm:+GOMAXPROCS=$gm} LD_LIBRARY_PATH=$PWD/$lib $be \
                CUDAPOOL_CONF=warm_runtime:$keeper ./build/bench/hot_path --threads "${SECS:-2}"
        done
    done
done
