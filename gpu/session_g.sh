#!/usr/bin/env bash
# One GPU call (2026-11-23, third session): the merged chunked expandable
# segments (one physical allocation per 20 MiB in large ranges) on the real
# driver: the C ABI test, stitching's integrity test and graph capture with
# stitch:True, then every PyTorch GPU test with expandable_segments:True.
# Carry lib. Table last.
set -u
export PYTHONUNBUFFERED=1 CUDAPOOL_LIBRARY=$PWD/lib/libcudapool.so
O=${OUT:-/tmp/session-g}; mkdir -p "$O" build/gpu
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
rows=()
"$CUDA_HOME/bin/nvcc" -ptx -arch=sm_90 gpu/kernels.cu -o build/gpu/kernels.ptx &&
gcc -O2 -Wall -Wno-unused-variable gpu/test_gpu.c -I include -I "$CUDA_HOME/include" \
    -L lib -lcudapool -L "$CUDA_HOME/lib64/stubs" -lcuda -ldl -Wl,-rpath,"$PWD/lib" -o build/gpu/test_gpu
KERNELS_PTX=build/gpu/kernels.ptx timeout 120 build/gpu/test_gpu > "$O/c_abi.log" 2>&1
rows+=("C ABI test rc=$? $(grep -c '^ok' "$O/c_abi.log") ok, $(grep -c '^not ok\|^FAIL' "$O/c_abi.log") not ok")
(cd python && CUDAPOOL_CONF=stitch:True timeout 120 python3 -m pytest -q -s tests/gpu/test_gpu_stitch.py) > "$O/stitch.log" 2>&1
rows+=("stitch integrity rc=$? $(grep -o "{'remaps'[^}]*" "$O/stitch.log" | cut -c1-60) $(tail -n 1 "$O/stitch.log")")
for cfg in cudapool_stitch cudapool_exp; do
    timeout 120 python3 bench/torch_bench.py $cfg --sections graph 2>>"$O/graph.log" | grep '^{' >> "$O/graph.jsonl"
done
rows+=("graph: $(python3 -c "
import json
for l in open('$O/graph.jsonl'):
    r = json.loads(l)
    if r.get('section') != 'graph': continue
    print(r['config'], 'capture %.1f ms' % r['graph_capture_ms'], 'pool %d MiB' % (r['graph_pool_bytes'] >> 20), 'diff', r['graph_max_abs_diff'], end='; ')
")")
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 5 ${EXP_S:-400} bash python/gpu/run_gpu_tests.sh > "$O/torch_exp.log" 2>&1
rows+=("torch GPU tests, expandable rc=$? $(grep -E 'RESULT' "$O/torch_exp.log" | tail -n 1)")
grep -E '^test_gpu|^ddp' "$O/torch_exp.log" | tail -14
grep -E '^not ok|FAIL' "$O/c_abi.log" | head
printf '%s\n' "${rows[@]}"
