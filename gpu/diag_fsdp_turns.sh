#!/usr/bin/env bash
# gpu/diag_fsdp_turns.sh - FSDP2 on two GPUs, native and cudapool taking
# turns step by step (bench/turn_pair.sh with TURN_RANKS=2: rank r of both
# launches shares the same CPUs and hands them over after every step,
# synchronized), ROUNDS pairs, who goes first alternating, then SAME pairs
# of cudapool against itself: the method's noise. Prints every pair's
# median per-step ratio and, per kind, the median (min-max) over pairs
# (bench/turns.py), then each launch's host time to issue a step and its
# allocator counters per step. PAIRS="BASE/TEST ..." replaces both kinds
# (e.g. "cudapool/cudapool_b": two builds, CUDAPOOL_LIBRARY_B naming the
# second; ROUNDS pairs of each). Needs NPROC GPUs (default 2:
# nvidia-h200-x2; NPROC=1 runs FSDP2 on one GPU, a proxy for the
# allocator's share of the step); 35-65 s a pair (carry lib/):
#   ROUNDS=3 SAME=1 bash gpu/diag_fsdp_turns.sh
set -u
cd "$(dirname "$0")/.." || exit 1
ROUNDS=${ROUNDS:-3}
SAME=${SAME:-1}
DEADLINE=${DEADLINE:-420} # seconds: no pair starts after this
DIAG_BUILD_C=0
# shellcheck source=gpu/diag_setup.sh
. gpu/diag_setup.sh
NPROC=${NPROC:-2}
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
[ "${ngpu:-0}" -ge "$NPROC" ] || { echo "needs $NPROC GPUs (found ${ngpu:-0})"; exit 1; }
gpus=$(seq -s, 0 $((NPROC - 1)))
# CPUS: the list both launches run on, split among the ranks (default all
# this script may use; "3,11" gives rank 0 CPU 3 and rank 1 CPU 11).
cpus=${CPUS:-$(taskset -pc $$ 2>/dev/null | sed 's/.*: *//')}
echo "GPUs $ngpu, CPUs $cpus, library $(cat lib/BUILD_COMMIT 2>/dev/null || echo ?)"

# pair KIND ROUND BASE TEST FIRST (as bench/run_bench.sh's FSDP2 turns).
pair() {
    if [ "$(el)" -gt "$DEADLINE" ]; then
        echo "skipped $1 $2: past ${DEADLINE}s"
        return
    fi
    env CUDA_VISIBLE_DEVICES="$gpus" TURN_RANKS="$NPROC" TURN_LIMIT=230 \
        TURN_PROG="-m torch.distributed.run --standalone --nproc_per_node=$NPROC bench/fsdp2_bench.py" \
        bash bench/turn_pair.sh "${cpus:--}" "$@" "$D/fsdp-${1//\//_}.$2.json" ${FSDP_ARGS:-} ||
        echo "pair $1 $2 failed: $D/fsdp-${1//\//_}.$2.json.log"
    echo "pair $1 $2 ($5 first) done at $(el)s"
}

for r in $(seq 1 "$ROUNDS"); do
    first=base
    [ $((r % 2)) = 0 ] && first=test
    if [ -n "${PAIRS:-}" ]; then
        for p in $PAIRS; do pair "fsdp-$p" "$r" "${p%/*}" "${p#*/}" $first; done
        continue
    fi
    pair fsdp-native/cudapool "$r" native cudapool $first
    [ "$r" -le "$SAME" ] && pair fsdp-cudapool/cudapool "$r" cudapool cudapool $first
done
grep -h "Error" "$D"/*.json.log 2>/dev/null | head -n 5
echo
$PY bench/turns.py "$D"/*.json
echo
$PY gpu/fsdp_counters.py "$D"/*.json
echo "total $(el)s"
