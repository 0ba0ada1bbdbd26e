#!/usr/bin/env bash
# turn_pair.sh - two bench/torch_bench.py processes pinned to one CPU,
# taking turns (BENCH_TURNS): only one runs at a time, and they hand the CPU
# over after every timed rep, so rep k of both meets the host in the same
# state (docs/hot-path.md, section 9).
#
#   bash bench/turn_pair.sh CPU KIND ROUND BASE TEST FIRST OUT [torch_bench args]
#
# BASE and TEST are torch_bench.py configs (e.g. native cudapool); FIRST
# (base or test) goes first. Their JSON lines, tagged KIND:ROUND:base and
# KIND:ROUND:test ("kind":"torch_turns"), go to OUT (one file); stderr to
# OUT.log. TURN_LIMIT (seconds, default 300) cuts both off. Exit status:
# 0 when both processes succeeded. CPU is a taskset list.
#
# TURN_PROG (default bench/torch_bench.py) is what python runs; for FSDP2
#   TURN_RANKS=2 TURN_PROG="-m torch.distributed.run --standalone
#   --nproc_per_node=2 bench/fsdp2_bench.py"
# gives each rank its own FIFOs, so that rank r of both launches takes turns
# (with CPU a list the ranks split, each launch the same way).
set -u
[ $# -ge 7 ] || { sed -n 7p "$0" >&2; exit 2; }
cpu=$1 kind=$2 rnd=$3 base=$4 test=$5 first=$6 out=$7
shift 7
case $first in base | test) ;; *) echo "FIRST must be base or test, not '$first'" >&2; exit 2 ;; esac
case $out in /*) ;; *) out=$PWD/$out ;; esac
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
dir=$(mktemp -d) || exit 1
trap 'rm -rf "$dir"' EXIT
for ((r = 0; r < ${TURN_RANKS:-1}; r++)); do mkfifo "$dir/a$r" "$dir/b$r" || exit 1; done
a="$dir/a{rank}" b="$dir/b{rank}" # torch_bench.Turns puts in the rank
rb="$a:$b:second" rt="$b:$a:first"
[ "$first" = base ] && rb="$a:$b:first" rt="$b:$a:second"
read -r -a prog <<<"${TURN_PROG:-bench/torch_bench.py}"
# run_one ROLE CONFIG TURNS [torch_bench args]
run_one() {
    local role=$1 cfg=$2 t=$3
    shift 3
    BENCH_TURNS=$t BENCH_TURNS_TAG="$kind:$rnd:$role" timeout -k 5 "${TURN_LIMIT:-300}" \
        taskset -c "$cpu" "$PY" "${prog[@]}" "$cfg" "$@" >"$dir/$role.out" 2>"$dir/$role.err"
}
run_one base "$base" "$rb" "$@" &
pid=$!
run_one test "$test" "$rt" "$@"
rt_rc=$?
wait "$pid"
rb_rc=$?
cat "$dir/base.out" "$dir/test.out" >"$out"
{ echo "--- base ($base, exit $rb_rc)"; cat "$dir/base.err"; echo "--- test ($test, exit $rt_rc)"; cat "$dir/test.err"; } >"$out.log"
[ "$rb_rc" = 0 ] && [ "$rt_rc" = 0 ]
