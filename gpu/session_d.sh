#!/usr/bin/env bash
# One GPU call (2026-11-23, third session): the wheel check with every GPU
# test from the installed wheel (gpu/session_c.sh; interop re-run after its
# fix), then the hot-path diagnosis (gpu/diag_hot_path.sh 3). Carry lib and
# dist (`make && make wheel` where Go is). Tables last; logs in $OUT.
set -u
O=${OUT:-/tmp/session-d}; mkdir -p "$O"
export PYTHONUNBUFFERED=1
timeout -k 5 ${WHEEL_S:-330} bash gpu/session_c.sh > /tmp/wheel_call.out 2>&1
echo "wheel call rc=$?"
[ -f "$O/wheel.tgz" ] || tar czf "$O/wheel.tgz" -C /tmp wheel wheel.out 2>/dev/null
OUT=/tmp/diag timeout -k 5 ${DIAG_S:-230} bash gpu/diag_hot_path.sh ${DIAG_REPS:-3} > /tmp/diag.out 2>&1
echo "diag rc=$?"
tar czf "$O/diag.tgz" -C /tmp diag diag.out 2>/dev/null
cp /tmp/wheel_call.out /tmp/diag.out "$O/" 2>/dev/null
echo "=== wheel"; tail -30 /tmp/wheel_call.out
echo "=== diag"; tail -45 /tmp/diag.out
