#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# test_install.sh - `make install` into a temporary DESTDIR, then, as a user
# would: build examples/c/example.c with `cc example.c $(pkg-config --cflags
# --libs cudapool)`, run it on the simulator against the installed library,
# and `make uninstall`. Run from the repository root (make test-install).
# Prints one line per check and "install: N passed, M failed" last.
set -u
MAKE=${MAKE:-make}
CC=${CC:-$(command -v cc || echo gcc)}
PREFIX=/usr/local
VERSION=$(cat VERSION)
MAJOR=${VERSION%%.*}
D=$(mktemp -d)
trap 'rm -rf "$D"' EXIT INT TERM
LIBD=$D$PREFIX/lib
passed=0
failed=0
check() { # DESCRIPTION COMMAND...
    what=$1
    shift
    if "$@" >"$D/out" 2>&1; then
        passed=$((passed + 1))
        echo "ok    $what"
    else
        failed=$((failed + 1))
        echo "FAIL  $what"
        sed 's/^/      /' "$D/out" | head -n 20
    fi
}
finish() {
    echo "install: $passed passed, $failed failed"
    [ "$failed" -eq 0 ]
    exit $?
}

check "make install PREFIX=$PREFIX DESTDIR=<tmp>" $MAKE --no-print-directory install PREFIX=$PREFIX DESTDIR="$D"
[ "$failed" -eq 0 ] || finish
check "lib/libcudapool.so.$VERSION is a file" test -f "$LIBD/libcudapool.so.$VERSION" -a ! -L "$LIBD/libcudapool.so.$VERSION"
check "lib/libcudapool.so.$MAJOR -> libcudapool.so.$VERSION" \
    test "$(readlink "$LIBD/libcudapool.so.$MAJOR")" = "libcudapool.so.$VERSION"
check "lib/libcudapool.so -> libcudapool.so.$MAJOR" test "$(readlink "$LIBD/libcudapool.so")" = "libcudapool.so.$MAJOR"
soname() { readelf -d "$1" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p'; }
check "its SONAME is libcudapool.so.$MAJOR" test "$(soname "$LIBD/libcudapool.so.$VERSION")" = "libcudapool.so.$MAJOR"
check "include/cudapool.h is the repository's" cmp include/cudapool.h "$D$PREFIX/include/cudapool.h"
check "lib/pkgconfig/cudapool.pc says Version: $VERSION" grep -qx "Version: $VERSION" "$LIBD/pkgconfig/cudapool.pc"
check "share/doc/cudapool/LICENSE is the repository's" cmp LICENSE "$D$PREFIX/share/doc/cudapool/LICENSE"
check "share/doc/cudapool/README.md is the repository's" cmp README.md "$D$PREFIX/share/doc/cudapool/README.md"

# pkg-config reads the .pc from the DESTDIR and prefixes its paths with it.
export PKG_CONFIG_PATH="$LIBD/pkgconfig" PKG_CONFIG_SYSROOT_DIR="$D"
if command -v pkg-config >/dev/null 2>&1; then
    check "pkg-config --modversion cudapool is $VERSION" test "$(pkg-config --modversion cudapool)" = "$VERSION"
    FLAGS=$(pkg-config --cflags --libs cudapool)
    check "pkg-config --cflags --libs cudapool: $FLAGS" test -n "$FLAGS"
else
    # Not fatal here (a developer's machine may lack it); CI installs it.
    echo "skip  pkg-config is not installed: building the example with the flags cudapool.pc states instead"
    FLAGS="-I$D$PREFIX/include -L$LIBD -lcudapool"
fi
# shellcheck disable=SC2086  # FLAGS is a list of flags
check "cc example.c \$(pkg-config --cflags --libs cudapool)" \
    $CC -std=c11 -Wall -Wextra -Werror examples/c/example.c $FLAGS -o "$D/example"
needed() { readelf -d "$1" | sed -n 's/.*(NEEDED).*\[\(libcudapool[^]]*\)\]/\1/p'; }
check "the example needs libcudapool.so.$MAJOR (the SONAME)" test "$(needed "$D/example")" = "libcudapool.so.$MAJOR"
run_example() {
    env -u CUDAPOOL_CONF -u PYTORCH_CUDA_ALLOC_CONF CUDAPOOL_BACKEND=sim LD_LIBRARY_PATH="$LIBD" "$D/example" >"$D/run.txt" 2>&1
    rc=$?
    cat "$D/run.txt"
    [ $rc -eq 0 ] && grep -qx "example: ok" "$D/run.txt"
}
check "the example runs on the simulator with the installed library" run_example
sed 's/^/      /' "$D/run.txt"
uses_installed() { LD_LIBRARY_PATH="$LIBD" ldd "$D/example" | grep -q "libcudapool.so.$MAJOR => $LIBD/libcudapool.so.$MAJOR"; }
check "... and the loader found it in the DESTDIR" uses_installed

check "make uninstall DESTDIR=<tmp>" $MAKE --no-print-directory uninstall PREFIX=$PREFIX DESTDIR="$D"
left=$(find "$D$PREFIX" \( -type f -o -type l \) 2>/dev/null)
check "uninstall left none of its files${left:+: $left}" test -z "$left"
finish
