#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# run_bench.sh - cudapool's benchmark suite, on a GPU machine (docs/benchmarks.md).
#
#   bash bench/run_bench.sh            (from anywhere; QUICK=1 for a short run)
#
# Compares cudapool (its defaults: expandable segments with stitching; and
# cudapool_exp, expandable segments without stitching, as native's) with
# PyTorch's allocator in three configurations (native, expandable_segments:True,
# backend:cudaMallocAsync), each in a fresh process, same inputs, same run:
#   1. C level (bench/workloads.h): 4 KiB hot malloc+free loop, mixed sizes
#      with 256 live blocks, 4 and 8 threads on their own streams, and a
#      replay of demo/trace.txt (peak reserved vs allocated). cudapool through
#      bench/c_bench.c + lib/libcudapool.so; PyTorch's allocators through
#      bench/native_bench.cpp + libc10_cuda. Then, once per run, the hot and
#      mixed loops of cudapool and native in one process, reps alternated
#      (bench/pair_bench.c: both meet the host in the same state). Part
#      "traces": replays of the LLM serving trace (bench/kvcache.py), on one
#      stream and with a prefill stream, and of demo/fsdp2.txt.gz.
#   2. torch level (bench/torch_bench.py): GPT-2 training with variable
#      sequence lengths, CUDA graph capture/replay, torch.empty + free; each
#      run a ring of one fresh process per configuration taking turns rep by
#      rep on one CPU (bench/turn_ring.py; BENCH_TORCH_RING=0: the processes
#      one after another instead), so that rep k of every configuration
#      meets the host in the same state (docs/benchmarks.md). Then,
#      once per run, the torch.empty loops and the graph captures of native
#      and cudapool alternating rep by rep in one process, and the same
#      with expandable segments on both sides (part "alt": torch_bench.py's
#      alt section, as cudapool and as cudapool_exp); torch.compile's
#      reduce-overhead rows, decoding with a static KV cache and a small
#      compiled model's calls, native and cudapool alternating in one
#      process (part "altcompile": torch_bench.py's altcompile section),
#      and (part "turns") native and cudapool (and both with
#      expandable segments) as two processes taking turns on one CPU
#      (bench/turn_pair.sh: rep k of both runs back to back).
#   3. FSDP2 training of a small GPT-2 on 2 GPUs under torchrun
#      (bench/fsdp2_bench.py: CPU pinning per rank, CUDA-event step timing),
#      native and cudapool, where the machine has 2 GPUs or more; and once
#      per run the two launches taking turns step by step (turn_pair.sh).
# Every configuration runs REPEATS times (default 3), each in a fresh
# process, the configurations interleaved (run 1 of each, then run 2 of
# each, ...); training TRAIN_RUNS times (default 5), FSDP2 FSDP_RUNS
# times (default 5) and the in-process pairs of part alt ALT_RUNS times
# (default 10: a process takes about 10 s, and the capture row's 2% target
# needs more processes than three to resolve against the host's spread
# between processes). The report shows the median and min-max of the runs.
# then prints the comparison table (bench/report.py), writes
# bench/RESULTS.md and the README's performance section (between
# <!-- perf:start --> and <!-- perf:end -->).
#
# A full run takes more than 10 minutes; it can run in parts that add to
# the same results, e.g. (OUT must then survive between the parts: a path
# in the checkout such as build/bench-out)
#   OUT=build/bench-out BENCH_PARTS="c traces" bash bench/run_bench.sh
#   OUT=build/bench-out BENCH_PARTS=torch BENCH_KEEP=1 bash bench/run_bench.sh
#   OUT=build/bench-out BENCH_PARTS="train floor fsdp" BENCH_KEEP=1 bash bench/run_bench.sh
# and BENCH_REPEAT_FROM=N makes a part start at run N (BENCH_REPEATS=2, then
# BENCH_REPEAT_FROM=3 BENCH_REPEATS=3, splits the 3 runs of a part in two;
# part alt's with BENCH_ALT_RUNS the same way).
# Each invocation reports on everything under OUT so far.
#
# Needs: lib/libcudapool.so built beforehand (`make`, where Go is; copy lib/
# to the GPU machine if it has no Go); python3 with CUDA PyTorch; gcc, g++.
# No network.
# Everything lands in $OUT (default /tmp/cudapool-bench-out): results/*.json
# (the raw result lines), logs/*.log, report.txt, RESULTS.md, README.md.
# The table is printed last.
#
# Environment: OUT, PYTHON (python3), CUDA_HOME (/usr/local/cuda), QUICK=1,
# BENCH_BUDGET_S (no new step starts after this many seconds, default 480),
# BENCH_HARD_S (every step is cut off by then, default 560),
# BENCH_C_ARGS / BENCH_TORCH_ARGS (extra arguments for the programs),
# BENCH_SIM=1 (c_bench on cudapool's simulator: for testing without a GPU),
# BENCH_UPDATE_REPO=0 (leave bench/RESULTS.md and README.md alone: write the
# results file and an updated copy of the README to $OUT only),
# BENCH_REPEATS (3), BENCH_TRAIN_RUNS (5), BENCH_FSDP_RUNS (5), BENCH_ALT_RUNS (10;
# BENCH_REPEATS with QUICK=1),
# BENCH_PARTS (the parts to run, default "c traces torch alt altcompile turns train floor fsdp"),
# BENCH_TORCH_RING (1), BENCH_TURN_CPU (the CPU of the rings and turn
# pairs, default 2; 0 where there are 2 CPUs or fewer), BENCH_TURN_PIN
# (thread: the default, only the main
# threads are pinned; process: every thread, which pairs tighter but makes
# cudapool's other threads compete with its main one),
# BENCH_KEEP=1 (keep the results already under $OUT: add to them),
# BENCH_REPEAT_FROM (1: the first run number of this invocation).
# shellcheck disable=SC2317  # the step functions are called through run_step
set -u
cd "$(dirname "$0")/.." || exit 1
REPO=$PWD
OUT=${OUT:-/tmp/cudapool-bench-out}
RES=$OUT/results
LOGS=$OUT/logs
BUILD=$REPO/build/bench
PY=${PYTHON:-python3}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
BUDGET=${BENCH_BUDGET_S:-480}
HARD=${BENCH_HARD_S:-560}
QUICK=${QUICK:-0}
CONFIGS=(native expandable async cudapool cudapool_exp)
REPEATS=${BENCH_REPEATS:-3}
FROM=${BENCH_REPEAT_FROM:-1} # first run number of this invocation (to split the runs)
TRAIN_RUNS=${BENCH_TRAIN_RUNS:-5}
FSDP_RUNS=${BENCH_FSDP_RUNS:-5}
ALT_RUNS=${BENCH_ALT_RUNS:-$([ "$QUICK" = 1 ] && echo "$REPEATS" || echo 10)}
PARTS=" ${BENCH_PARTS:-c traces torch alt altcompile turns train floor fsdp} "
part() { [[ $PARTS == *" $1 "* ]]; }
RING=${BENCH_TORCH_RING:-1}
NCPU=$(nproc 2>/dev/null || echo 1)
TURN_CPU=${BENCH_TURN_CPU:-$((NCPU > 2 ? 2 : 0))}

mkdir -p "$RES" "$LOGS" "$BUILD"
if [ "${BENCH_KEEP:-0}" != 1 ] && [ "$FROM" -le 1 ]; then # a later run number adds to the results
    rm -f "$RES"/*.json "$RES"/*.jsonl "$LOGS"/*.log "$OUT/report.txt"
fi
STEPS=$RES/steps.jsonl
touch "$STEPS"

# run_name BASE REP: the step (and result file) name of run REP of BASE:
# the first run keeps BASE, the others are BASE_rREP.
run_name() { if [ "$2" -eq 1 ]; then echo "$1"; else echo "$1_r$2"; fi; }
T0=$(date +%s)
SUMMARY=()

# The allocator settings come from each step alone.
unset PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF CUDAPOOL_CONF CUDAPOOL_BACKEND
export CUDAPOOL_LIBRARY=$REPO/lib/libcudapool.so
export PYTHONUNBUFFERED=1

alloc_conf() { # the PYTORCH_CUDA_ALLOC_CONF of a config ("" = unset)
    case $1 in
    expandable) echo "expandable_segments:True" ;;
    async) echo "backend:cudaMallocAsync" ;;
    *) echo "" ;;
    esac
}

elapsed() { echo $(($(date +%s) - T0)); }

json_str() { # a JSON string literal (no python needed)
    local s=${1//\\/\\\\}
    s=${s//\"/\\\"}
    s=${s//$'\n'/ }
    s=${s//$'\t'/ }
    s=${s//$'\r'/ }
    printf '"%s"' "$s"
}

record_step() { # NAME STATUS SECS REASON
    printf '{"kind":"step","name":%s,"status":%s,"secs":%s,"reason":%s}\n' \
        "$(json_str "$1")" "$(json_str "$2")" "$3" "$(json_str "$4")" >>"$STEPS"
    SUMMARY+=("$1|$2|$3|$4")
}

# run_step NAME LIMIT OUTFILE CMD...: runs CMD with a time limit (capped by
# the hard deadline); stdout goes to OUTFILE (the log when OUTFILE is ""),
# stderr to logs/NAME.log. Shell functions run without a time limit.
run_step() {
    local name=$1 limit=$2 outfile=$3
    shift 3
    local log=$LOGS/$name.log now left t rc dt
    now=$(elapsed)
    left=$((HARD - now))
    if [ "$now" -ge "$BUDGET" ] || [ "$left" -lt 20 ]; then
        record_step "$name" skipped 0 "time budget spent (${now}s elapsed)"
        echo "=== $name: skipped, time budget spent (${now}s)"
        return 1
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "=== $name (limit ${limit}s, at ${now}s)"
    t=$(date +%s)
    if declare -F "$1" >/dev/null; then
        "$@" >"$log" 2>&1
        rc=$?
    elif [ -n "$outfile" ]; then
        timeout -k 5 "$limit" "$@" >"$outfile" 2>"$log"
        rc=$?
    else
        timeout -k 5 "$limit" "$@" >"$log" 2>&1
        rc=$?
    fi
    dt=$(($(date +%s) - t))
    if [ "$rc" -eq 0 ]; then
        record_step "$name" ok "$dt" ""
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        record_step "$name" timeout "$dt" "timed out after ${limit}s (logs/$name.log)"
    else
        record_step "$name" failed "$dt" "exit code $rc (logs/$name.log)"
    fi
    tail -n 4 "$log" 2>/dev/null | cut -c1-200 | sed 's/^/    /'
    return "$rc"
}

# ---- 1. the machine -------------------------------------------------------

collect_meta() {
    local gpu drv mem cpu commit dirty
    gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
    drv=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1)
    mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader 2>/dev/null | head -n 1)
    cpu=$(grep -m 1 'model name' /proc/cpuinfo 2>/dev/null | sed 's/.*: *//')
    # The library's own record first (lib/BUILD_COMMIT, written by make where
    # it was built): a checkout copied to the GPU machine may carry a stale .git.
    commit=${BENCH_GIT_COMMIT:-}
    dirty=false
    if [ -z "$commit" ] && [ -s lib/BUILD_COMMIT ]; then
        commit=$(head -n 1 lib/BUILD_COMMIT)
        grep -qx dirty lib/BUILD_COMMIT && dirty=true
    elif [ -z "$commit" ]; then
        commit=$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null)
        [ -n "$(git -C "$REPO" status --porcelain 2>/dev/null | head -n 1)" ] && dirty=true
    fi
    # torch's version, include dir and C++ ABI; no CUDA initialization.
    "$PY" - >"$BUILD/torch_env.txt" <<'EOF'
import os, torch
print("TORCH_DIR=" + os.path.dirname(torch.__file__))
print("TORCH_ABI=%d" % int(torch._C._GLIBCXX_USE_CXX11_ABI))
print("TORCH_VERSION=" + torch.__version__)
print("TORCH_CUDA=" + str(torch.version.cuda))
EOF
    local rc=$?
    cat "$BUILD/torch_env.txt"
    TORCH_DIR=$(sed -n 's/^TORCH_DIR=//p' "$BUILD/torch_env.txt")
    TORCH_ABI=$(sed -n 's/^TORCH_ABI=//p' "$BUILD/torch_env.txt")
    TORCH_ABI=${TORCH_ABI:-1}
    local tv tc
    tv=$(sed -n 's/^TORCH_VERSION=//p' "$BUILD/torch_env.txt")
    tc=$(sed -n 's/^TORCH_CUDA=//p' "$BUILD/torch_env.txt")
    printf '{"kind":"meta","date_utc":%s,"gpu":%s,"driver":%s,"gpu_memory":%s,"host_cpu":%s,"torch_version":%s,"torch_cuda":%s,"git_commit":%s,"git_dirty":%s}\n' \
        "$(json_str "$(date -u '+%Y-%m-%d %H:%M UTC')")" "$(json_str "$gpu")" "$(json_str "$drv")" \
        "$(json_str "$mem")" "$(json_str "$cpu")" "$(json_str "$tv")" "$(json_str "$tc")" \
        "$(json_str "$commit")" "$dirty" >"$META_FILE"
    echo "GPU: ${gpu:-none found}, driver ${drv:-?}; PyTorch ${tv:-?}"
    return "$rc"
}
TORCH_DIR=""
TORCH_ABI=1
META_FILE=$RES/meta.json
if [ "$PARTS" = " fsdp " ] && [ -s "$RES/meta.json" ]; then
    # FSDP2 alone, added to another machine's results (it needs 2 GPUs): the
    # header stays that machine's (the FSDP note names its own device); this
    # machine's description goes to logs/meta_fsdp.log.
    META_FILE=$LOGS/meta_fsdp.json
fi
run_step meta 0 "" collect_meta

# ---- 2. build -------------------------------------------------------------

build_c() {
    if [ ! -f lib/libcudapool.so ]; then
        echo "lib/libcudapool.so is missing: run make where Go is, and copy lib/ here"
        return 1
    fi
    gcc -std=c11 -O2 -Wall -I include -I bench bench/c_bench.c -o "$BUILD/c_bench" \
        -L lib -lcudapool -ldl -pthread -Wl,-rpath,"$REPO/lib"
}

build_native() {
    if [ -z "$TORCH_DIR" ] || [ ! -d "$TORCH_DIR/include" ]; then
        echo "torch's include directory not found (TORCH_DIR='$TORCH_DIR')"
        return 1
    fi
    # CUDA headers: the toolkit's, else (or then) those of torch's pip packages.
    local sys_inc=() pip_inc=() d
    [ -d "$CUDA_HOME/include" ] && sys_inc=(-I "$CUDA_HOME/include")
    for d in "$TORCH_DIR"/../nvidia/cu*/include "$TORCH_DIR"/../nvidia/cuda_runtime/include; do
        [ -d "$d" ] && pip_inc+=(-I "$d")
    done
    local order std extras inc
    for order in system pip; do
        if [ "$order" = system ]; then
            inc=(-I bench -I "$TORCH_DIR/include" "${sys_inc[@]}" "${pip_inc[@]}")
        else
            if [ ${#pip_inc[@]} -eq 0 ] || [ ${#sys_inc[@]} -eq 0 ]; then continue; fi  # nothing new to try
            inc=(-I bench -I "$TORCH_DIR/include" "${pip_inc[@]}" "${sys_inc[@]}")
        fi
        for std in c++17 c++20; do
            for extras in -DNB_EXTRAS -DNB_PLAIN; do
                echo "--- g++ -std=$std $extras (CUDA headers: $order first)"
                if timeout 240 g++ -std="$std" -O2 -D_GLIBCXX_USE_CXX11_ABI="$TORCH_ABI" "$extras" "${inc[@]}" \
                    bench/native_bench.cpp -o "$BUILD/native_bench" \
                    -L "$TORCH_DIR/lib" -lc10_cuda -lc10 -Wl,-rpath,"$TORCH_DIR/lib" -Wl,--allow-shlib-undefined -pthread; then
                    echo "built native_bench with -std=$std $extras (CUDA headers: $order first)"
                    NB_FLAGS=(-std="$std" -O2 -D_GLIBCXX_USE_CXX11_ABI="$TORCH_ABI" "$extras" "${inc[@]}")
                    return 0
                fi
            done
        done
    done
    return 1
}

# bench/pair_bench.c: both allocators in one process, their reps alternated
# (c_bench.c and native_bench.cpp compiled without their mains, with the
# flags that built native_bench).
NB_FLAGS=()
build_pair() {
    if [ ${#NB_FLAGS[@]} -eq 0 ]; then
        echo "native_bench was not built"
        return 1
    fi
    gcc -std=c11 -O2 -Wall -I include -I bench -DWL_PAIR_PREFIX=cp -c bench/c_bench.c -o "$BUILD/pair_cp.o" &&
        g++ "${NB_FLAGS[@]}" -DWL_PAIR_PREFIX=nat -c bench/native_bench.cpp -o "$BUILD/pair_nat.o" &&
        gcc -std=c11 -O2 -Wall -c bench/pair_bench.c -o "$BUILD/pair_main.o" &&
        g++ "$BUILD/pair_main.o" "$BUILD/pair_cp.o" "$BUILD/pair_nat.o" -o "$BUILD/pair_bench" \
            -L lib -lcudapool -L "$TORCH_DIR/lib" -lc10_cuda -lc10 -Wl,-rpath,"$REPO/lib" -Wl,-rpath,"$TORCH_DIR/lib" \
            -Wl,--allow-shlib-undefined -ldl -pthread
}

if part c || part traces; then
    rm -f "$BUILD/c_bench" "$BUILD/native_bench" "$BUILD/pair_bench"
    run_step build_c 0 "" build_c
    run_step build_native 0 "" build_native
    run_step build_pair 0 "" build_pair
fi

# ---- 3. C level -----------------------------------------------------------

C_ARGS=(--trace demo/trace.txt)
T_ARGS=()
A_ARGS=() # the altcompile part's
if [ "$QUICK" = 1 ]; then
    C_ARGS+=(--hot-pairs 200000 --mixed-pairs 50000 --reps 3 --thread-secs 0.2 --thread-reps 2 --trace-repeats 3)
    T_ARGS+=(--warmup 3 --steps 10 --empty-pairs 20000 --mixed-pairs 10000 --reps 3 --graph-replays 10)
    A_ARGS+=(--alt-decode 2 --decode-tokens 16 --alt-compiled 2 --compiled-calls 100)
fi
# shellcheck disable=SC2206  # word splitting intended
C_ARGS+=(${BENCH_C_ARGS:-})
# shellcheck disable=SC2206
T_ARGS+=(${BENCH_TORCH_ARGS:-})

c_run() { # CFG REP [BASE ARGS...]: run REP of CFG's C program as step BASE_CFG (default c_CFG), with C_ARGS then ARGS
    local cfg=$1 rep=$2 base=${3:-c} prog envs conf name args
    shift $(($# < 3 ? $# : 3))
    args=("${C_ARGS[@]}" "$@") # (the last --trace and --sections win)
    name=$(run_name "${base}_$cfg" "$rep")
    if [ "$cfg" = cudapool ] || [ "$cfg" = cudapool_exp ]; then
        prog=$BUILD/c_bench
        envs=(env -u PYTORCH_CUDA_ALLOC_CONF)
        [ "$cfg" = cudapool_exp ] && envs+=(CUDAPOOL_CONF=expandable_segments:True,stitch:False)
        # BENCH_SIM=1: cudapool's simulator (to test this script without a GPU)
        [ "${BENCH_SIM:-0}" = 1 ] && envs+=(CUDAPOOL_BACKEND=sim)
    else
        prog=$BUILD/native_bench
        conf=$(alloc_conf "$cfg")
        if [ -n "$conf" ]; then envs=(env "PYTORCH_CUDA_ALLOC_CONF=$conf"); else envs=(env -u PYTORCH_CUDA_ALLOC_CONF); fi
    fi
    if [ ! -x "$prog" ]; then
        record_step "$name" skipped 0 "$(basename "$prog") was not built (logs/build_*.log)"
        echo "=== $name: skipped, $(basename "$prog") was not built"
        return
    fi
    run_step "$name" 120 "$RES/$name.json" "${envs[@]}" "$prog" --config "$cfg" "${args[@]}"
}
if part c; then
    for rep in $(seq "$FROM" "$REPEATS"); do
        for cfg in "${CONFIGS[@]}"; do c_run "$cfg" "$rep"; done
        name=$(run_name pair "$rep")
        if [ -x "$BUILD/pair_bench" ] && [ "${BENCH_SIM:-0}" != 1 ]; then
            run_step "$name" 120 "$RES/$name.json" env -u PYTORCH_CUDA_ALLOC_CONF -u CUDAPOOL_CONF "$BUILD/pair_bench"
        else
            record_step "$name" skipped 0 "pair_bench was not built (logs/build_pair.log), or BENCH_SIM=1"
        fi
    done
fi

# The other allocation traces (part "traces"), replayed as demo/trace.txt is:
# the LLM serving trace of bench/kvcache.py (seeded: the same bytes on every
# machine), on one stream and with prefills on a stream of their own, and
# the recorded FSDP2 rank (demo/fsdp2.txt.gz). Their results go to
# ctrace_LABEL_CFG[_rN].json, which bench/report.py reads as the trace LABEL's.
gen_traces() {
    "$PY" bench/kvcache.py "$BUILD/kv1.txt" && "$PY" bench/kvcache.py "$BUILD/kv2.txt" --prefill-stream 1 &&
        gzip -dc demo/fsdp2.txt.gz >"$BUILD/fsdp2.txt"
}
if part traces && run_step gen_traces 0 "" gen_traces; then
    T_PASSES=3
    [ "$QUICK" = 1 ] && T_PASSES=1
    for rep in $(seq "$FROM" "$REPEATS"); do
        for label in kv1 kv2 fsdp2; do
            for cfg in "${CONFIGS[@]}"; do
                c_run "$cfg" "$rep" "ctrace_$label" --sections trace --trace "$BUILD/$label.txt" \
                    --trace-repeats "$T_PASSES"
            done
        done
    done
fi

# ---- 4. torch level -------------------------------------------------------

# The floor: torch.empty(4 KiB) through CUDAPluggableAllocator with a trivial
# C allocator behind it (bench/floor_alloc.c), run with each round.
build_floor() { gcc -O2 -Wall -shared -fPIC bench/floor_alloc.c -o "$BUILD/libfloor.so" -ldl -pthread; }
part floor && run_step build_floor 0 "" build_floor
if part torch || part floor; then
    for rep in $(seq "$FROM" "$REPEATS"); do
        if part torch && [ "$RING" = 1 ]; then
            # One process per config, taking turns rep by rep on one CPU
            # (bench/turn_ring.py), the order rotated from run to run.
            runs=()
            for i in "${!CONFIGS[@]}"; do
                cfg=${CONFIGS[$(((i + rep - 1) % ${#CONFIGS[@]}))]}
                runs+=("$(run_name "torch_$cfg" "$rep")=$cfg")
            done
            name=$(run_name torch_ring "$rep")
            run_step "$name" 400 "" "$PY" bench/turn_ring.py --cpu "$TURN_CPU" --pin "${BENCH_TURN_PIN:-thread}" \
                --limit 390 --out-dir "$RES" --log-dir "$LOGS" "${runs[@]}" -- "${T_ARGS[@]}"
        elif part torch; then
            for cfg in "${CONFIGS[@]}"; do
                name=$(run_name "torch_$cfg" "$rep")
                run_step "$name" 180 "$RES/$name.json" "$PY" bench/torch_bench.py "$cfg" "${T_ARGS[@]}"
            done
        fi
        if part floor; then
            name=$(run_name torch_floor "$rep")
            run_step "$name" 60 "$RES/$name.json" env FLOOR_LIB="$BUILD/libfloor.so" \
                "$PY" bench/torch_bench.py floor --sections empty "${T_ARGS[@]}"
        fi
    done
fi

# The torch rows paired: native and cudapool (and both with expandable
# segments) as two processes on one CPU, taking turns after every timed rep
# (bench/turn_pair.sh), so that rep k of both runs back to back; once per
# run, who goes first alternating.
if part turns; then
    for rep in $(seq "$FROM" "$REPEATS"); do
        first=base
        [ $((rep % 2)) = 0 ] && first=test
        for kp in native:cudapool expandable:cudapool_exp; do
            b=${kp%%:*} t=${kp#*:}
            name=$(run_name "turns_${b}_$t" "$rep")
            run_step "$name" 300 "" env TURN_LIMIT=290 TURN_PIN="${BENCH_TURN_PIN:-thread}" \
                bash bench/turn_pair.sh "$TURN_CPU" "$b/$t" "$rep" "$b" "$t" \
                "$first" "$RES/$name.json" "${T_ARGS[@]}"
        done
    done
fi

# The torch.empty and capture rows paired within one process: PyTorch's
# allocator and cudapool alternating rep by rep (torch_bench.py's alt
# section: cudapool's class hands allocate(), and each native capture, to
# the allocator it replaced), the main thread pinned as in the turns; once
# per run. Then the same with expandable segments on both sides
# (cudapool_exp: the native side gets expandable_segments:True), the
# paired measure of the expandable capture row.
if part alt; then
    for rep in $(seq "$FROM" "$ALT_RUNS"); do
        name=$(run_name torch_alt "$rep")
        run_step "$name" 180 "$RES/$name.json" env BENCH_TURNS_PIN="$TURN_CPU" \
            "$PY" bench/torch_bench.py cudapool --sections alt "${T_ARGS[@]}"
        name=$(run_name torch_alt_exp "$rep")
        run_step "$name" 180 "$RES/$name.json" env BENCH_TURNS_PIN="$TURN_CPU" \
            "$PY" bench/torch_bench.py cudapool_exp --sections alt "${T_ARGS[@]}"
    done
fi

# torch.compile(mode="reduce-overhead") through CUDA graph trees, paired
# within one process: graph-tree decoding with a static KV cache (ms per
# token) and a small compiled model's calls (us per call), each side with
# its own compiled function and graph tree, the sides alternating rep by
# rep (torch_bench.py's altcompile section); once per run. Most of its time
# is torch.compile's (the first run's cold compile, then its caches), so the
# main thread is not pinned: the compiler's worker processes would inherit
# its one CPU.
if part altcompile; then
    for rep in $(seq "$FROM" "$REPEATS"); do
        name=$(run_name torch_altcompile "$rep")
        run_step "$name" 420 "$RES/$name.json" \
            "$PY" bench/torch_bench.py cudapool --sections altcompile "${T_ARGS[@]}" "${A_ARGS[@]}"
    done
fi

# Training time varies from process to process by more than the targets
# (and per-process samples are bimodal): training-only runs of every
# config, interleaved, until each has TRAIN_RUNS (the torch part's runs
# count when it ran here).
if part train; then
    first=1
    [ -f "$RES/torch_native.json" ] && first=$((REPEATS + 1))  # the torch part's runs train too
    [ "$first" -lt "$FROM" ] && first=$FROM
    for rep in $(seq "$first" "$TRAIN_RUNS"); do
        for cfg in "${CONFIGS[@]}"; do
            run_step "train_${cfg}_$rep" 90 "$RES/torch_${cfg}_train$rep.json" \
                "$PY" bench/torch_bench.py "$cfg" --sections train "${T_ARGS[@]}"
        done
    done
fi

# ---- 5. FSDP2 on 2 GPUs ---------------------------------------------------

if part fsdp; then
    ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
    if [ "${ngpu:-0}" -lt 2 ]; then
        record_step fsdp skipped 0 "needs 2 GPUs (found ${ngpu:-0})"
        echo "=== fsdp: skipped, needs 2 GPUs (found ${ngpu:-0})"
    else
        F_ARGS=()
        [ "$QUICK" = 1 ] && F_ARGS+=(--warmup 2 --steps 8)
        # shellcheck disable=SC2206
        F_ARGS+=(${BENCH_FSDP_ARGS:-})
        # The CPUs this process may use (nproc would honour OMP_NUM_THREADS).
        fcpus=$(taskset -pc $$ 2>/dev/null | sed 's/.*: *//')
        for rep in $(seq "$FROM" "$FSDP_RUNS"); do
            for cfg in native cudapool; do
                name=$(run_name "fsdp_$cfg" "$rep")
                run_step "$name" 150 "$RES/$name.json" env CUDA_VISIBLE_DEVICES=0,1 \
                    "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 bench/fsdp2_bench.py "$cfg" "${F_ARGS[@]}"
            done
            # The two launches taking turns step by step on the same GPUs and
            # CPUs (rank r of each on the same half of the CPUs).
            [ $((rep % 2)) = 0 ] && first=test || first=base
            name=$(run_name fsdp_turns "$rep")
            run_step "$name" 240 "" env CUDA_VISIBLE_DEVICES=0,1 TURN_RANKS=2 TURN_LIMIT=230 \
                TURN_PROG="-m torch.distributed.run --standalone --nproc_per_node=2 bench/fsdp2_bench.py" \
                bash bench/turn_pair.sh "${fcpus:--}" fsdp-native/cudapool "$rep" native cudapool "$first" \
                "$RES/$name.json" "${F_ARGS[@]}"
        done
    fi
fi

# ---- 6. report ------------------------------------------------------------

rm -f "$OUT/RESULTS.md" "$OUT/README.md"
if [ "${BENCH_UPDATE_REPO:-1}" = 0 ]; then
    [ -f README.md ] && cp README.md "$OUT/README.md"
    "$PY" bench/report.py --results "$RES" --md "$OUT/RESULTS.md" --readme "$OUT/README.md" >"$OUT/report.txt" 2>&1
    report_rc=$?
else
    "$PY" bench/report.py --results "$RES" --md bench/RESULTS.md --readme README.md >"$OUT/report.txt" 2>&1
    report_rc=$?
    cp bench/RESULTS.md "$OUT/RESULTS.md" 2>/dev/null
    [ -f README.md ] && cp README.md "$OUT/README.md"
fi

echo
echo "==== steps (logs and results in $OUT) ===="
for r in "${SUMMARY[@]}"; do
    IFS='|' read -r n st secs why <<<"$r"
    printf '%-18s %-8s %5ss  %s\n' "$n" "$st" "$secs" "$why"
done
echo "total: $(elapsed)s"
echo
echo "==== cudapool vs PyTorch's allocators ===="
cat "$OUT/report.txt"
[ "$report_rc" -eq 0 ] || echo "report.py failed (exit $report_rc)"
exit "$report_rc"
