#!/usr/bin/env bash
# gpu/diag_pairing.sh - does running two configurations at the same time
# pair them in the host's state? (issue 11: the host runs each process fast
# or 1.5-1.9x slower, so ratios of medians over a handful of processes move
# by tens of percent from run to run.) In one device call (about 7 minutes
# on an H100 host; carry lib/):
#   seq   native, then cudapool, each alone (as bench/run_bench.sh runs them);
#   conc  native and cudapool started together on CPUs of different cores,
#         their timed sections aligned by BENCH_START_AT (CPUs swapped each
#         round);
#   same  cudapool and cudapool together (the noise of a pair of equals).
# for the C mixed sequence (bench/c_bench.c, bench/native_bench.cpp) and for
# torch.empty + free, 4 KiB and mixed (bench/torch_bench.py --sections empty).
# Prints every round, then per mode the median (min-max) of the per-round
# ratios and the spread of their logarithms: pairing works where conc's and
# same's spreads are well below seq's.
#   ROUNDS=10 TROUNDS=4 bash gpu/diag_pairing.sh
set -u
cd "$(dirname "$0")/.." || exit 1
ROUNDS=${ROUNDS:-10}
TROUNDS=${TROUNDS:-4}
# shellcheck source=gpu/diag_setup.sh
. gpu/diag_setup.sh

# Two CPU sets on different physical cores (and their SMT siblings left idle).
siblings() { cat "/sys/devices/system/cpu/cpu$1/topology/thread_siblings_list" 2>/dev/null || echo "$1"; }
n=$(nproc)
A=2 B=$((n / 2 + 2))
[ "$(siblings $A)" = "$(siblings $B)" ] && B=$((A + 2))
echo "CPUs: $n; C processes on $A and $B (siblings: $(siblings $A) / $(siblings $B))"
TA="$A,$((A + 1))" TB="$B,$((B + 1))"

R=$D/rows.txt
: >"$R"
cmix() { # CPU CONFIG START_AT -> ns/pair
    local prog=$CB
    [ "$2" = native ] && prog=$NB
    BENCH_START_AT=$3 taskset -c "$1" $prog --config "$2" --sections mixed --mixed-pairs 100000 --reps 7 2>&1 >/dev/null |
        sed -n 's/.*\[mixed\] median \([0-9.]*\).*/\1/p'
}
soon() { $PY -c "import time; print(time.time() + $1)"; }
# together FUNC LEAD CPUS_A CONFIG_A CPUS_B CONFIG_B: both at once, their
# sections starting LEAD seconds from now; outputs in $D/a and $D/b.
together() {
    local t
    t=$(soon "$2")
    $1 "$3" "$4" "$t" >"$D/a" &
    $1 "$5" "$6" "$t" >"$D/b"
    wait
}
for r in $(seq 1 "$ROUNDS"); do
    a=$(cmix $A native "") b=$(cmix $A cudapool "")
    echo "c seq $r $a $b" >>"$R"
    x=$A y=$B
    [ $((r % 2)) = 0 ] && x=$B y=$A
    together cmix 3 $x native $y cudapool
    echo "c conc $r $(cat "$D/a") $(cat "$D/b")" >>"$R"
    together cmix 3 $x cudapool $y cudapool
    echo "c same $r $(cat "$D/a") $(cat "$D/b")" >>"$R"
done
echo "C done at $(el)s"

tempty() { # CPUS CONFIG START_AT -> "small mixed" us/pair
    BENCH_START_AT=$3 taskset -c "$1" $PY bench/torch_bench.py "$2" --sections empty 2>>"$D/torch.log" |
        $PY -c 'import json,sys
for l in sys.stdin:
    d=json.loads(l)
    if d.get("section")=="empty":
        print(d.get("empty_small_us","nan"), d.get("empty_mixed_us","nan"))'
}
for r in $(seq 1 "$TROUNDS"); do
    read -r a1 a2 <<<"$(tempty $TA native "")"
    read -r b1 b2 <<<"$(tempty $TA cudapool "")"
    echo "t4k seq $r $a1 $b1" >>"$R"
    echo "tmix seq $r $a2 $b2" >>"$R"
    x=$TA y=$TB
    [ $((r % 2)) = 0 ] && x=$TB y=$TA
    together tempty 15 $x native $y cudapool
    read -r a1 a2 <"$D/a"
    read -r b1 b2 <"$D/b"
    echo "t4k conc $r $a1 $b1" >>"$R"
    echo "tmix conc $r $a2 $b2" >>"$R"
    if [ "$r" -le 2 ]; then
        together tempty 15 $x cudapool $y cudapool
        read -r a1 a2 <"$D/a"
        read -r b1 b2 <"$D/b"
        echo "t4k same $r $a1 $b1" >>"$R"
        echo "tmix same $r $a2 $b2" >>"$R"
    fi
done
echo "torch done at $(el)s"
grep -h "BENCH_START_AT passed" "$D/torch.log" | head -n 3

echo
echo "==== every round: row mode round first second (first = native except in same) ===="
cat "$R"
echo
$PY - "$R" <<'EOF'
import math, statistics as st, sys
rows = {}
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) != 5:
        continue
    try:
        a, b = float(f[3]), float(f[4])
    except ValueError:
        continue
    if a > 0 and b > 0:
        rows.setdefault((f[0], f[1]), []).append((a, b))
print("==== per-round ratio second/first: median (min-max), spread = stdev of log ratio ====")
print(f"{'row':5} {'mode':5} {'n':>2} {'first med':>10} {'second med':>10} {'ratio':>6} {'min':>6} {'max':>6} {'spread':>7}")
for (row, mode), v in sorted(rows.items()):
    rs = [b / a for a, b in v]
    logs = [math.log(x) for x in rs]
    sd = st.stdev(logs) if len(logs) > 1 else float("nan")
    print(f"{row:5} {mode:5} {len(v):2d} {st.median(a for a, _ in v):10.2f} {st.median(b for _, b in v):10.2f} "
          f"{st.median(rs):6.3f} {min(rs):6.3f} {max(rs):6.3f} {sd:7.3f}")
EOF
echo "total $(el)s"
