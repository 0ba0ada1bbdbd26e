#!/usr/bin/env bash
# One GPU call (2026-11-23, third session): issue 12's figures. The
# fragmentation benchmark on the three traces (gpu/bench_fragmentation.sh),
# then stitching's training and graph run (gpu/bench_stitch_train.sh).
# Carry lib. Results (JSON lines, logs) come back in $OUT; tables last.
set -u
O=${OUT:-/tmp/session-e}; mkdir -p "$O"
export PYTHONUNBUFFERED=1
OUT=/tmp/frag timeout -k 5 ${FRAG_S:-250} bash gpu/bench_fragmentation.sh > /tmp/frag.out 2>&1
echo "frag rc=$?"
OUT=/tmp/stitch REPS=${REPS:-3} timeout -k 5 ${TRAIN_S:-320} bash gpu/bench_stitch_train.sh > /tmp/stitch.out 2>&1
echo "stitch-train rc=$?"
tar czf "$O/issue12.tgz" -C /tmp frag frag.out stitch stitch.out 2>/dev/null
echo "=== fragmentation"; cat /tmp/frag/table.md 2>/dev/null || tail -20 /tmp/frag.out
echo "=== stitch train"; tail -12 /tmp/stitch.out
