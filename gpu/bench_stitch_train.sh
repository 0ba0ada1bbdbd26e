#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bench_stitch_train.sh - GPT-2 training and CUDA graph capture with
# stitching (docs/fragmentation.md), in one command on the GPU machine:
#
#   bash gpu/bench_stitch_train.sh        (REPS=3 interleaved rounds)
#
# Each round runs bench/torch_bench.py --sections train,graph in a fresh
# process for: native (PyTorch's default), native expandable_segments:True,
# cudapool expandable without stitching mapping page by page
# (expandable_map_unit_mb:2) and 20 MiB at a time, and cudapool with
# expandable segments and stitching (cudapool_stitch: stitch:True named,
# cudapool's default). The configurations are
# interleaved so that drifts of the machine hit them alike; the table (medians
# over the rounds) is printed last: ms/step, peak reserved / peak allocated,
# graph capture ms, graph private pool MiB.
#
# Needs lib/libcudapool.so (built with make; copy lib/), python3 with CUDA PyTorch. Logs and
# the raw JSON lines go to $OUT (default /tmp/cudapool-stitch-train-out).
set -u
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/cudapool-stitch-train-out}
PY=${PYTHON:-python3}
REPS=${REPS:-3}
ARGS=(--sections train,graph ${BENCH_TORCH_ARGS:-})
CONFIGS=(native expandable cudapool_exp2 cudapool_exp cudapool_stitch)
mkdir -p "$OUT"
RES=$OUT/results.jsonl
: >"$RES"
export CUDAPOOL_LIBRARY=$PWD/lib/libcudapool.so PYTHONUNBUFFERED=1
[ -f lib/libcudapool.so ] || { echo "lib/libcudapool.so is missing: run make where Go is, and copy lib/ here"; exit 1; }
for rep in $(seq 1 "$REPS"); do
    for cfg in "${CONFIGS[@]}"; do
        echo "=== round $rep: $cfg"
        timeout -k 5 170 "$PY" bench/torch_bench.py "$cfg" "${ARGS[@]}" 2>"$OUT/${cfg}_$rep.log" |
            grep '^{' >>"$RES" || echo "    failed (see $OUT/${cfg}_$rep.log)"
        tail -n 2 "$OUT/${cfg}_$rep.log" | cut -c1-160 | sed 's/^/    /'
    done
done
"$PY" - "$RES" "$REPS" <<'EOF' | tee "$OUT/table.md"
import json, statistics, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
def vals(cfg, section, key, f=lambda v: v):
    return [f(r[key]) for r in recs if r["config"] == cfg and r["section"] == section and key in r]
def med(xs, fmt):
    return (fmt % statistics.median(xs)) + (f" ({len(xs)})" if len(xs) != int(sys.argv[2]) else "") if xs else "-"
names = {"native": "native", "expandable": "native expandable", "cudapool_exp2": "cudapool stitch:False, 2 MiB unit",
         "cudapool_exp": "cudapool stitch:False, 20 MiB unit", "cudapool_stitch": "cudapool stitching (default)"}
print(f"\nGPT-2 training and graph capture, medians of {sys.argv[2]} interleaved rounds (a count in brackets: rounds that produced the number)\n")
print("| configuration | ms/step | reserved/allocated | peak reserved GiB | graph capture ms | graph pool MiB | errors |")
print("|---|---:|---:|---:|---:|---:|---|")
for cfg, name in names.items():
    ratio = [r["train_peak_reserved"] / r["train_peak_allocated"] for r in recs
             if r["config"] == cfg and r["section"] == "train" and r.get("train_peak_allocated")]
    errs = sorted({k for r in recs if r["config"] == cfg for k in r if k.endswith("_error")})
    print(f"| {name} | {med(vals(cfg, 'train', 'train_ms_per_step'), '%.2f')} | {med(ratio, '%.3f')} | "
          f"{med(vals(cfg, 'train', 'train_peak_reserved', lambda v: v / 2**30), '%.2f')} | "
          f"{med(vals(cfg, 'graph', 'graph_capture_ms'), '%.1f')} | "
          f"{med(vals(cfg, 'graph', 'graph_pool_bytes', lambda v: v / 2**20), '%.0f')} | {' '.join(errs)} |")
EOF
