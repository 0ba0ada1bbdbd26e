# gpu/rings.sh - sourced, from the repository root, by the diagnostics that
# run rings (diag_sched.sh, diag_train_ring.sh). ring_setup sets PY, the
# output folder P ($OUT or build/diag), the library's environment (the
# allocator variables cleared) and T0, and builds the C++ extension once,
# so that no timing pays for it. run_rings DIR N [torch_bench.py args] runs N rings of
# bench/turn_ring.py over the configurations in the array CFGS, the order
# rotated from ring to ring, each member CONFIG_rK writing DIR/ring/CONFIG_rK.json
# and the ring's log DIR/ring_K.log. Needs PY and T0.
run_rings() {
    local dir=$1 n=$2 k i c
    shift 2
    mkdir -p "$dir/ring"
    for k in $(seq 1 "$n"); do
        local runs=()
        for i in "${!CFGS[@]}"; do
            c=${CFGS[$(((i + k - 1) % ${#CFGS[@]}))]}
            runs+=("${c}_r$k=$c")
        done
        timeout 300 $PY bench/turn_ring.py --cpu 2 --limit 280 --out-dir "$dir/ring" "${runs[@]}" -- "$@" >"$dir/ring_$k.log" 2>&1
        echo "ring $k (${runs[*]}) rc=$? at $(($(date +%s) - T0))s"
    done
}

ring_setup() {
    PY=${PYTHON:-python3}
    P=${OUT:-$PWD/build/diag}
    mkdir -p "$P/ring"
    export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python CUDAPOOL_LIBRARY=$PWD/lib/libcudapool.so
    unset PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF CUDAPOOL_CONF CUDAPOOL_BACKEND GODEBUG
    T0=$(date +%s)
    echo "library $(tr '\n' ' ' <lib/BUILD_COMMIT 2>/dev/null)"
    $PY -c 'import cudapool; cudapool.install(); import torch; torch.empty(1, device="cuda"); print("extension ready")' 2>&1 | tail -2
}
