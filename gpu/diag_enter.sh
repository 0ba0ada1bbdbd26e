#!/usr/bin/env bash
# gpu/diag_enter.sh - the capture's enter phase per allocator, and a CPU
# profile of the library through it (issue 11; docs/hot-path.md 17).
#   bash gpu/diag_enter.sh      (carry lib and build/lib_prof: a build of
#   ./capi with -tags cudapool_cpuprofile; profiles go to $OUT or build/diag)
# 1. gpu/diag_enter.py gpt: GPT-2 forward captures, native / cudapool /
#    cudapool_nofront, the library's hooks timed inside it (DIAG_TIMING);
# 2. gpu/diag_enter.py tiny with the profiling build: many small captures,
#    one CPU profile per cudapool process (enter_tiny_cudapool_1.prof).
set -u
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
P=${OUT:-$PWD/build/diag}
mkdir -p "$P"
export PYTHONUNBUFFERED=1
unset PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF CUDAPOOL_CONF CUDAPOOL_BACKEND
T0=$(date +%s)
echo "library $(cat lib/BUILD_COMMIT 2>/dev/null | tr '\n' ' '), profiling build $(cat build/lib_prof/BUILD_COMMIT 2>/dev/null | tr '\n' ' ')"
CUDAPOOL_LIBRARY=$PWD/lib/libcudapool.so $PY -c 'import sys; sys.path.insert(0, "python"); import cudapool; cudapool.install(); import torch; torch.empty(1, device="cuda"); print("extension ready")' 2>&1 | tail -2
echo "ready at $(($(date +%s) - T0))s"
CUDAPOOL_LIBRARY=$PWD/lib/libcudapool.so DIAG_TIMING=1 DIAG_CONFIGS=${GPT_CONFIGS:-"native cudapool cudapool_nofront"} \
    $PY gpu/diag_enter.py gpt "${GPT_REPS:-2}" "${GPT_N:-40}" | tee "$P/enter_gpt.txt"
echo "gpt done at $(($(date +%s) - T0))s"
if [ -f build/lib_prof/libcudapool.so ]; then
    CUDAPOOL_LIBRARY=$PWD/build/lib_prof/libcudapool.so DIAG_PROFILE_DIR=$P DIAG_CONFIGS="native cudapool" \
        $PY gpu/diag_enter.py tiny "${TINY_REPS:-1}" "${TINY_N:-1000}" 2>&1 | grep -v "SetCPUProfileRate" | tee "$P/enter_tiny.txt"
fi
echo "done at $(($(date +%s) - T0))s"
ls -la "$P"
