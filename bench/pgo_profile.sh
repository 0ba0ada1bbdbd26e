#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# pgo_profile.sh OUT [DIR]: writes OUT (normally capi/default.pgo), the CPU
# profile that go build uses for profile-guided optimization of
# libcudapool.so (docs/hot-path.md, "Why it is built this way"). Run by
# make pgo.
#
# Most of it is the library itself, built with -tags cudapool_cpuprofile
# (capi/cpuprofile.go) and driven by bench/c_bench.c on the simulator: the
# class path's mixed pairs (one crossing per pair, the queued free and the
# malloc, as PyTorch's allocator class makes them) for about half the
# samples, then the C API's mixed pairs, 4 KiB pairs through Go (front cache
# off) and through the front, threads and the recorded trace. The Go
# benchmark BenchmarkPGOCapture (allocator/pgo_test.go) adds graph
# captures' mallocs. DIR (default build/pgo) keeps the parts.
set -euo pipefail
out=${1:?usage: pgo_profile.sh OUT [DIR]}
dir=${2:-build/pgo}
GO=${GO:-go}
CC=${CC:-gcc}
rm -rf "$dir"
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)

# The library as make lib builds it, less the profile it would read, plus
# the profiling hook.
"$GO" build -pgo=off -tags cudapool_cpuprofile -buildmode=c-shared \
	-ldflags="-extldflags=-Wl,--version-script=$PWD/capi/exports.map" -o "$dir/libcudapool.so" ./capi
"$CC" -std=c11 -O2 -Wall -I include -I bench bench/c_bench.c -o "$dir/c_bench" \
	-L "$dir" -lcudapool -ldl -pthread -Wl,-rpath,"$dir"

run() { # NAME ENV... -- C_BENCH ARGS...
	local name=$1 envs=()
	shift
	while [ "$1" != -- ]; do envs+=("$1"); shift; done
	shift
	echo "pgo: $name"
	env -u CUDAPOOL_CONF -u PYTORCH_CUDA_ALLOC_CONF CUDAPOOL_BACKEND=sim CUDAPOOL_CPUPROFILE="$dir/$name.prof" \
		"${envs[@]}" "$dir/c_bench" --config cudapool "$@" >"$dir/$name.json" 2>"$dir/$name.log" ||
		{ cat "$dir/$name.log"; exit 1; }
}
run class-mixed C_BENCH_FREE=deferred -- --sections mixed --reps 20 --mixed-pairs 1000000
run capi-mixed -- --sections mixed --reps 5 --mixed-pairs 1000000
run class-hot-go C_BENCH_FREE=deferred CUDAPOOL_CONF=front_cache:False -- --sections hot --reps 5 --hot-pairs 1000000
run capi-hot-threads-trace -- --sections hot,threads,trace --trace demo/trace.txt --reps 3 --thread-secs 0.3 --thread-reps 1

echo "pgo: BenchmarkPGOCapture"
"$GO" test -pgo=off -run '^$' -bench '^BenchmarkPGOCapture$' -benchtime 0.5s -o "$dir/allocator.test" \
	-cpuprofile "$dir/capture.prof" ./allocator >"$dir/capture.log"

# -symbolize=none: symbolized again from the binaries, the functions would
# lose their start lines, which the compiler needs to match call sites.
"$GO" tool pprof -symbolize=none -proto "$dir"/*.prof >"$out.tmp" 2>/dev/null
"$GO" tool preprofile -i "$out.tmp" -o "$dir/check.pre" # fails on a profile the compiler cannot use
mv "$out.tmp" "$out"
echo "pgo: wrote $out ($(wc -c <"$out") bytes)"
"$GO" tool pprof -top -nodecount=12 "$out" 2>/dev/null | sed -n '/flat%/,$p'
