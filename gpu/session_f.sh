#!/usr/bin/env bash
# One GPU call (2026-11-23, third session): is the C++ class's torch.empty
# path slower than the pluggable one, or were its processes the slow mode of
# a bimodal host? gpu/bench_class_paths.py with per-child figures: the
# class's variants (frees queued, frees made at once, GODEBUG=schedtrace),
# the pluggable fallback and native, pinned to 4 CPUs, then unpinned.
# Carry lib.
set -u
export CUDAPOOL_LIBRARY=$PWD/lib/libcudapool.so PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1
unset PYTORCH_CUDA_ALLOC_CONF CUDAPOOL_CONF CUDAPOOL_BACKEND
echo "host: $(grep -m 1 'model name' /proc/cpuinfo | sed 's/.*: *//'), $(nproc) CPUs; $(lscpu | grep -E '^(NUMA node|Thread|Core)' | tr -s ' ' | paste -sd';')"
M=class,pluggable,native
echo "==== pinned to CPUs 4-7"
timeout -k 5 250 python3 gpu/bench_class_paths.py ${REPS:-4} --modes $M --pin 4-7 --hot-only --json "${OUT:-/tmp}/pinned.json"
echo "==== unpinned"
timeout -k 5 150 python3 gpu/bench_class_paths.py ${REPS2:-3} --modes class,pluggable,native --hot-only --json "${OUT:-/tmp}/unpinned.json"
