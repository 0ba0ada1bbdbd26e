#!/usr/bin/env bash
# diag_hot_path.sh - one command on the GPU machine: where one torch.empty +
# free pair spends its time with cudapool's C++ class (docs/hot-path.md).
#
#   bash gpu/diag_hot_path.sh [REPEATS]      (needs lib/ built and carried)
#
# 1. bench/hot_path.c on the real driver: a call into Go (warm, first on a
#    thread, after 1/10 ms in C), the class-path pair in C, after touching
#    2/8 MiB. Thread CPU time, median of 7 rounds.
# 2. gpu/bench_class_paths.py: torch.empty+free through the class, the
#    pluggable paths, the floor (trivial C allocator) and native, REPEATS
#    fresh processes each, interleaved (default 5).
# 3. The split of the class path's 4 KiB pair, from both (printed last).
# Output also lands in $OUT (default /tmp/cudapool-diag) when set.
set -u
cd "$(dirname "$0")/.." || exit 1
REPS=${1:-5}
OUT=${OUT:-/tmp/cudapool-diag}
mkdir -p build/bench "$OUT"
if [ ! -f lib/libcudapool.so ]; then
    echo "lib/libcudapool.so is missing: run make where Go is, and carry lib/"
    exit 1
fi
gcc -O2 -Wall -shared -fPIC bench/floor_alloc.c -o build/bench/libfloor.so -ldl -pthread || exit 1
gcc -std=c11 -O2 -Wall -I include bench/hot_path.c -o build/bench/hot_path -L lib -lcudapool -ldl -pthread \
    -Wl,-rpath,"$PWD/lib" || exit 1
unset PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF CUDAPOOL_CONF CUDAPOOL_BACKEND
export CUDAPOOL_LIBRARY=$PWD/lib/libcudapool.so FLOOR_LIB=$PWD/build/bench/libfloor.so PYTHONPATH=$PWD/python
echo "host: $(grep -m 1 'model name' /proc/cpuinfo | sed 's/.*: *//'), $(nproc) CPUs; $(date -u '+%Y-%m-%d %H:%M UTC')"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1

echo "==== C level (bench/hot_path.c, real driver)"
./build/bench/hot_path 7 | tee "$OUT/hot_path.txt" || exit 1
echo "==== the pair with the treap free set instead of segfit (CUDAPOOL_CONF=free_set:treap)"
CUDAPOOL_CONF=free_set:treap ./build/bench/hot_path 3 | grep -E "pair" | tee "$OUT/hot_path_treap.txt"
echo "==== the same with GODEBUG=schedtrace (keeps Go's sysmon out of its deep sleep; docs/hot-path.md)"
GODEBUG=schedtrace=1000000000 ./build/bench/hot_path 3 2>/dev/null | grep -E "asleep|class path" | tee "$OUT/hot_path_schedtrace.txt"
echo "==== torch level (gpu/bench_class_paths.py, $REPS fresh processes per path)"
python3 gpu/bench_class_paths.py "$REPS" --json "$OUT/paths.json" | tee "$OUT/paths.txt" || exit 1

echo
python3 - "$OUT/hot_path.txt" "$OUT/paths.json" <<'EOF'
import json, re, statistics, sys
c = {}
for line in open(sys.argv[1]):
    m = re.match(r"(.+?)\s+(cpu|wall)\s+([\d.]+) \(", line)
    if m:
        c[m.group(1).strip()] = float(m.group(3)) / 1000  # us
t = json.load(open(sys.argv[2]))
med = lambda mode, col: statistics.median(t[mode][col]) if t.get(mode, {}).get(col) else float("nan")
cls, nat, flo = "class", "native", "floor (trivial C allocator)"
C, N, F = med(cls, "hot"), med(nat, "hot"), med(flo, "hot")
go = c["call into Go, warm thread (near no-op)"]
pair = c["pair, PyTorch class path (1 Go call)"]
rows = [
    ("torch.empty+free, native", N),
    ("torch.empty+free, cudapool class path", C),
    ("  PyTorch's pluggable path itself (floor)", F),
    ("  cudapool over the floor", C - F),
    ("    one call into Go (warm thread)", go),
    ("    allocator work + C free queue (pair in C less the call)", pair - go),
    ("    the rest (class C++ path vs the floor's, cache effects)", C - F - pair),
    ("  extra for a pair after 2 MiB touched, cudapool", med(cls, "touched") - C),
    ("  extra for a pair after 2 MiB touched, native", med(nat, "touched") - N),
    ("  one torch.empty after 10 ms asleep, cudapool", med(cls, "asleep")),
    ("  one torch.empty after 10 ms asleep, native", med(nat, "asleep")),
    ("  call into Go after 10 ms asleep in C (hot_path)", c["call into Go after 10 ms asleep in C"]),
]
print("==== split of one 4 KiB torch.empty+free pair, us (medians)")
for name, v in rows:
    print(f"{name:64} {v:8.3f}")
EOF
