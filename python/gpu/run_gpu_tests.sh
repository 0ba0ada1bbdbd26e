#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# cudapool's GPU tests (PyTorch + CUDA). Each test module runs in a fresh
# Python process, since cudapool.install() must precede CUDA initialization;
# then, with two GPUs, a two-process DDP run. Ends with a summary table and
# exits non-zero if anything failed. The tests run with cudapool's defaults
# (expandable segments with stitching) unless PYTORCH_CUDA_ALLOC_CONF says
# otherwise: gpu/run_tests.sh runs them again with expandable_segments:False
# (ordinary segments).
#
#   python/gpu/run_gpu_tests.sh            # from anywhere; PYTHON=python3.12 to choose
#   GPU_TESTS="parity multi" python/gpu/run_gpu_tests.sh   # only the files (and "ddp")
#                                          # whose names contain one of these words
#
# The library: $CUDAPOOL_LIBRARY, the installed package's copy, or the
# checkout's lib/libcudapool.so (build it with `make` where Go is).
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
PYDIR=$(dirname "$HERE")
cd "$PYDIR"
PY=${PYTHON:-python3}
PER_FILE_TIMEOUT=${PER_FILE_TIMEOUT:-300}
# test_gpu_parity runs each scenario in two fresh processes (torch.compile
# among them); test_gpu_multi_gpu runs FSDP2 under torchrun twice.
PARITY_TIMEOUT=${PARITY_TIMEOUT:-1200}
MULTI_GPU_TIMEOUT=${MULTI_GPU_TIMEOUT:-1200}
# test_gpu_ipc_expandable: five scenarios, ten thousand tensors in one of them.
IPC_TIMEOUT=${IPC_TIMEOUT:-1500}
export PYTHONPATH="$PYDIR${PYTHONPATH:+:$PYTHONPATH}"
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
unset CUDAPOOL_BACKEND CUDAPOOL_CONF
OUT=$(mktemp -d "${TMPDIR:-/tmp}/cudapool-gpu.XXXXXX")
start=$(date +%s)

# pytest: the interpreter's own, else python/gpu/.pydeps (for a machine with
# no network: `pip install --target python/gpu/.pydeps pytest` elsewhere).
if ! "$PY" -c 'import pytest' 2>/dev/null; then
    if [ -d "$HERE/.pydeps" ]; then
        export PYTHONPATH="$PYTHONPATH:$HERE/.pydeps"
        echo "pytest: from $HERE/.pydeps"
    else
        echo "FATAL: $PY has no pytest. Where there is network: pip install --target python/gpu/.pydeps pytest"
        exit 1
    fi
fi

if ! "$PY" -c 'import cudapool; print("cudapool library:", cudapool.library_path())'; then
    echo "FATAL: cudapool's library cannot be found or loaded (see above)"
    exit 1
fi
"$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "GPUs", torch.cuda.device_count())' \
    || echo "WARNING: torch is not importable: every GPU test will skip"

rows=()
failed=0
selected() {  # $1: a name; true when GPU_TESTS is empty or names it
    [ -z "${GPU_TESTS:-}" ] && return 0
    local w
    for w in $GPU_TESTS; do case "$1" in *"$w"*) return 0 ;; esac; done
    return 1
}

for f in tests/gpu/test_*.py; do
    name=$(basename "$f" .py)
    selected "$name" || continue
    envs=()
    limit=$PER_FILE_TIMEOUT
    case "$name" in
        test_gpu_mempool) envs=(CUDAPOOL_GPU_NO_INSTALL=1) ;;  # per-pool mode: no install()
        # the pytest process only starts subprocesses (native and cudapool)
        test_gpu_parity) envs=(CUDAPOOL_GPU_NO_INSTALL=1); limit=$PARITY_TIMEOUT ;;
        # the same: each scenario is a parent and a spawned child of its own
        test_gpu_ipc_expandable) envs=(CUDAPOOL_GPU_NO_INSTALL=1); limit=$IPC_TIMEOUT ;;
        test_gpu_multi_gpu) limit=$MULTI_GPU_TIMEOUT ;;
    esac
    echo "=== $f ${envs[*]+${envs[*]}}"
    t0=$(date +%s)
    timeout "$limit" env ${envs[@]+"${envs[@]}"} "$PY" -m pytest -p no:cacheprovider \
        --confcutdir=tests/gpu -q -rsxX "$f" --junitxml="$OUT/$name.xml" 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    secs=$(( $(date +%s) - t0 ))
    counts=$("$PY" - "$OUT/$name.xml" <<'PYEOF'
import sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except Exception:
    print("- - -"); raise SystemExit
s = root if root.tag == "testsuite" else root.find("testsuite")
tests, fail, err, skip = (int(s.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
print(tests - fail - err - skip, fail + err, skip)
PYEOF
)
    # pytest: 0 ok, 5 nothing collected (all skipped at module level)
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
        failed=1
        [ "$rc" -eq 124 ] && counts="$counts (timeout)"
        [ "$rc" -gt 128 ] && counts="$counts (crash, rc=$rc)"
    fi
    rows+=("$name|$counts|${secs}s|rc=$rc")
done

ngpu=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if ! selected ddp_train; then
    :
elif [ "${ngpu:-0}" -ge 2 ]; then
    echo "=== gpu/ddp_train.py (2 processes)"
    t0=$(date +%s)
    timeout "$PER_FILE_TIMEOUT" "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 gpu/ddp_train.py 2>&1 \
        | tee "$OUT/ddp.log"
    rc=${PIPESTATUS[0]}
    secs=$(( $(date +%s) - t0 ))
    if [ "$rc" -eq 0 ]; then rows+=("ddp_train (torchrun x2)|1 0 0|${secs}s|rc=0"); else
        failed=1; rows+=("ddp_train (torchrun x2)|0 1 0|${secs}s|rc=$rc"); fi
else
    echo "SKIP gpu/ddp_train.py: needs 2 GPUs, found ${ngpu:-0}"
    rows+=("ddp_train (torchrun x2)|0 0 1|0s|skipped: ${ngpu:-0} GPU(s)")
fi

echo
printf '%-28s %7s %7s %8s %7s  %s\n' "test file" passed failed skipped time status
for r in "${rows[@]}"; do
    IFS='|' read -r n c t s <<<"$r"
    read -r p fl sk rest <<<"$c"
    printf '%-28s %7s %7s %8s %7s  %s %s\n' "$n" "$p" "$fl" "$sk" "$t" "$s" "${rest:-}"
done
echo "total time: $(( $(date +%s) - start ))s; logs and JUnit XML in $OUT"
if [ "$failed" -ne 0 ]; then echo "RESULT: FAILED"; exit 1; fi
echo "RESULT: OK"
