#!/usr/bin/env bash
# One GPU call (2026-11-23 session): the soak's short mode (both segment
# kinds, the race test) and the wheel check (its GPU tests include the
# interop tests). Carry lib and dist. Tables last.
set -u
O=${OUT:-/tmp/session-b}; mkdir -p $O
SOAK_S=${SOAK_S:-30} SEGMENTS=${SEGMENTS:-both} RACE=${RACE:-1} RACE_REPEATS=${RACE_REPEATS:-30} OUT=/tmp/soak bash gpu/soak.sh > /tmp/soak.out 2>&1
echo "soak rc=$?"
OUT=/tmp/wheel bash gpu/wheel_check.sh > /tmp/wheel.out 2>&1
echo "wheel rc=$?"
tar czf $O/logs.tgz -C /tmp soak wheel soak.out wheel.out 2>/dev/null
echo "=== wheel"; tail -30 /tmp/wheel.out
echo "=== soak"; tail -25 /tmp/soak.out
