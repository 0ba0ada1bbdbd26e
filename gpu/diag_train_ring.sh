#!/usr/bin/env bash
# gpu/diag_train_ring.sh - the training row with every timed length warmed
# (issue 11; bench/workloads.warmup_lens): the step-by-step diagnosis of two
# processes (gpu/diag_train_steps.sh, with the CPU-bound test), then RINGS
# rings of CFGS taking turns (bench/turn_ring.py, torch_bench.py's train
# section as the full run has it) and each ring's ratios (gpu/ring_phases.py).
# STEP_CONFIGS (empty: skip the step-by-step part), CFGS, RINGS, SECTIONS,
# RING_ARGS (more torch_bench.py arguments); CFGS with cudapool_b (or
# cudapool_exp_b, with expandable segments) compares two builds
# (CUDAPOOL_LIBRARY_B, torch_bench.py's cudapool_b).
#   bash gpu/diag_train_ring.sh      (carry lib; output to $OUT or build/diag)
set -u
cd "$(dirname "$0")/.." || exit 1
# shellcheck source=gpu/rings.sh
. gpu/rings.sh
ring_setup
if [ -n "${STEP_CONFIGS-native cudapool}" ]; then
    CONFIGS=${STEP_CONFIGS-native cudapool} EAGER_CONFIGS="" bash gpu/diag_train_steps.sh 2>&1 | tail -16
    echo "steps done at $(($(date +%s) - T0))s"
fi
read -r -a CFGS <<<"${CFGS:-native cudapool expandable cudapool_exp}"
# shellcheck disable=SC2086  # RING_ARGS: words
run_rings "$P" "${RINGS:-4}" --sections "${SECTIONS:-train}" ${RING_ARGS:-}
# The first configuration is the base; with expandable and cudapool_exp,
# those two as a pair too; with cudapool_b (a second build, from
# $CUDAPOOL_LIBRARY_B), cudapool against it.
$PY gpu/ring_phases.py "$P/ring" "${CFGS[@]}" | tee "$P/ring_phases.txt"
case " ${CFGS[*]} " in *" expandable "*" cudapool_exp "*|*" cudapool_exp "*" expandable "*)
    $PY gpu/ring_phases.py "$P/ring" expandable cudapool_exp | tee -a "$P/ring_phases.txt" ;;
esac
case " ${CFGS[*]} " in *" cudapool_b "*)
    $PY gpu/ring_phases.py "$P/ring" cudapool_b cudapool | tee -a "$P/ring_phases.txt" ;;
esac
case " ${CFGS[*]} " in *" cudapool_exp_b "*)
    $PY gpu/ring_phases.py "$P/ring" cudapool_exp_b cudapool_exp | tee -a "$P/ring_phases.txt" ;;
esac
$PY - "$P/ring" <<'PYEOF'
import glob, json, os, statistics, sys
print("\nper process: train ms/step, blocks (ms/step)")
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    d = {}
    for ln in open(f):
        if ln.startswith("{"):
            d.update(json.loads(ln))
    if "train_ms_per_step" in d:
        print(f"  {os.path.basename(f)[:-5]:18} {d['train_ms_per_step']:7.2f}  warm-up {d.get('train_warmup_steps')}  "
              + " ".join(f"{b:.1f}" for b in d["train_block_ms_per_step"]))
PYEOF
echo "done at $(($(date +%s) - T0))s"
tar czf "$P/ring.tgz" -C "$P" ring && rm -rf "$P/ring"
