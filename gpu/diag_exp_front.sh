#!/usr/bin/env bash
# One GPU call (twentieth session, issue 11): the front cache serving the
# private pools of expandable segments (holding only their small blocks
# across takes) against the library that left those pools to Go. For each
# build ($PWD/lib, and B = $CUDAPOOL_LIBRARY_B, default build/lib_a): one
# bench/torch_bench.py graph section with expandable segments (the private
# pool's size, the front's hits per capture, capture time), then captures by
# native and cudapool alternating in one process with expandable segments
# for both (gpu/diag_capture_alt.py, DIAG_CONF), the builds' processes
# taking turns. Carry lib and build/lib_a. Table last.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python
A=$PWD/lib/libcudapool.so
B=${CUDAPOOL_LIBRARY_B:-$PWD/build/lib_a/libcudapool.so}
O=${OUT:-/tmp/exp-front}; mkdir -p "$O"
T0=$(date +%s)
for lib in "$A" "$B"; do
	for cfg in cudapool_exp cudapool; do
		CUDAPOOL_LIBRARY=$lib timeout -k 5 150 python3 bench/torch_bench.py $cfg --sections graph > "$O/graph.log" 2>&1
		python3 - "$lib" "$cfg" "$O/graph.log" <<'PY'
import json, statistics, sys
lib, cfg, path = sys.argv[1:]
for l in open(path):
    if l.startswith("{"):
        d = json.loads(l)
        if d.get("section") == "graph":
            print(f"{lib} {cfg}: capture {d.get('graph_capture_ms', 0):.2f} ms, private pool "
                  f"{d.get('graph_pool_bytes', 0) / 2**20:.1f} MiB, front hits per capture "
                  f"{d.get('graph_front_hits_reps')}, device allocations {d.get('graph_num_device_alloc_reps')}")
PY
	done
done
echo "graph sections done ($(($(date +%s) - T0)) s)"
DIAG_CONF=expandable_segments:True DIAG_LIBS="$A $B" timeout -k 5 ${ALT_S:-360} python3 gpu/diag_capture_alt.py ${PROCS:-4} ${PAIRS:-12} > "$O/alt.log" 2>&1
echo "capture_alt rc=$? ($(($(date +%s) - T0)) s)"
echo "A: $A $(head -c 200 lib/BUILD_COMMIT)"
echo "B: $B $(head -c 200 "$(dirname "$B")/BUILD_COMMIT")"
cat "$O/alt.log"
