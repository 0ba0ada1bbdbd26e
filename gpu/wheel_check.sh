#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# wheel_check.sh - the wheel alone, on the GPU machine (no Go, no network):
#
#   bash gpu/wheel_check.sh            (needs dist/: build it with `make wheel`)
#
#   1. a fresh venv with --system-site-packages (torch is preinstalled there),
#   2. pip install dist/cudapool-<VERSION>-*.whl --no-deps --no-index,
#   3. python/smoke_installed.py: `import cudapool` is the installed copy
#      (not this checkout), version and ABI, bundled library, malloc/free on
#      the GPU through the C ABI,
#   4. `python -m cudapool script.py`: a script allocating CUDA tensors runs
#      with cudapool installed (the C++ class is built on this first use),
#   5. the GPU tests (python/tests/gpu, python/gpu) copied to a directory
#      outside the checkout and run there by python/gpu/run_gpu_tests.sh
#      with the venv's python, so they import the installed package.
# Everything runs from $WORK (outside the checkout); a table ends it; with
# $OUT set, the three logs are copied there.
#
# Environment: PYTHON (python3, the interpreter with torch), WORK (default
# a new /tmp/cudapool-wheel.XXXXXX), GPU_TESTS (the run_gpu_tests.sh filter;
# default: every test file), KEEP_CACHE=1 (reuse ~/.cache/cudapool's built
# class instead of a fresh CUDAPOOL_CACHE).
set -u
cd "$(dirname "$0")/.." || exit 1
REPO=$PWD
PY=${PYTHON:-python3}
VERSION=$(cat VERSION)
WORK=${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/cudapool-wheel.XXXXXX")}
mkdir -p "$WORK"
unset CUDAPOOL_LIBRARY CUDAPOOL_BACKEND CUDAPOOL_CONF PYTHONPATH
# A fresh cache: the class must be built from the wheel's own sources.
[ "${KEEP_CACHE:-0}" = 1 ] || export CUDAPOOL_CACHE=$WORK/cache
rows=()
failed=0
row() { rows+=("$1|$2|$3"); [ "$2" = PASS ] || [ "$2" = SKIP ] || failed=1; }

shopt -s nullglob
wheels=("$REPO"/dist/cudapool-"$VERSION"-*.whl)
if [ ${#wheels[@]} -ne 1 ]; then
    echo "FATAL: want exactly one dist/cudapool-$VERSION-*.whl, found ${#wheels[@]}: run make wheel where Go is, copy dist/ here"
    exit 1
fi
WHEEL=${wheels[0]}
echo "wheel: $(basename "$WHEEL")"
echo "glibc here: $(ldd --version 2>&1 | head -n 1)"

VENV=$WORK/venv
t0=$(date +%s)
make_venv() {
    if "$PY" -m venv --system-site-packages "$VENV"; then
        "$VENV/bin/python" -m pip install --no-deps --no-index "$WHEEL"
        return
    fi
    # No ensurepip (Debian/Ubuntu without python3-venv): a venv without pip,
    # filled by the interpreter's own pip (--python needs pip >= 22.3).
    echo "venv with pip failed: trying --without-pip and $PY's pip"
    rm -rf "$VENV"
    "$PY" -m venv --system-site-packages --without-pip "$VENV" &&
        "$PY" -m pip --python "$VENV/bin/python" install --no-deps --no-index "$WHEEL"
}
if make_venv; then
    row "venv + pip install (no deps, no index)" PASS "$(( $(date +%s) - t0 ))s"
else
    row "venv + pip install (no deps, no index)" FAIL "$(( $(date +%s) - t0 ))s"
    echo "FATAL: the wheel did not install"
    exit 1
fi
VPY=$VENV/bin/python
cd "$WORK" || exit 1
# --system-site-packages exposes the base interpreter's packages only: when
# $PY is itself a venv (or conda env) holding torch, a .pth file appends its
# site-packages after the new venv's own, so the wheel's cudapool still wins.
if ! "$VPY" -c 'import torch' 2>/dev/null && "$PY" -c 'import torch' 2>/dev/null; then
    sp=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$PY" -c 'import site; print("\n".join(site.getsitepackages()))' >"$sp/zz_parent_site_packages.pth"
    echo "note: torch is in $PY's own site-packages; made visible through $sp/zz_parent_site_packages.pth"
fi
tv=$("$VPY" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda, "GPUs", torch.cuda.device_count())' 2>&1 | tail -n 1)
echo "torch in the venv: $tv"

t0=$(date +%s)
"$VPY" "$REPO/python/smoke_installed.py" --version "$VERSION" --not-under "$REPO" | tee smoke.log
rc=${PIPESTATUS[0]}
r=$(tail -n 1 smoke.log)
if [ "$rc" -eq 0 ]; then row "smoke_installed.py (GPU)" PASS "$(( $(date +%s) - t0 ))s  $r"; else
    row "smoke_installed.py (GPU)" FAIL "$(( $(date +%s) - t0 ))s  $r"; fi

cat >"$WORK/mcp_script.py" <<'PYEOF'
import os, torch, cudapool
x = torch.randn(1 << 20, device="cuda")
y = (x * 2).sum().item()
assert cudapool.installed(), "cudapool is not installed"
where = os.path.dirname(os.path.realpath(cudapool.__file__))
print("cudapool", cudapool.__version__, "from", where, "mode", cudapool.mode(),
      "backend", torch.cuda.get_allocator_backend(), "allocated", cudapool.memory_allocated(0))
assert cudapool.memory_allocated(0) >= 4 << 20
PYEOF
t0=$(date +%s)
"$VPY" -m cudapool "$WORK/mcp_script.py" 2>&1 | tee mcp.log
rc=${PIPESTATUS[0]}
info=$(grep -o 'mode [a-z]* backend [a-z]*' mcp.log | head -n 1)
if [ "$rc" -eq 0 ] && grep -q "from $VENV" mcp.log; then row "python -m cudapool script.py" PASS "$(( $(date +%s) - t0 ))s  $info"; else
    row "python -m cudapool script.py" FAIL "$(( $(date +%s) - t0 ))s  rc=$rc $info"; fi

# The GPU tests, outside the checkout: their conftest puts their own
# grandparent directory ($WORK/tests) first on sys.path, which holds no
# cudapool, so they import the installed package.
mkdir -p "$WORK/t/tests" "$WORK/t/gpu"
cp -r "$REPO/python/tests/gpu" "$WORK/t/tests/"
cp "$REPO"/python/gpu/*.py "$REPO"/python/gpu/run_gpu_tests.sh "$WORK/t/gpu/"
# test_gpu_soak_race.py runs the repository's gpu/race_record_stream.py,
# which it looks for in gpu/ beside the directory that holds tests/.
mkdir -p "$WORK/gpu"
cp "$REPO"/gpu/race_record_stream.py "$WORK/gpu/"
t0=$(date +%s)
PYTHON=$VPY bash "$WORK/t/gpu/run_gpu_tests.sh" 2>&1 | tee gpu_tests.log
rc=${PIPESTATUS[0]}
lib=$(sed -n 's/^cudapool library: //p' gpu_tests.log | head -n 1)
res=$(grep '^RESULT' gpu_tests.log | tail -n 1)
# Passed tests over every file (a run where all skip proves nothing).
npass=$(sed -n '/^test file/,/^total time/p' gpu_tests.log | awk 'NR > 1 && $2 ~ /^[0-9]+$/ { n += $2 } END { print n + 0 }')
res="$res, $npass passed"
if [ "$rc" -eq 0 ] && [ "$npass" -gt 0 ] && [ "${lib#"$VENV"/}" != "$lib" ]; then row "GPU tests from the installed package" PASS "$(( $(date +%s) - t0 ))s  $res"
else row "GPU tests from the installed package" FAIL "$(( $(date +%s) - t0 ))s  rc=$rc $res; library: ${lib:-?}"; fi

echo
echo "==== wheel check: $(basename "$WHEEL") (logs in $WORK) ===="
sed -n '/^test file/,/^total time/p' gpu_tests.log
echo
printf '%-42s %-5s %s\n' step result detail
for r in "${rows[@]}"; do
    IFS='|' read -r n s d <<<"$r"
    printf '%-42s %-5s %s\n' "$n" "$s" "$d"
done
echo "library used by the GPU tests: ${lib:-?}"
echo "torch in the venv: $tv"
# $OUT gets the logs, not the venv.
if [ -n "${OUT:-}" ] && [ -d "$OUT" ] && [ "$OUT" != "$WORK" ]; then
    cp "$WORK"/smoke.log "$WORK"/mcp.log "$WORK"/gpu_tests.log "$OUT"/ 2>/dev/null
fi
[ "$failed" -eq 0 ] && echo "RESULT: OK" || echo "RESULT: FAILED"
exit "$failed"
