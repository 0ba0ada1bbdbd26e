#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Runs a selection of one of PyTorch's own test files twice: natively, and
# with cudapool installed in every Python process (site/sitecustomize.py,
# CUDAPOOL_AUTOINSTALL=1). Leaves JUnit XML and logs in OUT_DIR for
# report.py.
#
#   gpu/pytorch_tests/run.sh [options] TEST_FILE OUT_DIR
#
#   -c CONF      PYTORCH_CUDA_ALLOC_CONF for both sides (PyTorch reads it; so
#                does cudapool, CUDAPOOL_CONF being unset), so that each side
#                runs in the configuration that matches the other's, as
#                PyTorch's test_cuda_expandable_segments.py runs test_cuda.py.
#                The two matching pairs:
#                  -c expandable_segments:False  native's default against
#                                cudapool's ordinary segments
#                  -c expandable_segments:True   native's expandable segments
#                                against cudapool's default (expandable
#                                segments with stitching)
#                Give each pair its own OUT_DIR: report.py merges the runs of
#                one directory by test file. Without -c both sides run with
#                their own defaults (or with PYTORCH_CUDA_ALLOC_CONF as set).
#   -k EXPR      pytest -k expression
#   -s FILE      selection file, one per line ('#' starts a comment):
#                  Class::test        exactly that test (a device-type class also
#                                     matches ClassCUDA and test_cuda)
#                  Class::test*       also its parametrized variants (test_<suffix>)
#                  file.py::Class::test  a pytest node id, passed as is
#                (select_tests.py writes these). Expanded against `pytest --collect-only`.
#   -m MODES     "native cudapool" (default), "native" or "cudapool"
#   -t SECONDS   timeout of one pytest run (default 1800); pytest is sent SIGINT
#                then (so the XML of the tests run so far is still written),
#                SIGKILL 60 s later
#   -T SECONDS   per-test timeout when pytest-timeout is importable (default 600)
#   -n NAME      name of the output files (default: TEST_FILE's name without .py)
#   -x ARGS      extra pytest arguments (one string, split on spaces)
#
# Output in OUT_DIR, for each mode: NAME.MODE.xml (pytest --junitxml),
# NAME.MODE.log, NAME.MODE.run (rc, seconds, timeout), and NAME.cudapool.installs
# (one line per Python process that installed cudapool, or failed to);
# NAME.selection (the node ids run), NAME.unmatched (selection lines that
# matched no collected test), NAME.env (torch, GPU), NAME.conf (the
# PYTORCH_CUDA_ALLOC_CONF both sides ran with; report.py prints it).
#
# The test files come from a checkout of PyTorch's test/ directory (for
# example in .ref/pytorch-tests/, which select_tests.py reads by default;
# not part of this repository). PyTorch's tests need pytest, expecttest,
# numpy and (test_cuda.py) psutil; without network, bring them with
# `pip download` elsewhere and `pip install --no-index --find-links`, or put them
# in python/gpu/.pydeps (added to PYTHONPATH when present).
#
# Then:  python3 gpu/pytorch_tests/report.py OUT_DIR -o REPORT.md (the full
# report; docs/pytorch-tests.md summarizes it)
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
PY=${PYTHON:-python3}

kexpr=""; selfile=""; modes="native cudapool"; run_timeout=1800; test_timeout=600; name=""; extra=""
conf=""; conf_set=0
usage() { sed -n '2,/^[^#]/p' "$0" | sed -n 's/^# \{0,1\}//p'; exit 2; }
while getopts "c:k:s:m:t:T:n:x:h" opt; do
    case "$opt" in
        c) conf=$OPTARG; conf_set=1 ;;
        k) kexpr=$OPTARG ;;
        s) selfile=$OPTARG ;;
        m) modes=$OPTARG ;;
        t) run_timeout=$OPTARG ;;
        T) test_timeout=$OPTARG ;;
        n) name=$OPTARG ;;
        x) extra=$OPTARG ;;
        *) usage ;;
    esac
done
shift $((OPTIND - 1))
[ $# -eq 2 ] || usage
test_file=$1
out=$2
[ -f "$test_file" ] || { echo "FATAL: no test file $test_file"; exit 2; }
[ -z "$selfile" ] || [ -f "$selfile" ] || { echo "FATAL: no selection file $selfile"; exit 2; }
for m in $modes; do
    case "$m" in native|cudapool) ;; *) echo "FATAL: unknown mode $m"; exit 2 ;; esac
done
test_dir=$(cd "$(dirname "$test_file")" && pwd)
test_base=$(basename "$test_file")
[ -n "$name" ] || name=${test_base%.py}
mkdir -p "$out"
out=$(cd "$out" && pwd)
[ -z "$selfile" ] || selfile=$(cd "$(dirname "$selfile")" && pwd)/$(basename "$selfile")

pypath="$HERE/site:$REPO/python"  # site/ only: the scripts here stay out of the tests' imports
[ -d "$REPO/python/gpu/.pydeps" ] && pypath="$pypath:$REPO/python/gpu/.pydeps"
export PYTHONPATH="$pypath${PYTHONPATH:+:$PYTHONPATH}"
unset CUDAPOOL_BACKEND CUDAPOOL_CONF CUDAPOOL_AUTOINSTALL CUDAPOOL_AUTOINSTALL_LOG
if [ "$conf_set" = 1 ]; then
    if [ -n "${PYTORCH_CUDA_ALLOC_CONF:-}${PYTORCH_ALLOC_CONF:-}" ]; then
        echo "note: -c replaces PYTORCH_CUDA_ALLOC_CONF/PYTORCH_ALLOC_CONF from the environment"
    fi
    unset PYTORCH_ALLOC_CONF
    export PYTORCH_CUDA_ALLOC_CONF=$conf
    echo "both sides run with PYTORCH_CUDA_ALLOC_CONF=$conf"
elif [ -n "${PYTORCH_CUDA_ALLOC_CONF:-}${PYTORCH_ALLOC_CONF:-}" ]; then
    echo "WARNING: PYTORCH_CUDA_ALLOC_CONF/PYTORCH_ALLOC_CONF is set; both modes run with it"
fi

# A private pytest configuration: nothing from the checkout's ini files, no cache in .ref.
ini="$out/pytest.ini"
printf '[pytest]\njunit_family = xunit1\n' >"$ini"
pytest_base=("$PY" -m pytest -c "$ini" --rootdir "$test_dir" --confcutdir "$test_dir" -p no:cacheprovider -q -rfEsxX)

missing=$("$PY" - <<'PYEOF'
import importlib.util
print(" ".join(m for m in ("torch", "pytest", "expecttest", "numpy", "psutil") if importlib.util.find_spec(m) is None))
PYEOF
)
if [ -n "$missing" ]; then
    echo "WARNING: missing Python modules: $missing (PyTorch's test files import them; see the header of $0)"
    case " $missing " in *" torch "*|*" pytest "*) echo "FATAL: cannot run without torch and pytest"; exit 1 ;; esac
fi
if "$PY" -c 'import pytest_timeout' 2>/dev/null; then
    pytest_base+=(--timeout "$test_timeout")
else
    echo "note: pytest-timeout is not installed: no per-test timeout (the run's timeout, $run_timeout s, still applies)"
fi
"$PY" - >"$out/$name.env" 2>&1 <<'PYEOF'
import torch
print("torch", torch.__version__, "CUDA", torch.version.cuda)
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"GPU {i}: {p.name}, {p.total_memory / 2**30:.1f} GiB")
PYEOF
cat "$out/$name.env"
printf '%s\n' "${PYTORCH_CUDA_ALLOC_CONF:-${PYTORCH_ALLOC_CONF:-}}" >"$out/$name.conf"

# cudapool: build the C++ class once (cached) before the run, and fail early.
case " $modes " in *" cudapool "*)
    if ! CUDAPOOL_AUTOINSTALL=1 CUDAPOOL_AUTOINSTALL_STRICT=1 "$PY" -c '
import sys, cudapool, torch
assert cudapool.installed() and cudapool.mode() == "class", cudapool.mode()
torch.ones(1, device="cuda")
print("cudapool:", cudapool.library_path(), "mode", cudapool.mode())'; then
        echo "FATAL: cudapool cannot be installed through sitecustomize (see above)"
        exit 1
    fi ;;
esac

# The selection: node ids, expanded against what pytest collects (natively).
sel_args=()
if [ -n "$kexpr" ]; then
    sel_args+=(-k "$kexpr")
fi
if [ -n "$selfile" ]; then
    echo "=== collecting $test_base"
    (cd "$test_dir" && "${pytest_base[@]}" --collect-only "$test_base" ${extra:+$extra}) >"$out/$name.collected" 2>&1
    "$PY" "$HERE/select_tests.py" expand --collected "$out/$name.collected" --selection "$selfile" --file "$test_base" --source "$test_dir/$test_base" \
        --out "$out/$name.selection" --unmatched "$out/$name.unmatched" || { echo "FATAL: expanding $selfile failed"; exit 1; }
    n=$(grep -c . "$out/$name.selection" || true)
    echo "selection: $n tests ($(grep -c . "$out/$name.unmatched" || true) selection lines matched nothing: $out/$name.unmatched)"
    [ "$n" -gt 0 ] || { echo "FATAL: the selection is empty (see $out/$name.collected)"; exit 1; }
    mapfile -t ids <"$out/$name.selection"
    sel_args+=("${ids[@]}")
else
    sel_args+=("$test_base")
fi

status=0
for mode in $modes; do
    xml="$out/$name.$mode.xml"
    log="$out/$name.$mode.log"
    rm -f "$xml"
    envs=(-u CUDAPOOL_AUTOINSTALL -u CUDAPOOL_AUTOINSTALL_LOG)
    if [ "$mode" = cudapool ]; then
        : >"$out/$name.cudapool.installs"
        envs=(CUDAPOOL_AUTOINSTALL=1 "CUDAPOOL_AUTOINSTALL_LOG=$out/$name.cudapool.installs")
    fi
    echo "=== $mode: $test_base (log: $log)"
    t0=$(date +%s)
    (cd "$test_dir" && timeout -s INT -k 60 "$run_timeout" env "${envs[@]}" \
        "${pytest_base[@]}" --junitxml "$xml" ${extra:+$extra} "${sel_args[@]}") >"$log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - t0 ))
    timed_out=0
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && timed_out=1
    printf 'rc=%s seconds=%s timeout=%s timed_out=%s\n' "$rc" "$secs" "$run_timeout" "$timed_out" >"$out/$name.$mode.run"
    tail -n 3 "$log"
    echo "--- $mode: rc=$rc in ${secs}s$([ "$timed_out" -eq 1 ] && echo " (TIMED OUT)")"
    if [ "$mode" = cudapool ]; then
        echo "    cudapool installed in $(grep -c '^ok ' "$out/$name.cudapool.installs" || true) process(es), failed in $(grep -c '^FAILED ' "$out/$name.cudapool.installs" || true)"
    fi
    [ -f "$xml" ] || { echo "    no JUnit XML was written"; status=1; }
done
echo "results in $out; report: $PY $HERE/report.py $out -o $REPO/docs/pytorch-tests.md"
exit $status
