#!/usr/bin/env bash
# gpu/diag_turns.sh - do two processes pinned to one CPU and taking turns
# pair a comparison in the host's state? (issue 11: each process meets the
# host fast or up to 1.9x slower; gpu/diag_pairing.sh showed that processes
# running at the same time on different cores do not share that state, and
# bench/pair_bench.c that reps alternated within one process do.) PyTorch
# takes one allocator per process, so the torch rows cannot alternate in
# one process; here two torch_bench.py processes on one CPU hand it to each
# other after every timed rep (BENCH_TURNS, bench/torch_bench.py), so rep k
# of both runs back to back. Pairs, one at a time, each on CPU $CPU:
#   native/cudapool            ROUNDS pairs (who goes first alternates)
#   expandable/cudapool_exp    ROUNDS-1 pairs
#   cudapool/cudapool          2 pairs: equals, the noise of the method
#   cudapool_b/cudapool        ROUNDS pairs, with KINDS naming b: another
#                              build ($CUDAPOOL_LIBRARY_B) against this one
# Prints every pair's per-metric figure (median of the per-rep ratios) and,
# per kind, the median (min-max) over pairs and the spread of their logs
# (bench/turns.py). First, what sparing the C API's free its crossing is
# worth on this host (docs/hot-path.md, section 9): bench/pair_bench.c's
# mixed loop, cudapool against native in one process, with the C API and
# with deferred frees (C_BENCH_FREE=deferred), 3 processes each, alternated.
# About 8 minutes on an H100 host (carry lib/):
#   ROUNDS=3 bash gpu/diag_turns.sh
# CPU=2-5 pins each pair to four CPUs; TURN_PIN=thread pins only the main
# threads (bench/turn_pair.sh); KINDS="native same" and PB_RUNS=0 narrow it
# down.
set -u
cd "$(dirname "$0")/.." || exit 1
ROUNDS=${ROUNDS:-3}
CPU=${CPU:-2}          # a taskset list: the pairs' CPUs
PB_RUNS=${PB_RUNS:-3}  # pair_bench processes per mode (0: none, and no C build)
KINDS=${KINDS:-"native expandable same"}
has() { [[ " $KINDS " == *" $1 "* ]]; }
[ "$PB_RUNS" = 0 ] && DIAG_BUILD_C=0
DEADLINE=${DEADLINE:-480} # seconds: no pair starts after this
ARGS=(--steps 30 --reps 7)
# shellcheck source=gpu/diag_setup.sh
. gpu/diag_setup.sh
PB=build/bench/pair_bench
if [ "$PB_RUNS" = 0 ]; then
    :
elif [ -x $PB ]; then
    for r in $(seq 1 "$PB_RUNS"); do
        for mode in api deferred; do
            v=$(C_BENCH_FREE=$mode taskset -c "$CPU" $PB --sections mixed 2>/dev/null | $PY -c 'import json,sys
for l in sys.stdin:
    d = json.loads(l)
    if d.get("section") == "mixed" and "ratio" in d:
        print("%.3f (cudapool %.0f ns, native %.0f ns)" % (d["ratio"], d["cudapool_ns"], d["native_ns"]))')
            echo "pair_bench mixed, $mode frees, process $r: ${v:-failed}"
        done
    done
else
    echo "pair_bench was not built ($D/build.log)"
fi
echo "pair_bench done at $(el)s"
echo "CPU $CPU (siblings $(cat /sys/devices/system/cpu/cpu"$CPU"/topology/thread_siblings_list 2>/dev/null || echo ?))"

# pair KIND ROUND BASE TEST FIRST: BASE and TEST taking turns on $CPU
# (bench/turn_pair.sh), FIRST (base or test) going first.
pair() {
    if [ "$(el)" -gt "$DEADLINE" ]; then
        echo "skipped $1 $2: past ${DEADLINE}s"
        return
    fi
    bash bench/turn_pair.sh "$CPU" "$@" "$D/${1//\//_}.$2.json" "${ARGS[@]}" || echo "pair $1 $2 failed: $D/${1//\//_}.$2.json.log"
    echo "pair $1 $2 ($5 first) done at $(el)s"
}

for r in $(seq 1 "$ROUNDS"); do
    first=base
    [ $((r % 2)) = 0 ] && first=test
    has native && pair native/cudapool "$r" native cudapool $first
    has expandable && [ "$r" -lt "$ROUNDS" ] && pair expandable/cudapool_exp "$r" expandable cudapool_exp $first
    has same && [ "$r" -le 2 ] && pair cudapool/cudapool "$r" cudapool cudapool $first
    has b && pair cudapool_b/cudapool "$r" cudapool_b cudapool $first
done
grep -h "Error" "$D"/*.json.log | head -n 5
echo
$PY bench/turns.py "$D"/*.json
echo "total $(el)s"
