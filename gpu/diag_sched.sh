#!/usr/bin/env bash
# gpu/diag_sched.sh - what keeping the Go runtime's sysmon out of its deep
# sleep is worth on the GPU host (issue 11; docs/hot-path.md 3 and 18).
# CFGS (default "native cudapool cudapool_sched"): the ring's and
# diag_enter's configurations; cudapool_cold is capi/warm's keeper off.
# COLD_CONFS: the cold-call runs' settings (GODEBUG=... or CUDAPOOL_CONF=...).
#   bash gpu/diag_sched.sh          (carry lib; output to $OUT or build/diag)
# When every P of the library's Go runtime has been idle for ~10 ms, sysmon
# sleeps until woken, and the next call into Go wakes it (a futex) on the
# caller's thread: the capture's enter phase (empty_cache after gc.collect)
# pays that. GODEBUG=schedtrace keeps sysmon polling instead; it must be in
# the environment the process starts with (cudapool_sched configurations).
# 1. gpu/diag_cold_call.py after 30 ms idle, without and with the setting;
# 2. RINGS rings (bench/turn_ring.py) of native, cudapool, cudapool_sched:
#    training, GRAPH_CAPTURES captures, torch.empty; gpu/ring_phases.py;
# 3. gpu/diag_enter.py gpt with every graph kept (DIAG_KEEP=0).
set -u
cd "$(dirname "$0")/.." || exit 1
# shellcheck source=gpu/rings.sh
. gpu/rings.sh
ring_setup
k=0
for g in ${COLD_CONFS:-"GODEBUG=" "GODEBUG=schedtrace=2147483647"}; do
    k=$((k + 1))
    echo "== cold calls after 30 ms idle, $g"
    env "$g" IDLE_S=0.03 timeout 120 $PY gpu/diag_cold_call.py "${COLD_N:-100}" >"$P/cold_$k.txt" 2>&1
    tail -10 "$P/cold_$k.txt"
done
echo "cold calls done at $(($(date +%s) - T0))s"
read -r -a CFGS <<<"${CFGS:-native cudapool cudapool_sched}"
run_rings "$P" "${RINGS:-3}" --sections "${SECTIONS:-train,graph,empty}" --graph-captures "${GRAPH_CAPTURES:-10}"
$PY gpu/ring_phases.py "$P/ring" "${CFGS[@]}" | tee "$P/ring_phases.txt"
$PY gpu/ring_phases.py "$P/ring" "${CFGS[@]:1}" | tee -a "$P/ring_phases.txt"
echo "rings done at $(($(date +%s) - T0))s"
if [ "${ENTER_REPS:-2}" -gt 0 ]; then
    DIAG_KEEP=0 DIAG_TIMING=1 DIAG_CONFIGS="${CFGS[*]}" \
        timeout 200 $PY gpu/diag_enter.py gpt "${ENTER_REPS:-2}" "${ENTER_N:-20}" >"$P/enter_gpt.txt" 2>&1
    tail -6 "$P/enter_gpt.txt"
fi
echo "done at $(($(date +%s) - T0))s"
tar czf "$P/ring.tgz" -C "$P" ring && rm -rf "$P/ring" # one file back from the device
