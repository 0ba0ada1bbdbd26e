#!/usr/bin/env bash
# gpu/diag_cpu_modes.sh - is the host's two-speed behaviour per CPU, per
# process, or neither? Runs the C mixed sequence (cudapool, bench/c_bench.c)
# pinned to each CPU in turn, twice, then unpinned, and prints ns/pair per run.
set -u
cd "$(dirname "$0")/.." || exit 1
mkdir -p build/bench
gcc -std=c11 -O2 -Wall -I include -I bench bench/c_bench.c -o build/bench/c_bench -L lib -lcudapool -ldl -pthread -Wl,-rpath,"$PWD/lib" || exit 1
lscpu | grep -i -E "model name|socket|core|thread|numa|mhz|hypervisor" ; cat /sys/kernel/mm/transparent_hugepage/enabled
n=$(nproc)
run() { "$@" build/bench/c_bench --config cudapool --sections mixed --mixed-pairs 100000 --reps 3 2>&1 >/dev/null | sed -n 's/.*\[mixed\] median \([0-9.]*\).*/\1/p'; }
for pass in 1 2; do
    line="pass $pass pinned:"
    for c in $(seq 0 $((n - 1))); do line+=" $c=$(run taskset -c "$c")"; done
    echo "$line"
done
line="unpinned:"
for i in $(seq 1 12); do line+=" $(run env)"; done
echo "$line"
