#!/usr/bin/env bash
# gpu/diag_lib_ab.sh - two builds of libcudapool.so compared on the GPU host
# through bench/pair_bench.c (issue 11: the C mixed row). pair_bench runs
# cudapool and PyTorch's allocator in one process, their reps alternated, and
# prints the median per-pair ratio cudapool/native; its library is found
# through its run path (RUNPATH), which LD_LIBRARY_PATH overrides, so one
# program serves both builds. ROUNDS rounds, each one process per build in
# alternating order (A B, B A, ...); per build the median (min-max) of its
# processes' ratios, and per round the ratio of B's to A's.
#   A=build/lib_old B=lib ROUNDS=5 SECTIONS=mixed bash gpu/diag_lib_ab.sh
# (carry both folders; A and B must each hold libcudapool.so).
set -u
cd "$(dirname "$0")/.." || exit 1
A=${A:-build/lib_old}
B=${B:-lib}
ROUNDS=${ROUNDS:-5}
SECTIONS=${SECTIONS:-mixed}
CPU=${CPU:-2}
# shellcheck source=gpu/diag_setup.sh
. gpu/diag_setup.sh
PB=build/bench/pair_bench
[ -x $PB ] || { echo "pair_bench was not built ($D/build.log)"; tail -n 20 "$D/build.log"; exit 1; }
for x in "$A" "$B"; do
    [ -f "$x/libcudapool.so" ] || { echo "no $x/libcudapool.so"; exit 1; }
    echo "$x: build $(cat "$x/BUILD_COMMIT" 2>/dev/null || echo ?), loaded as $(LD_LIBRARY_PATH=$PWD/$x ldd $PB | grep -o '=> [^ ]*libcudapool.so')"
done
run() { # run DIR: one pair_bench process on DIR's library; prints "section ratio cudapool_ns native_ns" lines
    LD_LIBRARY_PATH=$PWD/$1 taskset -c "$CPU" $PB --sections "$SECTIONS" 2>/dev/null | $PY -c 'import json,sys
for l in sys.stdin:
    d = json.loads(l)
    if "ratio" in d:
        print(d["section"], d["ratio"], d["cudapool_ns"], d["native_ns"])'
}
for r in $(seq 1 "$ROUNDS"); do
    if [ $((r % 2)) = 1 ]; then order="A B"; else order="B A"; fi
    for w in $order; do
        if [ $w = A ]; then dir=$A; else dir=$B; fi
        run "$dir" | sed "s/^/$w $r /" | tee -a "$D/ab.txt"
    done
done
echo "done at $(el)s"
$PY - "$D/ab.txt" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
secs = sorted({r[2] for r in rows})
print(f"\n{'section':8} {'build':6} {'cudapool/native: median (min-max)':>36} {'cudapool ns':>12} {'native ns':>10}")
for s in secs:
    for w in ("A", "B"):
        v = [r for r in rows if r[0] == w and r[2] == s]
        if not v:
            continue
        q = [float(r[3]) for r in v]
        print(f"{s:8} {w:6} {statistics.median(q):>20.3f} ({min(q):.3f}-{max(q):.3f}) n={len(q):<3}"
              f"{statistics.median(float(r[4]) for r in v):>8.0f} {statistics.median(float(r[5]) for r in v):>10.0f}")
    byr = {}
    for r in rows:
        if r[2] == s:
            byr.setdefault(r[1], {})[r[0]] = float(r[3])
    q = [d["B"] / d["A"] for d in byr.values() if "A" in d and "B" in d]
    if q:
        print(f"{s:8} B/A per round: median {statistics.median(q):.3f} ({min(q):.3f}-{max(q):.3f}), {len(q)} rounds")
PY
