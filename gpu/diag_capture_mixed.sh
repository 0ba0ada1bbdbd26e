#!/usr/bin/env bash
# gpu/diag_capture_mixed.sh - where the two torch rows that are slower than
# native when paired go (issue 11; docs/hot-path.md, section 10): graph
# capture and torch.empty with mixed sizes (section 9: 1.13-1.20x and
# 1.06-1.09x paired).
# Pairs taking turns on CPU $CPU with only the main threads pinned
# (bench/turn_pair.sh, TURN_PIN=thread), one at a time:
#   graph section, GRAPH_CAPTURES captures per process, each capture timed
#   in phases (enter: synchronize, empty_cache, capture_begin; the forward; exit:
#   capture_end + instantiation; sync) with the allocator's and the driver's
#   allocation counts (memory_stats):
#     native/cudapool         ROUNDS pairs
#     expandable/cudapool_exp XROUNDS pairs (0): both with expandable segments
#     cudapool/cudapool       SAME pairs (1): the method's noise, per phase
#     cudapool/cudapool_sched SCHED pairs (1): Go's sysmon kept awake (GODEBUG)
#   empty section (4 KiB and mixed), with the driver calls of the mixed
#   reps, EMPTY rounds (2) of:
#     native/cudapool
#     cudapool_nofront/cudapool: does the front's cold mode cost?
#     cudapool/cudapool_treap: the treap free set, fewer cache lines
# Prints every pair (bench/turns.py: phases paired like the rows, counts
# side by side), then per kind and metric the median (min-max) of the pairs.
# About 8 minutes on an H100 host (carry lib/):
#   bash gpu/diag_capture_mixed.sh
set -u
cd "$(dirname "$0")/.." || exit 1
ROUNDS=${ROUNDS:-3}
CPU=${CPU:-2}
GRAPH_CAPTURES=${GRAPH_CAPTURES:-12}
XROUNDS=${XROUNDS:-0} # expandable/cudapool_exp capture pairs
SAME=${SAME:-1}   # cudapool/cudapool capture pairs
SCHED=${SCHED:-1} # the cudapool/cudapool_sched capture pair (0: none)
EMPTY=${EMPTY:-2} # rounds of the empty pairs (0: none)
DEADLINE=${DEADLINE:-500} # seconds: no pair starts after this
export TURN_PIN=${TURN_PIN:-thread}
DIAG_BUILD_C=0
# shellcheck source=gpu/diag_setup.sh
. gpu/diag_setup.sh
echo "CPU $CPU, TURN_PIN=$TURN_PIN, library $(cat lib/BUILD_COMMIT 2>/dev/null || echo ?)"

# pair KIND ROUND BASE TEST FIRST ARGS...: BASE and TEST taking turns.
pair() {
    if [ "$(el)" -gt "$DEADLINE" ]; then
        echo "skipped $1 $2: past ${DEADLINE}s"
        return
    fi
    local out="$D/${1//\//_}.$2.json" head=("$1" "$2" "$3" "$4" "$5")
    shift 5
    bash bench/turn_pair.sh "$CPU" "${head[@]}" "$out" "$@" >/dev/null 2>&1 ||
        echo "pair ${head[0]} ${head[1]} failed: $(tail -n 3 "$out.log" 2>&1)"
    echo "pair ${head[0]} ${head[1]} (${head[4]} first) done at $(el)s"
}
G=(--sections graph --graph-captures "$GRAPH_CAPTURES" --graph-replays 10)
E=(--sections empty --reps 7)
for r in $(seq 1 "$ROUNDS"); do
    first=base
    [ $((r % 2)) = 0 ] && first=test
    pair capture.native/cudapool "$r" native cudapool $first "${G[@]}"
done
for r in $(seq 1 "$XROUNDS"); do
    first=base
    [ $((r % 2)) = 0 ] && first=test
    pair capture.expandable/cudapool_exp "$r" expandable cudapool_exp $first "${G[@]}"
done
for r in $(seq 1 "$SAME"); do
    first=base
    [ $((r % 2)) = 0 ] && first=test
    pair capture.cudapool/cudapool "$r" cudapool cudapool $first "${G[@]}"
done
[ "$SCHED" = 1 ] && pair capture.cudapool/cudapool_sched 1 cudapool cudapool_sched base "${G[@]}"
for r in $(seq 1 "$EMPTY"); do
    first=base
    [ "$r" = 2 ] && first=test
    pair empty.native/cudapool "$r" native cudapool $first "${E[@]}"
    pair empty.cudapool_nofront/cudapool "$r" cudapool_nofront cudapool $first "${E[@]}"
    pair empty.cudapool/cudapool_treap "$r" cudapool cudapool_treap $first "${E[@]}"
done
grep -h "Error" "$D"/*.json.log | head -n 5
echo
$PY bench/turns.py "$D"/*.json
echo "total $(el)s"
