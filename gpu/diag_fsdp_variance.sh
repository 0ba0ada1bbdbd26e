#!/usr/bin/env bash
# gpu/diag_fsdp_variance.sh - how much FSDP2 launches of one allocator
# differ from each other, and what narrows it. The step is host-bound (its
# host issue time equals its GPU time), and two identical launches taking
# turns step by step differed by up to 10% (session 17), so the spread is
# the process's own. ROUNDS rounds of one launch per mode, interleaved:
#   plain  - as the benchmark launches it;
#   fixed  - PYTHONHASHSEED=0 and address space randomization off
#            (setarch -R): the same layout in every launch;
#   half   - pinned to the first half of the CPUs (one rank's share in the
#            2-GPU benchmark).
# Prints the host facts (NUMA nodes, transparent huge pages), every launch's
# median step, and per mode the median, min-max and spread (stdev/mean).
# NPROC GPUs (default 1); CONFIG (default cudapool). About 17 s a launch:
#   ROUNDS=4 bash gpu/diag_fsdp_variance.sh
set -u
cd "$(dirname "$0")/.." || exit 1
ROUNDS=${ROUNDS:-4}
NPROC=${NPROC:-1}
CONFIG=${CONFIG:-cudapool}
MODES=${MODES:-plain fixed half}
DEADLINE=${DEADLINE:-420}
DIAG_BUILD_C=0
# shellcheck source=gpu/diag_setup.sh
. gpu/diag_setup.sh
echo "library $(cat lib/BUILD_COMMIT 2>/dev/null || echo ?), config $CONFIG, $NPROC GPU(s)"
lscpu 2>/dev/null | grep -E '^(Model name|CPU\(s\)|NUMA node|Thread|Socket)' | sed 's/  */ /g'
for f in /sys/kernel/mm/transparent_hugepage/enabled /proc/sys/kernel/randomize_va_space; do
    echo "$f: $(cat $f 2>/dev/null || echo unreadable)"
done
setarch "$(uname -m)" -R true 2>/dev/null && echo "setarch -R works" || echo "setarch -R fails"
cpus=$(taskset -pc $$ 2>/dev/null | sed 's/.*: *//')
ncpu=$(nproc)
half="0-$((ncpu / 2 - 1))"

launch() { # MODE ROUND
    local pre=() out="$D/$1.$2.json"
    case $1 in
    fixed) pre=(env PYTHONHASHSEED=0 setarch "$(uname -m)" -R) ;;
    half) pre=(taskset -c "$half") ;;
    esac
    timeout 120 "${pre[@]}" "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" \
        bench/fsdp2_bench.py "$CONFIG" >"$out" 2>"$out.log" || echo "$1 $2 failed (rc $?): $out.log"
}

for r in $(seq 1 "$ROUNDS"); do
    [ "$(el)" -gt "$DEADLINE" ] && { echo "stopped before round $r: past ${DEADLINE}s"; break; }
    # rotate the order, so that no mode always runs first in a round
    set -- $MODES
    for _ in $(seq 1 $(((r - 1) % $#))); do set -- "${@:2}" "$1"; done
    for m in "$@"; do launch "$m" "$r"; done
    echo "round $r done at $(el)s"
done
echo "CPUs $cpus; half = $half"
$PY - "$D" $MODES <<'PYEOF'
import glob, json, statistics, sys
d, modes = sys.argv[1], sys.argv[2:]
print(f"{'mode':6s} {'n':>2s} {'median':>7s} {'min':>7s} {'max':>7s} {'spread':>7s}  launches (ms/step; cpu ms)")
for m in modes:
    vals = []
    for f in sorted(glob.glob(f"{d}/{m}.*.json")):
        for line in open(f):
            if line.startswith("{"):
                r = json.loads(line)
                vals.append((r["fsdp_ms_per_step"], r.get("fsdp_cpu_ms_per_step", float("nan"))))
    if not vals:
        print(f"{m:6s}  0"); continue
    v = [a for a, _ in vals]
    sp = statistics.pstdev(v) / statistics.mean(v)
    print(f"{m:6s} {len(v):2d} {statistics.median(v):7.2f} {min(v):7.2f} {max(v):7.2f} {sp:7.3f}  "
          + " ".join(f"{a:.1f};{c:.1f}" for a, c in vals))
PYEOF
echo "total $(el)s"
