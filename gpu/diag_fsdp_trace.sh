#!/usr/bin/env bash
# gpu/diag_fsdp_trace.sh - the allocator's own cost in an FSDP2 step. The
# step is host-bound, and its time is mostly Python's: this measures the
# part that is the allocator's, where the step's noise cannot hide it.
# Records rank 0's allocations over the FSDP2 benchmark's steps on NPROC
# GPUs (default 1) with PyTorch's allocator (bench/fsdp2_bench.py
# --record-trace), then replays the trace REPS times per allocator in fresh
# processes, interleaved: native (native_bench), cudapool through the C API
# (c_bench) and cudapool with frees deferred as PyTorch's class path frees
# (C_BENCH_FREE=deferred); the training trace demo/train75.txt.gz too.
# Prints per replay ns per operation and peak reserved, and per allocator
# the median (min-max), with the allocator's time per step that implies.
# Carry lib/; about 2 minutes:
#   REPS=5 bash gpu/diag_fsdp_trace.sh
set -u
cd "$(dirname "$0")/.." || exit 1
REPS=${REPS:-5}
NPROC=${NPROC:-1}
# shellcheck source=gpu/diag_setup.sh
. gpu/diag_setup.sh
echo "library $(cat lib/BUILD_COMMIT 2>/dev/null || echo ?)"
gpus=$(seq -s, 0 $((NPROC - 1)))
env CUDA_VISIBLE_DEVICES="$gpus" timeout 300 "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" \
    bench/fsdp2_bench.py native --record-trace "$PWD/$D/fsdp.txt" >"$D/record.json" 2>"$D/record.log" ||
    { tail -n 20 "$D/record.log"; echo "recording failed"; exit 1; }
grep -h "recorded" "$D/record.log"
steps=$("$PY" -c "import json,sys; r=json.loads(open(sys.argv[1]).readline()); print(r['fsdp_steps'] + r['fsdp_warmup_steps'])" "$D/record.json")
zcat demo/train75.txt.gz >"$D/train75.txt"
echo "recorded at $(el)s; FSDP2 steps in the trace: $steps"

replay() { # TRACE ALLOC REP
    local out="$D/$1.$2.$3.json" pre=()
    case $2 in
    native) pre=("$NB" --config native) ;;
    cudapool) pre=("$CB" --config cudapool) ;;
    deferred) pre=(env C_BENCH_FREE=deferred "$CB" --config cudapool) ;;
    esac
    timeout 120 "${pre[@]}" --sections trace --trace "$D/$1.txt" --trace-repeats 3 >"$out" 2>"$out.log" ||
        echo "$1 $2 $3 failed: $out.log"
}
for r in $(seq 1 "$REPS"); do
    for t in fsdp train75; do
        for a in native cudapool deferred; do replay "$t" "$a" "$r"; done
    done
done
echo "replayed at $(el)s"
"$PY" - "$D" "$steps" <<'PYEOF'
import glob, json, statistics, sys
d, fsdp_steps = sys.argv[1], int(sys.argv[2])
steps = {"fsdp": fsdp_steps, "train75": 75}
print(f"{'trace':8s} {'allocator':9s} {'n':>2s} {'ns/op':>8s} {'(min-max)':>17s} {'ops':>8s} {'us/step':>8s} {'peak GiB':>8s}")
for t in ("fsdp", "train75"):
    for a in ("native", "cudapool", "deferred"):
        ns, peak, ops = [], [], 0
        for f in sorted(glob.glob(f"{d}/{t}.{a}.*.json")):
            for line in open(f):
                if '"trace_ns_per_op"' in line:
                    r = json.loads(line)
                    ns.append(r["trace_ns_per_op"]); peak.append(r["trace_peak_reserved"]); ops = r["trace_ops"]
        if not ns:
            print(f"{t:8s} {a:9s}  0"); continue
        m = statistics.median(ns)
        print(f"{t:8s} {a:9s} {len(ns):2d} {m:8.1f} ({min(ns):7.1f}-{max(ns):7.1f}) {ops:8d} "
              f"{m * ops / steps[t] / 1e3:8.1f} {statistics.median(peak) / 2**30:8.3f}")
PYEOF
echo "total $(el)s"
