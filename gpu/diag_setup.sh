# gpu/diag_setup.sh - sourced by the diagnostic scripts that run the C
# benchmark programs (gpu/diag_issue11.sh, gpu/diag_pairing.sh), from the
# repository root: a fresh build/diag ($D), the allocator variables cleared,
# an elapsed-seconds helper (el), and c_bench ($CB) and native_bench ($NB)
# built exactly as bench/run_bench.sh builds them (no runs; DIAG_BUILD_C=0:
# none). Exits on a failed build.
PY=${PYTHON:-python3}
D=build/diag
rm -rf "$D" && mkdir -p "$D"
export CUDAPOOL_LIBRARY=$PWD/lib/libcudapool.so PYTHONUNBUFFERED=1
unset PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF CUDAPOOL_CONF CUDAPOOL_BACKEND BENCH_START_AT
T0=$(date +%s)
el() { echo $(($(date +%s) - T0)); }

[ "${DIAG_BUILD_C:-1}" = 0 ] && return 0
OUT=$PWD/$D/bo BENCH_PARTS=c BENCH_REPEATS=0 BENCH_UPDATE_REPO=0 bash bench/run_bench.sh >"$D/build.log" 2>&1
CB=build/bench/c_bench NB=build/bench/native_bench
[ -x $CB ] && [ -x $NB ] || { tail -n 30 "$D/build.log"; echo "build failed"; exit 1; }
echo "built at $(el)s"
