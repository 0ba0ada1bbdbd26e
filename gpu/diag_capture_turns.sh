#!/usr/bin/env bash
# One GPU call (twentieth session, issue 11): do cudapool's processes meet
# the host's slow state during graph captures more often than native's?
# In the full runs' rings, captures fall in two modes (forward about 4.5 or
# 6.5-7.5 ms), and over two runs cudapool's processes had 59 of 120
# captures in the slow one against native's 40 of 120, while alternated in
# one process the two are at parity. Here two processes take turns capture
# by capture on one CPU (bench/turn_pair.sh, main threads pinned as in the
# rings), CAPS captures each (graph section only): native against cudapool,
# and native against cudapool with the keeper off (cudapool_cold), PAIRS
# pairs each. Prints per pair the median per-capture ratio and how many of
# each side's captures were slow (forward over 1.25x the pair's fastest).
# Carry lib. About 4 minutes on an H100 host.
set -u
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH=$PWD/python CUDAPOOL_LIBRARY=$PWD/lib/libcudapool.so PYTHONUNBUFFERED=1
O=${OUT:-/tmp/capture-turns}; mkdir -p "$O"
PAIRS=${PAIRS:-3} CAPS=${CAPS:-24} CPU=${CPU:-2}
TESTS=${TESTS:-"cudapool cudapool_cold"}
T0=$(date +%s)
for r in $(seq 1 "$PAIRS"); do
	for t in $TESTS; do
		first=base; [ $((r % 2)) = 0 ] && first=test
		TURN_PIN=thread TURN_LIMIT=${TURN_LIMIT:-150} bash bench/turn_pair.sh "$CPU" "native/$t" "$r" native "$t" $first \
			"$O/$t.$r.json" --sections graph --graph-captures "$CAPS" || echo "pair $t $r failed: $(tail -n 3 "$O/$t.$r.json.log")"
		echo "pair native/$t $r done ($(($(date +%s) - T0)) s)"
	done
done
python3 - "$O" <<'PY'
import glob, json, os, statistics, sys
rows = {}
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    sides = {}
    for line in open(path):
        if line.startswith("{"):
            d = json.loads(line)
            if d.get("section") == "graph":
                sides[d["turns_role"]] = d
    if set(sides) != {"base", "test"}:
        print(f"{os.path.basename(path)}: incomplete")
        continue
    b, t = sides["base"], sides["test"]
    fb, ft = b["graph_forward_reps_ms"], t["graph_forward_reps_ms"]
    cb, ct = b["graph_capture_reps_ms"], t["graph_capture_reps_ms"]
    fast = min(fb + ft)
    slow = lambda xs: sum(x > 1.25 * fast for x in xs)
    ratio = statistics.median(y / x for x, y in zip(cb, ct))
    kind = os.path.basename(path).split(".")[0]
    rows.setdefault(kind, []).append((ratio, slow(fb), slow(ft), len(fb)))
    print(f"{os.path.basename(path)}: capture {t['config']}/native {ratio:.3f}; slow forwards native {slow(fb)}/{len(fb)}, "
          f"{t['config']} {slow(ft)}/{len(ft)}; fastest forward {fast:.2f} ms")
print()
print(f"{'test':<16}{'pairs':>6}{'capture test/native':>26}{'slow native':>14}{'slow test':>12}")
for kind, rs in rows.items():
    rat = sorted(r[0] for r in rs)
    print(f"{kind:<16}{len(rs):>6}{statistics.median(rat):>11.3f} ({rat[0]:.3f}-{rat[-1]:.3f})"
          f"{sum(r[1] for r in rs):>8}/{sum(r[3] for r in rs):<5}{sum(r[2] for r in rs):>6}/{sum(r[3] for r in rs):<5}")
PY
echo "total $(($(date +%s) - T0)) s; host: $(nproc) CPUs; lib $(head -c 120 lib/BUILD_COMMIT | tr '\n' ' ')"
