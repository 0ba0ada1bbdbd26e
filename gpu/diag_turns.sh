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
L=$D/list.txt
: >"$L"
echo "CPU $CPU (siblings $(cat /sys/devices/system/cpu/cpu"$CPU"/topology/thread_siblings_list 2>/dev/null || echo ?))"

# pair KIND ROUND BASE TEST FIRST: BASE and TEST taking turns on $CPU, FIRST
# (base or test) going first.
pair() {
    local kind=$1 r=$2 base=$3 test=$4 first=$5 tag f1 f2 rb rt
    if [ "$(el)" -gt "$DEADLINE" ]; then
        echo "skipped $kind $r: past ${DEADLINE}s"
        return
    fi
    tag=$D/${kind//\//_}.$r
    f1=$tag.f1 f2=$tag.f2
    mkfifo "$f1" "$f2" || return
    rb="$f1:$f2:second" rt="$f2:$f1:first"
    [ "$first" = base ] && rb="$f1:$f2:first" rt="$f2:$f1:second"
    BENCH_TURNS=$rb taskset -c "$CPU" $PY bench/torch_bench.py "$base" "${ARGS[@]}" >"$tag.base.jsonl" 2>>"$D/torch.log" &
    BENCH_TURNS=$rt taskset -c "$CPU" $PY bench/torch_bench.py "$test" "${ARGS[@]}" >"$tag.test.jsonl" 2>>"$D/torch.log"
    wait
    echo "$kind $r $tag.base.jsonl $tag.test.jsonl" >>"$L"
    echo "pair $kind $r ($first first) done at $(el)s"
}

for r in $(seq 1 "$ROUNDS"); do
    first=base
    [ $((r % 2)) = 0 ] && first=test
    pair native/cudapool "$r" native cudapool $first
    [ "$r" -lt "$ROUNDS" ] && pair expandable/cudapool_exp "$r" expandable cudapool_exp $first
    [ "$r" -le 2 ] && pair cudapool/cudapool "$r" cudapool cudapool $first
done
grep -h "Error\|error" "$D/torch.log" | head -n 5
echo
$PY bench/turns.py "$L"
echo "total $(el)s"
