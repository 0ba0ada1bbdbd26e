#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bench_fragmentation.sh - peak reserved / peak allocated of every allocator on
# two allocation traces, on the GPU, in one command (docs/fragmentation.md):
#
#   bash gpu/bench_fragmentation.sh          (from anywhere; REPEATS=3)
#
# Traces: demo/trace.txt (3 recorded GPT-2 training steps), a synthetic LLM
# inference trace (bench/kvcache.py, seeded: generated here, byte for byte
# the same as on any machine), with prefills on the decode stream and on a
# stream of their own, and demo/fsdp2.txt.gz (21 recorded FSDP2 training
# steps of one rank: three streams). Allocators, each in a fresh process:
# PyTorch's native, native expandable_segments:True, cudaMallocAsync
# (bench/native_bench.cpp over libc10_cuda) and cudapool with
# expandable_segments:False (ordinary segments), cudapool with
# expandable_segments:True,stitch:False (expandable segments without
# stitching), cudapool with its defaults (expandable segments with stitching;
# bench/c_bench.c over lib/libcudapool.so). The replays launch no kernels: they measure memory
# and the allocator's host time per operation.
#
# Needs lib/libcudapool.so (built where Go is; copy lib/), python3 with CUDA
# PyTorch, gcc, g++. No network. Writes $OUT (default
# /tmp/cudapool-frag-out): results.jsonl, logs/, table.md; the table is
# printed last. BENCH_SIM=1 runs the cudapool rows on the simulator (to test
# the script without a GPU; native rows are then skipped).
set -u
cd "$(dirname "$0")/.." || exit 1
REPO=$PWD
OUT=${OUT:-/tmp/cudapool-frag-out}
PY=${PYTHON:-python3}
REPEATS=${REPEATS:-3}
BUILD=$REPO/build/frag
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
mkdir -p "$OUT/logs" "$BUILD"
RES=$OUT/results.jsonl
: >"$RES"
unset PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF CUDAPOOL_CONF CUDAPOOL_BACKEND

# The inference trace twice: one stream, and prefills on a second stream
# (engines that overlap prefill with decode), which per-stream caching
# fragments further.
KV=$BUILD/kvcache.txt
KV2=$BUILD/kvcache_2streams.txt
{ "$PY" bench/kvcache.py "$KV" && "$PY" bench/kvcache.py "$KV2" --prefill-stream 1; } 2>"$OUT/logs/kvcache.log" ||
    { cat "$OUT/logs/kvcache.log"; exit 1; }
FSDP=$BUILD/fsdp2.txt
gzip -dc demo/fsdp2.txt.gz >"$FSDP" || exit 1
TRACES=(demo/trace.txt "$KV" "$KV2" "$FSDP")

if [ ! -f lib/libcudapool.so ]; then
    echo "lib/libcudapool.so is missing: run make where Go is, and copy lib/ here"
    exit 1
fi
gcc -std=c11 -O2 -Wall -I include -I bench bench/c_bench.c -o "$BUILD/c_bench" \
    -L lib -lcudapool -ldl -pthread -Wl,-rpath,"$REPO/lib" 2>"$OUT/logs/build_c.log" ||
    { cat "$OUT/logs/build_c.log"; exit 1; }

# native_bench against the installed torch (as bench/run_bench.sh builds it).
build_native() {
    local tdir abi inc=() d std extras
    tdir=$("$PY" -c "import os, torch; print(os.path.dirname(torch.__file__))") || return 1
    abi=$("$PY" -c "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))") || return 1
    inc=(-I bench -I "$tdir/include")
    [ -d "$CUDA_HOME/include" ] && inc+=(-I "$CUDA_HOME/include")
    for d in "$tdir"/../nvidia/cu*/include "$tdir"/../nvidia/cuda_runtime/include; do
        [ -d "$d" ] && inc+=(-I "$d")
    done
    for std in c++17 c++20; do
        for extras in -DNB_EXTRAS -DNB_PLAIN; do
            if g++ -std="$std" -O2 -D_GLIBCXX_USE_CXX11_ABI="$abi" "$extras" "${inc[@]}" \
                bench/native_bench.cpp -o "$BUILD/native_bench" -L "$tdir/lib" -lc10_cuda -lc10 \
                -Wl,-rpath,"$tdir/lib" -Wl,--allow-shlib-undefined -pthread; then
                return 0
            fi
        done
    done
    return 1
}
NATIVE=1
if [ "${BENCH_SIM:-0}" = 1 ]; then
    NATIVE=0
elif ! build_native >"$OUT/logs/build_native.log" 2>&1; then
    NATIVE=0
    echo "native_bench did not build (logs/build_native.log): native rows skipped"
fi

run() { # CONFIG TRACE ENV... -- PROGRAM
    local cfg=$1 trace=$2 log
    shift 2
    log=$OUT/logs/${cfg}_$(basename "$trace" .txt).log
    echo "=== $cfg on $trace"
    if timeout -k 5 300 env "$@" --config "$cfg" --sections trace --trace "$trace" \
        --trace-repeats "$REPEATS" 2>"$log" | grep '"section":"trace"' |
        sed "s|}\$|,\"trace_file\":\"$(basename "$trace")\"}|" >>"$RES"; then
        tail -n 1 "$log" | cut -c1-160 | sed 's/^/    /'
    else
        echo "    failed (logs/$(basename "$log"))"
    fi
}

SIMENV=()
[ "${BENCH_SIM:-0}" = 1 ] && SIMENV=(CUDAPOOL_BACKEND=sim)
for trace in "${TRACES[@]}"; do
    if [ "$NATIVE" = 1 ]; then
        run native "$trace" -u PYTORCH_CUDA_ALLOC_CONF "$BUILD/native_bench"
        run native_expandable "$trace" PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "$BUILD/native_bench"
        run native_async "$trace" PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync "$BUILD/native_bench"
    fi
    run cudapool_segments "$trace" "${SIMENV[@]}" CUDAPOOL_CONF=expandable_segments:False "$BUILD/c_bench"
    run cudapool_expandable "$trace" "${SIMENV[@]}" CUDAPOOL_CONF=expandable_segments:True,stitch:False "$BUILD/c_bench"
    run cudapool "$trace" -u CUDAPOOL_CONF "${SIMENV[@]}" "$BUILD/c_bench"
done

"$PY" - "$RES" "$REPEATS" >"$OUT/table.md" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print(f"peak reserved / peak allocated, trace replays ({sys.argv[2]} passes each; no kernels)\n")
print("| trace | allocator | peak allocated GiB | peak reserved GiB | reserved/allocated | first pass ms | ns/op (cached passes) | stitch remaps | error |")
print("|---|---|---:|---:|---:|---:|---:|---:|---|")
for r in rows:
    pa, pr = r.get("trace_peak_allocated", -1), r.get("trace_peak_reserved", -1)
    ratio = f"{pr / pa:.3f}" if pa and pa > 0 and pr > 0 else "-"
    print(f"| {r.get('trace_file')} | {r['config']} | {pa / 2**30:.2f} | {pr / 2**30:.2f} | {ratio} | "
          f"{r.get('trace_first_pass_ms', -1):.1f} | {r.get('trace_ns_per_op', -1):.0f} | "
          f"{r.get('trace_stitch_remaps', '-')} | {r.get('trace_error', '')} |")
EOF
echo
cat "$OUT/table.md"
