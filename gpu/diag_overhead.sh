#!/usr/bin/env bash
# Runs gpu/diag_overhead.py's experiments on the GPU machine.
cd "$(dirname "$0")/.."
mkdir -p build/bench
gcc -O2 -shared -fPIC bench/floor_alloc.c -o build/bench/libfloor.so -ldl -pthread
export CUDAPOOL_LIBRARY=$PWD/lib/libcudapool.so FLOOR_LIB=$PWD/build/bench/libfloor.so LD_LIBRARY_PATH=$PWD/lib
python3 gpu/diag_overhead.py ctypes
python3 gpu/diag_overhead.py torch
GOMAXPROCS=1 python3 gpu/diag_overhead.py torch
GOMAXPROCS=4 python3 gpu/diag_overhead.py torch
GODEBUG=asyncpreemptoff=1 python3 gpu/diag_overhead.py torch
taskset -c 2 python3 gpu/diag_overhead.py torch
