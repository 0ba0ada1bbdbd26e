#!/usr/bin/env bash
# One GPU call (2026-11-23 session): graph_capture_record_stream_reuse
# diagnostics and PyTorch's two reclaim tests, then the CuPy/Numba interop
# tests and benchmark. Carry lib, .ref, .whl.
set -u
export PYTHONUNBUFFERED=1 CUDAPOOL_LIBRARY=$PWD/lib/libcudapool.so CUDAPOOL_CACHE=/tmp/cpcache
O=${OUT:-/tmp/session-a}; mkdir -p $O
echo "=== diag_capture_reuse"
timeout 120 env PYTHONPATH=$PWD/python python3 gpu/diag_capture_reuse.py 2>&1 | tail -25
echo "=== reclaim tests"
pip install -q --target /tmp/site .whl/*.whl >/dev/null 2>&1
printf 'TestMemPool::test_graph_capture_reclaim_2_streams\nTestMemPool::test_graph_capture_reclaim_4_streams\n' > /tmp/reclaim.txt
mkdir -p /tmp/rc
PYTHONPATH=/tmp/site timeout 150 gpu/pytorch_tests/run.sh -m cudapool -t 120 -s /tmp/reclaim.txt -n cuda-reclaim .ref/pytorch-tests/test_cuda.py /tmp/rc >/dev/null 2>&1
cp /tmp/rc/cuda-reclaim.cudapool.xml /tmp/rc/cuda-reclaim.cudapool.log $O/ 2>/dev/null
grep -o 'tests="[0-9]*"\|failures="[0-9]*"\|errors="[0-9]*"' /tmp/rc/cuda-reclaim.cudapool.xml | tr '\n' ' '; echo
grep -E '^E ' /tmp/rc/cuda-reclaim.cudapool.log | head -8
echo "=== interop"
OUT=$O/interop BENCH_TIMEOUT=${BENCH_TIMEOUT:-300} bash gpu/run_interop.sh 2>&1 | tail -45
tar czf $O/interop.tgz -C $O interop 2>/dev/null; rm -rf $O/interop
