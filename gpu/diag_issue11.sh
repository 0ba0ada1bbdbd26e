#!/usr/bin/env bash
# gpu/diag_issue11.sh - where issue 11's unmet rows stand, per process, in
# one device call (about 8 minutes on an H100 host; carry lib/):
#   1. the C mixed sequence (bench/workloads.h): native, cudapool, cudapool
#      with front_cache:False; ROUNDS fresh processes each, interleaved;
#   2. torch.empty + free, 4 KiB and mixed (bench/torch_bench.py --sections
#      empty): the same three, ROUNDS processes each, interleaved;
#   3. graph capture (torch_bench.py --sections graph: the median of 6
#      captures per process, and the first): native, cudapool and both with
#      expandable segments, GROUNDS processes each;
#   4. the phases of a capture, first and later (gpu/diag_capture.py).
# Prints every process's figure, then the medians (min-max) last.
#   ROUNDS=5 GROUNDS=3 bash gpu/diag_issue11.sh
set -u
cd "$(dirname "$0")/.." || exit 1
ROUNDS=${ROUNDS:-5}
GROUNDS=${GROUNDS:-3}
# shellcheck source=gpu/diag_setup.sh
. gpu/diag_setup.sh

R=$D/rows.txt
: >"$R"
for r in $(seq 1 "$ROUNDS"); do
    v=$(env -u PYTORCH_CUDA_ALLOC_CONF $NB --config native --sections mixed 2>&1 >/dev/null | sed -n 's/.*\[mixed\] median \([0-9.]*\).*/\1/p')
    echo "c_mixed native $v" >>"$R"
    v=$($CB --config cudapool --sections mixed 2>&1 >/dev/null | sed -n 's/.*\[mixed\] median \([0-9.]*\).*/\1/p')
    echo "c_mixed cudapool $v" >>"$R"
    v=$(CUDAPOOL_CONF=front_cache:False $CB --config cudapool --sections mixed 2>&1 >/dev/null | sed -n 's/.*\[mixed\] median \([0-9.]*\).*/\1/p')
    echo "c_mixed cudapool_nofront $v" >>"$R"
done
echo "C mixed done at $(el)s"

for r in $(seq 1 "$ROUNDS"); do
    for cfg in native cudapool cudapool_nofront; do
        $PY bench/torch_bench.py $cfg --sections empty 2>>"$D/torch.log" |
            $PY -c 'import json,sys
for l in sys.stdin:
    d=json.loads(l)
    if d.get("section")=="empty":
        print("torch_small", d["config"], d["empty_small_us"]); print("torch_mixed", d["config"], d["empty_mixed_us"])' >>"$R"
    done
done
echo "torch.empty done at $(el)s"

for r in $(seq 1 "$GROUNDS"); do
    for cfg in native cudapool expandable cudapool_exp; do
        $PY bench/torch_bench.py $cfg --sections graph 2>>"$D/torch.log" |
            $PY -c 'import json,sys
for l in sys.stdin:
    d=json.loads(l)
    if d.get("section")=="graph":
        print("capture", d["config"], d["graph_capture_ms"]); print("capture_first", d["config"], d["graph_capture_first_ms"])
        print("#", d["config"], " ".join("%.2f" % v for v in d["graph_capture_reps_ms"]))' >>"$R"
    done
done
echo "graph done at $(el)s"

if [ "$(el)" -lt 420 ]; then
    timeout $((560 - $(el))) env PYTHONPATH=python $PY gpu/diag_capture.py 2 6 >"$D/phases.txt" 2>&1
fi
echo "phases done at $(el)s"
[ -n "${OUT:-}" ] && cp "$R" "$D/phases.txt" "$OUT/" 2>/dev/null
grep '^#' "$R"
cat "$D/phases.txt" | sed -n '/first capture/,$p'
echo
$PY - "$R" <<'EOF'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    p = line.split()
    if len(p) == 3 and p[0] != "#" and p[2] not in ("", "None"):
        rows.setdefault(p[0], {}).setdefault(p[1], []).append(float(p[2]))
print(f"{'row':14} {'config':18} {'median':>9} {'min-max':>19}  ratio to native (median)")
for row, cfgs in rows.items():
    for cfg, v in cfgs.items():
        ref = cfgs.get("expandable") if cfg == "cudapool_exp" and "expandable" in cfgs else cfgs.get("native")
        ratio = f"{statistics.median(v) / statistics.median(ref):.3f}x" if ref else ""
        print(f"{row:14} {cfg:18} {statistics.median(v):9.3f} {min(v):9.3f}-{max(v):9.3f}  {ratio}  n={len(v)}")
EOF
