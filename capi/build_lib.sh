#!/usr/bin/env bash
# capi/build_lib.sh OUT [go build flags...] - builds libcudapool.so at OUT
# (CUDAPOOL_SONAME=NAME: with that soname, as make install wants it; GO:
# the go command, default go)
# (the Makefile's lib and python/setup.py both build it here, so there is
# one recipe): go build -buildmode=c-shared of ./capi, exporting only
# cudapool_* (capi/exports.map), with the toolchain's runtime/cgocall.go
# replaced for this build by a copy in which a call from C counts as a
# schedule tick of the P it takes (go build -overlay), and where the file
# allows, a callback stops receiving from main_init_done once one has
# (initonce below). Prints "runtime: tick, init-once", "runtime: tick" or
# "runtime: stock (why)" last.
#
# Why the tick (docs/hot-path.md 22). A C thread that calls into Go keeps
# the P its call took, parked "in a system call" while it runs C. sysmon
# takes a P back when its schedule tick has not moved for 10 ms, as from a
# goroutine that ran too long, and a call from C never moves it (only
# running a goroutine through the scheduler does). So once a calling
# thread's P is 10 ms old, sysmon takes it back at every round while the
# thread is in C, the thread takes a P again at its next call, and each
# take resets sysmon's back-off to its 20 us sleep: thousands of runtime
# wake-ups a second, which preempt the caller where CPUs are few. With the
# tick, sysmon sees the P in use and leaves it; while no P is idle the tick
# is not counted, since a thread may then be waiting for a P and sysmon's
# takes are what hand it one (capi/procs.go keeps Ps idle).
#
# The copy is made from the installed toolchain's own file, so it matches
# that Go release. CUDAPOOL_RUNTIME_TICK=0 builds with the stock runtime, as
# does a toolchain whose file lacks the anchor line or whose runtime the
# copy does not compile with (said on stderr).
set -eu
mkdir -p "$(dirname "$1")"
out=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
shift
root=$(cd "$(dirname "$0")/.." && pwd)
go=${GO:-go}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# overlay writes $tmp/overlay.json or says on stdout why it cannot.
overlay() {
    if [ "${CUDAPOOL_RUNTIME_TICK:-1}" = 0 ]; then
        echo "CUDAPOOL_RUNTIME_TICK=0"
        return 1
    fi
    local src anchor n
    src=$("$go" env GOROOT)/src/runtime/cgocall.go
    anchor='	exitsyscall() // coming out of cgo call'
    n=$(grep -cxF "$anchor" "$src" 2>/dev/null || true)
    if [ "$n" != 1 ]; then
        echo "$src ($("$go" env GOVERSION)) has the anchor line ${n:-0} times, not once"
        return 1
    fi
    awk -v a="$anchor" '{ print } $0 == a {
        print "\t// cudapool (capi/build_lib.sh): the callback takes a schedule tick,"
        print "\t// so that sysmon does not take its P back at every round; not while"
        print "\t// no P is idle, when a thread may be waiting for this one."
        print "\tif pp := gp.m.p.ptr(); pp != nil && sched.npidle.Load() > 0 {"
        print "\t\tpp.schedtick++"
        print "\t}"
    }' "$src" >"$tmp/cgocall.go"
    initonce "$tmp/cgocall.go"
    printf '{"Replace": {"%s": "%s"}}\n' "$src" "$tmp/cgocall.go" >"$tmp/overlay.json"
}

# initonce FILE: in the runtime copy, a callback from a thread running no
# Go receives from main_init_done (closed once the library's packages are
# initialized) only until one such receive has returned: a receive from the
# closed channel takes its lock, two atomic writes to one line that every
# calling thread shares, and chanrecv's and lock2's code, at every call from
# C (docs/hot-path.md 23). Skipped, the tick kept, where the line is not
# there exactly once; notes "init-once" for the build record.
initonce() {
    local f=$1 anchor='		<-main_init_done'
    [ "$(grep -cxF "$anchor" "$f" || true)" = 1 ] || return 0
    # A file that imports the package already would get a second import.
    ! grep -qxF '	"internal/runtime/atomic"' "$f" || return 0
    awk -v a="$anchor" '
        $0 == "import (" && !imp { print; print "\t\"internal/runtime/atomic\""; imp = 1; next }
        $0 == a {
            print "\t\t// cudapool (capi/build_lib.sh): received once, main_init_done is"
            print "\t\t// closed for good; later callbacks need not take its lock."
            print "\t\tif !cgoInitDone.Load() {"
            print "\t" a
            print "\t\t\tcgoInitDone.Store(true)"
            print "\t\t}"
            next
        }
        { print }
        END {
            print ""
            print "// cgoInitDone: some callback has received from main_init_done (cudapool)."
            print "var cgoInitDone atomic.Bool"
        }' "$f" >"$f.new"
    mv "$f.new" "$f"
    touch "$tmp/initonce"
}

flags=()
if why=$(overlay); then
    flags=(-overlay="$tmp/overlay.json")
    runtime="tick"
    [ -e "$tmp/initonce" ] && runtime="tick, init-once"
else
    echo "capi/build_lib.sh: building with the stock Go runtime: $why" >&2
    runtime="stock ($why)"
fi
build() {
    rm -f "$out"
    (cd "$root" && "$go" build -buildmode=c-shared \
        -ldflags="-extldflags=-Wl,--version-script=$root/capi/exports.map${CUDAPOOL_SONAME:+,-soname,$CUDAPOOL_SONAME}" \
        "$@" -o "$out" ./capi)
}
if [ ${#flags[@]} -gt 0 ] && ! build "${flags[@]}" "$@"; then
    # A release whose runtime kept the anchor line but renamed what the
    # added lines use: the stock runtime rather than no library.
    why="the runtime copy did not compile with $("$go" env GOVERSION)"
    echo "capi/build_lib.sh: building with the stock Go runtime: $why" >&2
    runtime="stock ($why)"
    flags=()
fi
[ ${#flags[@]} -gt 0 ] || build "$@"
rm -f "${out%.so}.h" # cgo's header names the internal functions
echo "runtime: $runtime"
