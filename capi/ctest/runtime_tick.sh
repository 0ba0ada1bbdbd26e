#!/bin/sh
# runtime_tick.sh PROG LIBDIR - whether the library in LIBDIR has the Go
# runtime's callback tick (capi/build_lib.sh; docs/hot-path.md 22), seen in
# the runtime's own trace: after 3,000 calls from C, some P must have
# counted at least 1,500 schedule ticks if LIBDIR/BUILD_COMMIT says
# "runtime: tick", and none more than 1,500 if it says "runtime: stock" (a
# call from C then counts none; the keeper's few hundred a second do); and
# the runtime's init-once flag must be there exactly when it says so.
set -eu
prog=$1 libdir=$2
calls=3000
want=$(sed -n 's/^runtime: \([a-z]*\).*/\1/p' "$libdir/BUILD_COMMIT")
out=$(env -u GOMAXPROCS LD_LIBRARY_PATH="$libdir" GODEBUG=schedtrace=100,scheddetail=1 \
	CUDAPOOL_BACKEND=sim "$prog" $calls 2>&1)
max=$(printf '%s\n' "$out" | sed -n 's/^ *P[0-9]*: .*schedtick=\([0-9]*\).*/\1/p' | sort -n | tail -n 1)
if [ -z "$max" ]; then
	echo "FAIL  no schedtrace lines from $prog"
	exit 1
fi
case $want in
tick) [ "$max" -ge $((calls / 2)) ] && ok=1 || ok=0 ;;
stock) [ "$max" -lt $((calls / 2)) ] && ok=1 || ok=0 ;;
*)
	echo "FAIL  $libdir/BUILD_COMMIT names no runtime"
	exit 1
	;;
esac
[ $ok = 1 ] && v="ok   " || v="FAIL "
echo "$v $libdir (runtime: $want): the busiest P counted $max schedule ticks over $calls calls from C"
[ $ok = 1 ]

# init-once (capi/build_lib.sh): the patched runtime's flag is in the
# library exactly when the build record says so.
if grep -q '^runtime: .*init-once' "$libdir/BUILD_COMMIT"; then
	nm "$libdir/libcudapool.so" | grep -q ' runtime\.cgoInitDone$' ||
		{ echo "FAIL  $libdir says init-once, and its runtime has no cgoInitDone"; exit 1; }
	echo "ok    $libdir: the runtime receives from main_init_done once (init-once)"
elif nm "$libdir/libcudapool.so" | grep -q ' runtime\.cgoInitDone$'; then
	echo "FAIL  $libdir has cgoInitDone, and its build record does not say init-once"
	exit 1
fi
