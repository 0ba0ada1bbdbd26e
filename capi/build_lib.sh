#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# capi/build_lib.sh OUT [go build flags...] - builds libcudapool.so at OUT.
#
# The one recipe for the library (the Makefile's lib and install, and
# python/setup.py, all build here): go build -buildmode=c-shared of ./capi
# with the Go toolchain as installed, exporting only the cudapool_*
# functions (capi/exports.map). go build reads capi/default.pgo by itself
# (-pgo=auto: the main package's default.pgo).
#
#   GO               the go command (default: go)
#   CUDAPOOL_SONAME  gives the library that soname (make install)
#
# The toolchain is used unmodified: nothing here replaces runtime files.
# docs/go-runtime-proposal.md describes the runtime change that would help
# C callers and why the library does not carry it.
set -eu
[ $# -ge 1 ] || { echo "usage: capi/build_lib.sh OUT [go build flags...]" >&2; exit 2; }
mkdir -p "$(dirname "$1")"
out=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
shift
root=$(cd "$(dirname "$0")/.." && pwd)
go=${GO:-go}

rm -f "$out"
(cd "$root" && "$go" build -buildmode=c-shared \
    -ldflags="-extldflags=-Wl,--version-script=$root/capi/exports.map${CUDAPOOL_SONAME:+,-soname,$CUDAPOOL_SONAME}" \
    "$@" -o "$out" ./capi)
rm -f "${out%.so}.h" # cgo's header names the internal functions
