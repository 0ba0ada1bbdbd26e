#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The GPU soak (docs/reliability.md), in one command on a GPU machine: gpu/soak.py with
# PyTorch's native allocator and with cudapool, side by side (two processes
# on one GPU, SOAK_S seconds each, at the same time), plus the C twin
# (gpu/soak_c.c, cudapool through its C ABI) as a third process, for each
# segment kind asked; then the capture-time record_stream race
# (gpu/race_record_stream.py, RACE_REPEATS repeats each way). Ends with one
# table.
#
#   SOAK_S=60 gpu/soak.sh                     # short mode: both segment kinds, about 4 minutes
#   SOAK_S=480 SEGMENTS=off RACE=0 gpu/soak.sh # the 8-minute soak, ordinary segments (under 9 minutes)
#   SOAK_S=480 SEGMENTS=on RACE=0 gpu/soak.sh  # the same with expandable_segments:True
#
# Each kind sets PYTORCH_CUDA_ALLOC_CONF for every process, so that the
# allocators run in matching configurations: off is expandable_segments:False
# (native's default; cudapool's ordinary segments), on expandable_segments:True
# (native's expandable segments; cudapool's default, with stitching).
#
# SEGMENTS: off, on or both (default both); RACE=0 skips the race test;
# APART=1 gives native a GPU of its own (the first visible one; cudapool and
# the C twin share the second), where there are two, so that a fault of
# native's process (an illegal memory access was seen once, with expandable
# segments) cannot touch cudapool's run;
# WATCHDOG_S: a thread without progress for this long is a hang (default 60).
# A run takes SOAK_S + about 40 s; a hung one is killed by SOAK_S +
# WATCHDOG_S + 40 s (its own watchdog normally reports it before).
# Needs lib/libcudapool.so (built with make where Go is), torch for the Python
# soak (skipped with its reason otherwise), nvcc and gcc for the C twin.
# Logs go to $OUT (default /tmp/cudapool-soak). Exit status 0 only if every
# cudapool run passed and native ran without errors or hangs (native's bad
# delayed reads are reported, not judged).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cudapool-soak}
mkdir -p "$OUT" build/gpu
rm -f "$OUT"/soak_*.log "$OUT"/race.log "$OUT"/rc.txt
SOAK_S=${SOAK_S:-60}
SEGMENTS=${SEGMENTS:-both}
APART=${APART:-0}
WATCHDOG_S=${WATCHDOG_S:-60}
RACE=${RACE:-1}
RACE_REPEATS=${RACE_REPEATS:-100}
PY=${PYTHON:-python3}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export WATCHDOG_S
export LD_LIBRARY_PATH=$PWD/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export CUDAPOOL_LIBRARY=$PWD/lib/libcudapool.so
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
unset CUDAPOOL_BACKEND CUDAPOOL_CONF
# Each process gets this much past SOAK_S for its setup, OOM phases and
# checks before it is killed (its own watchdog normally ends it first).
LIMIT=$((${SOAK_S%.*} + ${WATCHDOG_S%.*} + 40))
failed=0

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
[ -f lib/libcudapool.so ] || { echo "FATAL: lib/libcudapool.so missing: run make where Go is and copy lib/ here"; exit 1; }

have_torch=1
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null || have_torch=0
[ "$have_torch" = 1 ] || echo "SKIP the PyTorch soak: torch with CUDA is not importable here"

have_c=0
if [ -x "$CUDA_HOME/bin/nvcc" ] && command -v gcc >/dev/null; then
    if "$CUDA_HOME/bin/nvcc" -ptx -arch=sm_90 gpu/soak_kernels.cu -o build/gpu/soak_kernels.ptx >"$OUT/build_c.log" 2>&1 &&
        gcc -O2 -Wall gpu/soak_c.c -I include -I "$CUDA_HOME/include" -L lib -lcudapool \
            -L "$CUDA_HOME/lib64/stubs" -lcuda -lpthread -lm -ldl -Wl,-rpath,"$PWD/lib" -o build/gpu/soak_c >>"$OUT/build_c.log" 2>&1; then
        have_c=1
    else
        echo "FAIL building the C twin:"; tail -n 20 "$OUT/build_c.log"; failed=1
    fi
else
    echo "SKIP the C twin: no nvcc at $CUDA_HOME/bin or no gcc"
fi

# gpu_env NAME: the CUDA_VISIBLE_DEVICES=... setting process NAME gets
# (nothing: it inherits the caller's).
gpu_env() { :; }
if [ "$APART" = 1 ]; then
    visible=${CUDA_VISIBLE_DEVICES:-$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | tr -d ' ' | paste -sd, -)}
    first=${visible%%,*}
    rest=${visible#*,}
    second=${rest%%,*}
    if [ -n "$first" ] && [ "$rest" != "$visible" ] && [ -n "$second" ]; then
        echo "APART=1: native on GPU $first, cudapool and the C twin on GPU $second"
        gpu_env() { if [ "$1" = native ]; then echo "CUDA_VISIBLE_DEVICES=$first"; else echo "CUDA_VISIBLE_DEVICES=$second"; fi; }
    else
        echo "APART=1: fewer than two GPUs visible; all processes share one"
    fi
fi

case "$SEGMENTS" in
    off) kinds="off" ;;
    on) kinds="on" ;;
    *) kinds="off on" ;;
esac

for kind in $kinds; do
    conf="expandable_segments:False"
    [ "$kind" = on ] && conf="expandable_segments:True"
    echo "=== soak, expandable segments $kind, ${SOAK_S}s each: native, cudapool and the C twin at once"
    pids=()
    names=()
    if [ "$have_torch" = 1 ]; then
        for alloc in native cudapool; do
            env $(gpu_env "$alloc") \
                PYTORCH_CUDA_ALLOC_CONF="$conf" timeout -k 10 "$LIMIT" \
                "$PY" gpu/soak.py --allocator "$alloc" --seconds "$SOAK_S" >"$OUT/soak_${alloc}_$kind.log" 2>&1 &
            pids+=($!)
            names+=("${alloc}_$kind")
        done
    fi
    if [ "$have_c" = 1 ]; then
        env $(gpu_env c) \
            CUDAPOOL_CONF="$conf" KERNELS_PTX=build/gpu/soak_kernels.ptx timeout -k 10 "$LIMIT" \
            build/gpu/soak_c "$SOAK_S" >"$OUT/soak_c_$kind.log" 2>&1 &
        pids+=($!)
        names+=("c_$kind")
    fi
    for i in "${!pids[@]}"; do
        wait "${pids[$i]}"
        echo "${names[$i]} rc=$?" >>"$OUT/rc.txt"
    done
    for n in "${names[@]}"; do
        echo "--- $n (last lines)"
        log="$OUT/soak_${n}.log"
        [ "${n#c_}" != "$n" ] && log="$OUT/soak_c_${n#c_}.log"
        grep -v '^SOAK-RESULT' "$log" | tail -n 18
    done
done

if [ "$RACE" = 1 ] && [ "$have_torch" = 1 ]; then
    echo "=== capture-time record_stream race, $RACE_REPEATS repeats each way"
    timeout -k 10 $((RACE_REPEATS * 4 + 240)) "$PY" gpu/race_record_stream.py --repeats "$RACE_REPEATS" >"$OUT/race.log" 2>&1
    echo "race rc=$?" >>"$OUT/rc.txt"
    tail -n 6 "$OUT/race.log"
fi

# The table: one row per run, from the SOAK-RESULT and RACE-RESULT lines.
"$PY" - "$OUT" <<'PYEOF' || failed=1
import glob, json, os, sys
out = sys.argv[1]
rcs = {}
if os.path.exists(os.path.join(out, "rc.txt")):
    for line in open(os.path.join(out, "rc.txt")):
        k, _, v = line.strip().rpartition(" rc=")
        rcs[k] = v
rows, bad = [], False
for kind in ("off", "on"):
    for name, log in (("native", f"soak_native_{kind}.log"), ("cudapool", f"soak_cudapool_{kind}.log"),
                      ("cudapool C", f"soak_c_{kind}.log")):
        path = os.path.join(out, log)
        if not os.path.exists(path):
            continue
        res = None
        for line in open(path, errors="replace"):
            if line.startswith("SOAK-RESULT "):
                res = json.loads(line[len("SOAK-RESULT "):])
        key = {"native": f"native_{kind}", "cudapool": f"cudapool_{kind}", "cudapool C": f"c_{kind}"}[name]
        rc = rcs.get(key, "?")
        if res is None:
            rows.append((kind, name, "-", "-", "-", "-", "-", "-", "-", "-", "-", f"FAIL rc={rc}, no result"))
            bad = True
            continue
        if "skipped" in res:
            rows.append((kind, name, "-", "-", "-", "-", "-", "-", "-", "-", "-", "skipped: " + res["skipped"]))
            continue
        errors = res["errors"] if isinstance(res["errors"], int) else len(res["errors"])
        status = "PASS" if res["ok"] else f"FAIL rc={rc}"
        if name == "native":
            # native's bad delayed reads are the race the soak shows: not a failure of this run
            clean = (errors == 0 and not res.get("hang") and res.get("corrupted_elems") == 0 and res.get("leak_bytes") == 0
                     and res.get("bad_replays") == 0 and res.get("ipc_bad", 0) == 0)
            status = ("ok" if clean else f"FAIL rc={rc}") + (" (bad delayed reads: PyTorch's race)" if res["bad_delayed_reads"] else "")
            bad |= not clean
        else:
            bad |= not res["ok"]
        rows.append((kind, name, res["seconds"], res["ops"], res["verified"], res["corrupted_elems"],
                     f"{res['delayed_reads']} ({res['bad_delayed_reads']})",
                     f"{res['replays']} ({res['bad_replays']})", res.get("ipc", "-"), res["leak_bytes"],
                     f"{errors}/{res.get('hang') or 'no'}", status))
hdr = ("expandable", "allocator", "s", "ops", "verified", "corrupt", "delayed reads (bad)", "replays (bad)",
       "IPC (bad)", "leak B", "errors/hang", "result")
w = [max(len(str(r[i])) for r in rows + [hdr]) for i in range(len(hdr))]
print()
print("  ".join(str(h).ljust(w[i]) for i, h in enumerate(hdr)))
for r in rows:
    print("  ".join(str(c).ljust(w[i]) for i, c in enumerate(r)))
race = os.path.join(out, "race.log")
if os.path.exists(race):
    res = None
    for line in open(race, errors="replace"):
        if line.startswith("RACE-RESULT "):
            res = json.loads(line[len("RACE-RESULT "):])
    print()
    if res is None:
        print(f"record_stream race: no result (rc={rcs.get('race', '?')})")
        bad = True
    for r in res or []:
        if "skipped" in r:
            print(f"record_stream race, {r['allocator']}: skipped ({r['skipped']})")
            continue
        print(f"record_stream race, {r['allocator']:<8}: {r.get('bad_reads', '-')} bad reads of {r.get('repeats', '-')}, "
              f"reused at once {r.get('reused_at_once', '-')}, graph errors {r.get('graph_errors', '-')}, rc={r.get('rc')}")
        if r["allocator"] == "cudapool" and (r.get("bad_reads") != 0 or r.get("rc") != 0):
            bad = True
        if r["allocator"] == "native" and r.get("rc") not in (0, None):
            bad = True
print("\nSOAK: " + ("FAILED" if bad else "OK") + f" (logs in {out})")
sys.exit(1 if bad else 0)
PYEOF
exit $failed
