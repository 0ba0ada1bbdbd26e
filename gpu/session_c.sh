#!/usr/bin/env bash
# One GPU call (2026-11-23 session): the wheel check (all GPU tests from the
# installed wheel, interop and stitch integrity included). Carry dist.
set -u
OUT=/tmp/wheel bash gpu/wheel_check.sh > /tmp/wheel.out 2>&1
echo "wheel rc=$?"
[ -n "${OUT:-}" ] && tar czf $OUT/wheel.tgz -C /tmp wheel wheel.out 2>/dev/null
grep -E '^E |FAILED' /tmp/wheel.out | head -20
tail -28 /tmp/wheel.out
