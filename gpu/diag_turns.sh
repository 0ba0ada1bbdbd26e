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
# Prints every pair's per-metric figure (median of the per-rep ratios) and,
# per kind, the median (min-max) over pairs and the spread of their logs
# (bench/turns.py). About 6 minutes on an H100 host (carry lib/):
#   ROUNDS=4 bash gpu/diag_turns.sh
set -u
cd "$(dirname "$0")/.." || exit 1
ROUNDS=${ROUNDS:-4}
CPU=${CPU:-2}
DEADLINE=${DEADLINE:-500} # seconds: no pair starts after this
ARGS=(--steps 30 --reps 7)
DIAG_BUILD_C=0
# shellcheck source=gpu/diag_setup.sh
. gpu/diag_setup.sh
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
    pair native/cudapool "$r" native cudapool $first
    [ "$r" -lt "$ROUNDS" ] && pair expandable/cudapool_exp "$r" expandable cudapool_exp $first
    [ "$r" -le 2 ] && pair cudapool/cudapool "$r" cudapool cudapool $first
done
grep -h "Error" "$D"/*.json.log | head -n 5
echo
$PY bench/turns.py "$D"/*.json
echo "total $(el)s"
