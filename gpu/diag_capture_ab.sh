#!/usr/bin/env bash
# One GPU call (nineteenth session, issue 11): captures by PyTorch's
# allocator and by cudapool alternating in one process
# (gpu/diag_capture_alt.py), for this library and for another build
# ($CUDAPOOL_LIBRARY_B, default build/lib_b/libcudapool.so), their processes
# taking turns; first the GPU tests of graphs and MemPools. Carry lib and
# build/lib_b. PROCS processes of PAIRS pairs per library. Table last.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python CUDAPOOL_LIBRARY=$PWD/lib/libcudapool.so
B=${CUDAPOOL_LIBRARY_B:-$PWD/build/lib_b/libcudapool.so}
O=${OUT:-/tmp/capture-ab}; mkdir -p "$O"
T0=$(date +%s)
if [ "${TESTS:-1}" = 1 ]; then
	GPU_TESTS="graphs mempool" timeout -k 5 ${TESTS_S:-240} bash python/gpu/run_gpu_tests.sh > "$O/tests.log" 2>&1
	echo "graphs+mempool GPU tests rc=$? $(grep -E 'passed|failed' "$O/tests.log" | tail -n 1) ($(($(date +%s) - T0)) s)"
fi
libs="$CUDAPOOL_LIBRARY"
[ -f "$B" ] && libs="$libs $B"
DIAG_LIBS="$libs" timeout -k 5 ${ALT_S:-420} python3 gpu/diag_capture_alt.py ${PROCS:-3} ${PAIRS:-8} > "$O/alt.log" 2>&1
echo "capture_alt rc=$? ($(($(date +%s) - T0)) s)"
echo "host: $(grep -m 1 'model name' /proc/cpuinfo | sed 's/.*: *//'), $(nproc) CPUs; $(date -u '+%Y-%m-%d %H:%M UTC')"
echo "A: lib $(cat lib/BUILD_COMMIT 2>/dev/null | head -c 200)"
echo "B: $B $(cat "$(dirname "$B")/BUILD_COMMIT" 2>/dev/null | head -c 200)"
cat "$O/alt.log"
