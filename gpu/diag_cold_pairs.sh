#!/usr/bin/env bash
# gpu/diag_cold_pairs.sh - the C mixed pair, cudapool against native in one
# process (bench/pair_bench.c), with the caches evicted between each pair's
# free and malloc as PyTorch's interpreter does (bench/workloads.h,
# WL_EVICT_KB and WL_EVICT_CODE; docs/hot-path.md, section 10). cudapool's
# frees are deferred as on PyTorch's class path (C_BENCH_FREE=deferred).
# Each eviction mode runs in RUNS processes, the modes interleaved; prints,
# per mode, each process's ratio of medians and the ratio with the
# eviction's own time subtracted from both sides. Carry lib/:
#   bash gpu/diag_cold_pairs.sh
set -u
cd "$(dirname "$0")/.." || exit 1
RUNS=${RUNS:-2}
CPU=${CPU:-2}
MODES=${MODES:-"0:0 0:1 64:1 256:0"} # KiB of data : code (1 = 40 KiB)
ARGS=(--sections mixed --mixed-pairs "${PAIRS:-50000}" --reps "${REPS:-9}")
# shellcheck source=gpu/diag_setup.sh
. gpu/diag_setup.sh
PB=build/bench/pair_bench
[ -x $PB ] || { echo "pair_bench was not built ($D/build.log)"; exit 1; }
echo "CPU $CPU, library $(cat lib/BUILD_COMMIT 2>/dev/null || echo ?)"
for r in $(seq 1 "$RUNS"); do
    for m in $MODES; do
        kb=${m%%:*} code=${m##*:}
        C_BENCH_FREE=deferred WL_EVICT_KB=$kb WL_EVICT_CODE=$code taskset -c "$CPU" $PB "${ARGS[@]}" \
            >"$D/cold.$kb.$code.$r.json" 2>"$D/cold.$kb.$code.$r.log"
        echo "mode $m run $r done at $(el)s"
    done
done
$PY - "$D" <<'EOF'
import glob, json, os, sys
rows = {}
for p in sorted(glob.glob(os.path.join(sys.argv[1], "cold.*.json"))):
    _, kb, code, run, _ = os.path.basename(p).split(".")
    mixed = evict = None
    for line in open(p):
        d = json.loads(line)
        if d.get("section") == "mixed":
            mixed = d
        elif d.get("section") == "evict":
            evict = d
    if not mixed or "ratio" not in mixed:
        rows.setdefault((int(kb), code), []).append(f"run {run}: failed")
        continue
    e = evict["evict_ns"] if evict else 0.0
    a, b = mixed["cudapool_ns"], mixed["native_ns"]
    rows.setdefault((int(kb), code), []).append(
        f"run {run}: ratio {mixed['ratio']:.3f} (cudapool {a:.0f} ns, native {b:.0f} ns, eviction {e:.0f} ns;"
        f" without it {a - e:.0f} / {b - e:.0f} = {(a - e) / (b - e):.3f})")
print("\n==== C mixed pair, deferred frees, eviction between free and malloc: data KiB, code ====")
for (kb, code), v in sorted(rows.items()):
    for s in v:
        print(f"{kb:4} KiB, code {code}: {s}")
EOF
echo "total $(el)s"
