#!/usr/bin/env bash
# One GPU call (nineteenth session, issue 11): this library against another
# build ($CUDAPOOL_LIBRARY_B, default build/lib_b/libcudapool.so): the torch
# rows with the two builds' processes taking turns on one CPU
# (gpu/diag_turns.sh, kind b; ROUNDS pairs), then torch_bench.py's alt
# section (native and cudapool alternating in one process, captures
# included) for each build, ALT_RUNS processes each, interleaved. Carry lib
# and build/lib_b. Table last.
set -u
cd "$(dirname "$0")/.." || exit 1
export CUDAPOOL_LIBRARY_B=${CUDAPOOL_LIBRARY_B:-$PWD/build/lib_b/libcudapool.so}
O=${OUT:-/tmp/initonce}; mkdir -p "$O"
if [ "${ROUNDS:-4}" != 0 ]; then
    KINDS=b PB_RUNS=0 TURN_PIN=thread ROUNDS=${ROUNDS:-4} CPU=2 DEADLINE=${DEADLINE:-240} \
        bash gpu/diag_turns.sh > "$O/turns.txt" 2>&1
    echo "turns rc=$?"
fi
export CUDAPOOL_LIBRARY=$PWD/lib/libcudapool.so PYTHONUNBUFFERED=1
for r in $(seq "${ALT_RUNS:-2}"); do
    for c in cudapool cudapool_b; do
        BENCH_TURNS_PIN=2 timeout 170 python3 bench/torch_bench.py "$c" --sections alt \
            > "$O/alt_${c}_$r.json" 2> "$O/alt_${c}_$r.err" || echo "alt $c $r failed: $(tail -n 2 "$O/alt_${c}_$r.err")"
    done
done
python3 - "$O" <<'PY'
import glob, json, os, statistics, sys
rows = {}
for f in sorted(glob.glob(os.path.join(sys.argv[1], "alt_*.json"))):
    cfg = os.path.basename(f).split("_")[1] + ("_b" if "_b_" in f else "")
    for line in open(f):
        d = json.loads(line)
        if d.get("section") == "alt":
            for k in ("alt_small_ratio", "alt_mixed_ratio", "alt_capture_ratio"):
                if k in d:
                    rows.setdefault((cfg, k), []).append(d[k])
for (cfg, k), v in sorted(rows.items()):
    print(f"alt {cfg:11} {k:18} " + " ".join(f"{x:.3f}" for x in v))
PY
echo "host: $(grep -m 1 'model name' /proc/cpuinfo | sed 's/.*: *//'), $(nproc) CPUs; $(date -u '+%Y-%m-%d %H:%M UTC')"
echo "A: lib $(tr '\n' ' ' < lib/BUILD_COMMIT); B: $(tr '\n' ' ' < "$(dirname "$CUDAPOOL_LIBRARY_B")/BUILD_COMMIT")"
[ -f "$O/turns.txt" ] && tail -n 22 "$O/turns.txt"
