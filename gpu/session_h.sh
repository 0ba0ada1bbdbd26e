#!/usr/bin/env bash
# One GPU call (2026-11-23, fourth session): the front cache
# (allocator/front.go, capi/front.c) on the real driver. The C ABI test,
# every PyTorch GPU test (the C++ class, whose pairs the front serves), then
# bench/hot_path.c with the front on and off. Carry lib. Table last.
set -u
export PYTHONUNBUFFERED=1 CUDAPOOL_LIBRARY=$PWD/lib/libcudapool.so
O=${OUT:-/tmp/session-h}; mkdir -p "$O" build/gpu build/bench
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
rows=()
"$CUDA_HOME/bin/nvcc" -ptx -arch=sm_90 gpu/kernels.cu -o build/gpu/kernels.ptx &&
gcc -O2 -Wall -Wno-unused-variable gpu/test_gpu.c -I include -I "$CUDA_HOME/include" \
    -L lib -lcudapool -L "$CUDA_HOME/lib64/stubs" -lcuda -ldl -Wl,-rpath,"$PWD/lib" -o build/gpu/test_gpu
KERNELS_PTX=build/gpu/kernels.ptx timeout 120 build/gpu/test_gpu > "$O/c_abi.log" 2>&1
rows+=("C ABI test rc=$? $(grep -c '^ok' "$O/c_abi.log") ok, $(grep -c '^not ok\|^FAIL' "$O/c_abi.log") not ok")
timeout -k 5 ${TESTS_S:-360} bash python/gpu/run_gpu_tests.sh > "$O/torch.log" 2>&1
rows+=("torch GPU tests rc=$? $(grep -E 'RESULT' "$O/torch.log" | tail -n 1)")
gcc -std=c11 -O2 -Wall -I include bench/hot_path.c -o build/bench/hot_path -L lib -lcudapool -ldl -pthread \
    -Wl,-rpath,"$PWD/lib" && timeout 150 ./build/bench/hot_path 5 > "$O/hot_path.txt" 2>&1
rows+=("hot_path rc=$?")
grep -E '^test_gpu|^ddp|passed|failed' "$O/torch.log" | tail -16
grep -E '^not ok|FAIL' "$O/c_abi.log" | head
echo "host: $(grep -m 1 'model name' /proc/cpuinfo | sed 's/.*: *//'), $(nproc) CPUs; $(date -u '+%Y-%m-%d %H:%M UTC'); lib $(cat lib/BUILD_COMMIT 2>/dev/null)"
cat "$O/hot_path.txt"
printf '%s\n' "${rows[@]}"
