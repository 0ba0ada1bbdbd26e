#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Checks an installed cudapool package (from a wheel or `pip install`), not
the source tree: run it from outside the checkout with the environment's
python, the backend chosen in the environment (CUDAPOOL_BACKEND=sim on a
machine without a GPU; the library reads it when it loads).

    python smoke_installed.py --version 0.1.0 --not-under /path/to/checkout

Checks that `import cudapool` resolves to an installed copy (under
site-packages, not under --not-under), that the package and its bundled
library are that version with the same ABI, that the C++ class's sources
and header are in the package, and that malloc/free/statistics work.
Prints one line per check and "smoke: N passed, M failed" last."""

import argparse
import os
import sys

# Python puts the script's directory (python/, which holds the source
# package) first on sys.path: drop it, or the source tree would be tested.
if sys.path and os.path.realpath(sys.path[0] or ".") == os.path.dirname(os.path.realpath(__file__)):
    del sys.path[0]

results = []


def check(ok, what):
    results.append(bool(ok))
    print(("ok    " if ok else "FAIL  ") + what, flush=True)
    return ok


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", required=True, help="the version the package must be (VERSION)")
    ap.add_argument("--not-under", action="append", default=[], help="a directory cudapool must not come from")
    args = ap.parse_args(argv)

    import cudapool
    from cudapool import _ext, _lib

    pkg = os.path.dirname(os.path.realpath(cudapool.__file__))
    check("site-packages" in pkg.split(os.sep) or "dist-packages" in pkg.split(os.sep),
          f"import cudapool resolves to an installed copy: {pkg}")
    for d in args.not_under:
        d = os.path.realpath(d)
        check(not (pkg + os.sep).startswith(d + os.sep), f"... not to the source tree {d}")
    check(cudapool.__version__ == args.version, f"cudapool.__version__ is {cudapool.__version__} (want {args.version})")
    check("CUDAPOOL_LIBRARY" not in os.environ, "CUDAPOOL_LIBRARY is unset (the bundled library must be found)")
    path = cudapool.library_path()
    check(os.path.dirname(path) == os.path.join(pkg, "_lib"), f"the library in use is the bundled one: {path}")
    version, abi = _lib.library_version(_lib.load())
    check((version, abi) == (args.version, cudapool.ABI_VERSION),
          f"the library is version {version}, ABI {abi} (package: ABI {cudapool.ABI_VERSION})")
    check(os.path.isfile(_ext.source_path()), f"the C++ class's source is in the package: {_ext.source_path()}")
    check(_ext.header_dir() == os.path.join(pkg, "csrc"), f"... and cudapool.h: {_ext.header_dir()}")

    before = cudapool.memory_allocated(0)
    p = _lib.malloc(3 << 20, 0, 0)
    check(p != 0 and cudapool.memory_allocated(0) - before >= 3 << 20,
          f"malloc 3 MiB on device 0 ({os.environ.get('CUDAPOOL_BACKEND') or 'cuda'} backend)")
    _lib.free(p, 3 << 20, 0, 0)
    check(cudapool.memory_allocated(0) == before, "free: allocated back to where it was")
    check(cudapool.memory_reserved(0) >= 3 << 20, "the freed block stays cached (reserved)")
    cudapool.empty_cache()
    check(cudapool.memory_reserved(0) == 0, "empty_cache returns it")

    n_ok = sum(results)
    print(f"smoke: {n_ok} passed, {len(results) - n_ok} failed")
    return 0 if n_ok == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
