#!/usr/bin/env bash
# capi/runtime_tick.sh OUTDIR - writes OUTDIR/overlay.json, a go build
# -overlay that replaces the toolchain's runtime/cgocall.go with a copy in
# which a call from C into Go counts as a schedule tick of the P it takes
# (docs/hot-path.md 22: without it sysmon takes that P back at every round
# once it is 10 ms old, and keeps its 20 us polling while a C thread calls
# in). While no P is idle it does not count (a thread may be waiting for
# a P, and sysmon's retakes are what hand it one). The copy is made from the installed toolchain's own file; if the
# anchor line is not found (another Go release), it fails and says so.
set -eu
out=$1
goroot=$(go env GOROOT)
src=$goroot/src/runtime/cgocall.go
mkdir -p "$out"
anchor='	exitsyscall() // coming out of cgo call'
n=$(grep -cxF "$anchor" "$src" || true)
if [ "$n" != 1 ]; then
    echo "runtime_tick.sh: $src ($(go env GOVERSION)) has the anchor line $n times, not once" >&2
    exit 1
fi
awk -v a="$anchor" '{ print } $0 == a {
    print "\t// cudapool (capi/runtime_tick.sh): the callback takes a schedule tick,"
    print "\t// so that sysmon does not take its P back at every round; not while"
    print "\t// no P is idle, when a thread may be waiting for this one."
    print "\tif pp := gp.m.p.ptr(); pp != nil && sched.npidle.Load() > 0 {"
    print "\t\tpp.schedtick++"
    print "\t}"
}' "$src" >"$out/cgocall.go"
printf '{"Replace": {"%s": "%s"}}\n' "$src" "$(cd "$out" && pwd)/cgocall.go" >"$out/overlay.json"
