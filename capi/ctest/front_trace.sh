#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# front_trace.sh C_BENCH TRACE_GZ - the front cache on a recorded training run
# (demo/train75.txt.gz: bench/record_trace.py bench, 75 GPT-2 steps of varying
# lengths), replayed on the simulator with frees deferred as PyTorch's class
# path makes them: with the front the peak reserved memory must be no higher
# than without it, with the default (expandable segments and stitching) and
# with ordinary segments (expandable_segments:False). Held blocks are not
# merged or seen by best fit, and large ones fragmented the ordinary
# segments over the run (6.195 GiB holding any size against 6.160 without
# the front; holding the newest, 6.266 here and 6.29 on the GPU):
# capi/front.c holds small ones only.
set -eu
bench=$1
trace=${TMPDIR:-/tmp}/cudapool_front_trace.$$
trap 'rm -f "$trace"' EXIT
gzip -dc "$2" >"$trace"
run() {
	CUDAPOOL_BACKEND=sim C_BENCH_FREE=deferred CUDAPOOL_CONF=$1 "$bench" --config cudapool \
		--sections trace --trace "$trace" --trace-repeats 1 2>/dev/null | grep '"section":"trace"'
}
rc=0
for conf in "" "expandable_segments:False"; do
	on=$(run "$conf") off=$(run "${conf:+$conf,}front_cache:False")
	python3 - "${conf:-the default}" "$on" "$off" <<'PY' || rc=1
import json, sys
name = sys.argv[1]
on, off = (json.loads(a) for a in sys.argv[2:4])
gib = 2**30
hits = on["trace_front_hits"] / on["trace_allocs"]
ok = on["trace_peak_reserved"] <= off["trace_peak_reserved"]
print(("ok    " if ok else "FAIL  ") + "%s: peak reserved with the front %.3f GiB, without %.3f GiB (the front served %.1f%% of %d mallocs)"
      % (name, on["trace_peak_reserved"] / gib, off["trace_peak_reserved"] / gib, 100 * hits, on["trace_allocs"]))
sys.exit(0 if ok else 1)
PY
done
exit $rc
