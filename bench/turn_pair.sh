#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# turn_pair.sh - two bench/torch_bench.py processes pinned to one CPU,
# taking turns (BENCH_TURNS): only one runs its main thread at a time, and
# they hand the CPU over after every timed rep, so rep k of both runs back
# to back, to meet the host in one state (docs/benchmarks.md, "The
# measures"; a pair of cudapool against itself checks that it does).
#
#   bash bench/turn_pair.sh CPU KIND ROUND BASE TEST FIRST OUT [torch_bench args]
#
# BASE and TEST are torch_bench.py configs (e.g. native cudapool); FIRST
# (base or test) goes first. Their JSON lines, tagged KIND:ROUND:base and
# KIND:ROUND:test ("kind":"torch_turns"), go to OUT (one file); stderr to
# OUT.log. CPU is a taskset list ("-": no pinning). TURN_LIMIT (seconds,
# default 300) cuts both off; a process that waits longer than
# BENCH_TURNS_TIMEOUT (default the smaller of 120 and TURN_LIMIT/2) for its
# partner stops waiting, and when one process exits, however it ends, its
# partner is released at once. Exit status: 0 when both succeeded, else
# the first failure's (124: a time limit).
#
# TURN_PROG (default bench/torch_bench.py) is what python runs; for FSDP2
#   TURN_RANKS=2 TURN_PROG="-m torch.distributed.run --standalone
#   --nproc_per_node=2 bench/fsdp2_bench.py"
# gives each rank its own FIFOs, so that rank r of both launches takes turns
# (with CPU a list the ranks split, each launch the same way).
set -u
[ $# -ge 7 ] || { sed -n 8p "$0" >&2; exit 2; }
cpu=$1 kind=$2 rnd=$3 base=$4 test=$5 first=$6 out=$7
shift 7
case $first in base | test) ;; *) echo "FIRST must be base or test, not '$first'" >&2; exit 2 ;; esac
case $out in /*) ;; *) out=$PWD/$out ;; esac
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
limit=${TURN_LIMIT:-300}
export BENCH_TURNS_TIMEOUT=${BENCH_TURNS_TIMEOUT:-$((limit / 2 < 120 ? limit / 2 : 120))}
ranks=${TURN_RANKS:-1}
dir=$(mktemp -d) || exit 1
pb="" pt=""
# A TERM from outside (run_bench.sh's time limit) goes to the timeouts
# below (each in its own process group, so the outer one's kill misses
# them), which pass it on to their processes: none is left running.
stop() {
    local p
    for p in $pb $pt; do pkill -TERM -P "$p" 2>/dev/null; done
    wait
    rm -rf "$dir"
    exit 124
}
trap stop TERM INT HUP
trap 'rm -rf "$dir"' EXIT
# This script keeps every FIFO open, so that what is written to one stays
# there until read, even before its reader has opened it.
for ((r = 0; r < ranks; r++)); do
    mkfifo "$dir/a$r" "$dir/b$r" || exit 1
    exec {fd}<>"$dir/a$r" {fd}<>"$dir/b$r"
done
a="$dir/a{rank}" b="$dir/b{rank}" # torch_bench.Turns puts in the rank
rb="$a:$b:second" rt="$b:$a:first"
[ "$first" = base ] && rb="$a:$b:first" rt="$b:$a:second"
read -r -a prog <<<"${TURN_PROG:-bench/torch_bench.py}"
pin=(taskset -c "$cpu")
[ "$cpu" = - ] && pin=()
# TURN_PIN=thread: only torch_bench.py's main thread is pinned (CPU a
# comma list), once its other threads (Go's, CUDA's) have started.
if [ "${TURN_PIN:-}" = thread ]; then
    pin=()
    export BENCH_TURNS_PIN=$cpu
fi

# run_one ROLE CONFIG TURNS PARTNER_IN [torch_bench args]: when the process
# exits, an "e" in each of its partner's FIFOs (opened read-write, so this
# never blocks) tells the partner not to wait for it.
run_one() {
    local role=$1 cfg=$2 t=$3 pin_in=$4 rc r
    shift 4
    BENCH_TURNS=$t BENCH_TURNS_TAG="$kind:$rnd:$role" timeout -k 5 "$limit" \
        "${pin[@]}" "$PY" "${prog[@]}" "$cfg" "$@" >"$dir/$role.out" 2>"$dir/$role.err"
    rc=$?
    for ((r = 0; r < ranks; r++)); do printf e 1<>"$dir/$pin_in$r"; done
    return $rc
}
run_one base "$base" "$rb" b "$@" &
pb=$!
run_one test "$test" "$rt" a "$@" &
pt=$!
wait "$pb"
rb_rc=$?
wait "$pt"
rt_rc=$?
cat "$dir/base.out" "$dir/test.out" >"$out"
{ echo "--- base ($base, exit $rb_rc)"; cat "$dir/base.err"; echo "--- test ($test, exit $rt_rc)"; cat "$dir/test.err"; } >"$out.log"
for rc in "$rb_rc" "$rt_rc"; do
    if [ "$rc" != 0 ]; then
        echo "turn pair $kind $rnd: exit $rc (base $rb_rc, test $rt_rc); stderr in $out.log" >&2
        exit "$rc"
    fi
done
