#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Every GPU test of cudapool in one go, on a GPU machine:
#   1. the C ABI test program (gpu/test_gpu.c, built here with gcc; kernels
#      compiled to PTX by nvcc),
#   2. the PyTorch tests (python/gpu/run_gpu_tests.sh),
#   3. optionally (SOAK_S=seconds) the soak, gpu/soak.sh,
#   4. optionally (RECORD_TRACE=1) a fresh allocation trace for the demo.
# Needs lib/libcudapool.so built where Go is (`make`; copy lib/ to the GPU machine)
# along. Logs go to $OUT (default /tmp/cudapool-gpu-out); a table ends it.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cudapool-gpu-out}
mkdir -p "$OUT" build/gpu
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export LD_LIBRARY_PATH=$PWD/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export CUDAPOOL_LIBRARY=$PWD/lib/libcudapool.so
rows=()
failed=0

step() { # step NAME CMD...: run, log to $OUT/NAME.log, remember the outcome
    local name=$1 t0 rc
    shift
    echo "=== $name"
    t0=$(date +%s)
    "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    tail -n 40 "$OUT/$name.log"
    [ "$rc" -ne 0 ] && failed=1
    rows+=("$name|$([ "$rc" -eq 0 ] && echo PASS || echo "FAIL rc=$rc")|$(( $(date +%s) - t0 ))s|$(grep -E 'passed|RESULT|^SOAK:' "$OUT/$name.log" | tail -n 1)")
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
[ -f lib/libcudapool.so ] || { echo "FATAL: lib/libcudapool.so missing: run make where Go is and copy lib/ here"; exit 1; }

build_c() {
    "$CUDA_HOME/bin/nvcc" -ptx -arch=sm_90 gpu/kernels.cu -o build/gpu/kernels.ptx &&
    gcc -O2 -Wall -Wno-unused-variable gpu/test_gpu.c -I include -I "$CUDA_HOME/include" \
        -L lib -lcudapool -L "$CUDA_HOME/lib64/stubs" -lcuda -ldl -Wl,-rpath,"$PWD/lib" -o build/gpu/test_gpu
}
step build_c build_c
[ -x build/gpu/test_gpu ] && step c_abi env KERNELS_PTX=build/gpu/kernels.ptx build/gpu/test_gpu
# The PyTorch tests with cudapool's defaults (expandable segments with
# stitching), then with expandable_segments:False (ordinary segments;
# SEGMENTS=0 skips it; cudapool reads PYTORCH_CUDA_ALLOC_CONF when
# CUDAPOOL_CONF is unset). EXPANDABLE=1 runs them with expandable_segments:True
# named too (the default's settings, named). test_gpu_parity runs both
# allocators with the same PYTORCH_CUDA_ALLOC_CONF: expandable_segments:False
# where it is unset (native's default against cudapool's ordinary segments),
# and in torch_exp native's expandable segments against cudapool's default.
step torch bash python/gpu/run_gpu_tests.sh
if [ "${SEGMENTS:-1}" = 1 ]; then
    step torch_segments env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False bash python/gpu/run_gpu_tests.sh
fi
if [ "${EXPANDABLE:-0}" = 1 ]; then
    step torch_exp env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True bash python/gpu/run_gpu_tests.sh
fi
# The GPU soak (docs/reliability.md: native beside cudapool, the C twin, the record_stream
# race) when SOAK_S is set; SEGMENTS picks the segment kinds (gpu/soak.sh).
if [ -n "${SOAK_S:-}" ]; then
    step soak env OUT="$OUT/soak" bash gpu/soak.sh
fi
if [ "${RECORD_TRACE:-0}" = 1 ]; then
    step trace python3 bench/record_trace.py "$OUT/trace.txt" 3
fi

echo
printf '%-10s %-12s %6s  %s\n' step result time summary
for r in "${rows[@]}"; do
    IFS='|' read -r n res t s <<<"$r"
    printf '%-10s %-12s %6s  %s\n' "$n" "$res" "$t" "$s"
done
exit $failed
