#!/usr/bin/env bash
# One GPU call (2026-11-23 session): the soak's short mode (both segment
# kinds, the race test), then the wheel check (gpu/session_c.sh). Carry lib
# and dist. Tables last.
set -u
O=${OUT:-/tmp/session-b}; mkdir -p $O
SOAK_S=${SOAK_S:-30} SEGMENTS=${SEGMENTS:-both} RACE=${RACE:-1} RACE_REPEATS=${RACE_REPEATS:-30} OUT=/tmp/soak bash gpu/soak.sh > /tmp/soak.out 2>&1
echo "soak rc=$?"
tar czf $O/soak.tgz -C /tmp soak soak.out 2>/dev/null
echo "=== wheel"; OUT=$O bash gpu/session_c.sh
echo "=== soak"; tail -25 /tmp/soak.out
