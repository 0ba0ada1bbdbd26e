# SPDX-License-Identifier: Apache-2.0
"""Where libcudapool.so is looked for, and the error when it is nowhere."""

import os

import pytest

import cudapool
from cudapool import _lib
from helpers import run_code

pytestmark = pytest.mark.nolib


def layout(tmp_path, bundled=False, repo=False):
    """A fake install: <repo>/python/cudapool/_lib and <repo>/lib."""
    pkg = tmp_path / "repo" / "python" / "cudapool" / "_lib"
    pkg.mkdir(parents=True)
    (tmp_path / "repo" / "lib").mkdir()
    if bundled:
        (pkg / "libcudapool.so").write_bytes(b"bundled")
    if repo:
        (tmp_path / "repo" / "lib" / "libcudapool.so").write_bytes(b"repo")
    return str(pkg)


def test_order(tmp_path):
    pkg = layout(tmp_path, bundled=True, repo=True)
    explicit = tmp_path / "mine.so"
    explicit.write_bytes(b"explicit")
    assert _lib.find_library({"CUDAPOOL_LIBRARY": str(explicit)}, pkg) == str(explicit)
    assert _lib.find_library({}, pkg) == os.path.join(pkg, "libcudapool.so")
    os.remove(os.path.join(pkg, "libcudapool.so"))
    assert _lib.find_library({}, pkg) == str(tmp_path / "repo" / "lib" / "libcudapool.so")


def test_not_found_names_every_place(tmp_path):
    pkg = layout(tmp_path)
    with pytest.raises(cudapool.CudapoolError) as info:
        _lib.find_library({}, pkg)
    msg = str(info.value)
    assert os.path.join(pkg, "libcudapool.so") in msg
    assert str(tmp_path / "repo" / "lib" / "libcudapool.so") in msg
    assert "CUDAPOOL_LIBRARY" in msg and "make" in msg


def test_a_wrong_cudapool_library_is_an_error(tmp_path):
    pkg = layout(tmp_path, bundled=True)
    with pytest.raises(cudapool.CudapoolError, match="CUDAPOOL_LIBRARY is set but names no file") as info:
        _lib.find_library({"CUDAPOOL_LIBRARY": str(tmp_path / "nope.so")}, pkg)
    assert str(tmp_path / "nope.so") in str(info.value)


def test_checkout_finds_the_repository_library():
    """Run from the checkout, the package finds <repo>/lib (when built)."""
    repo_lib = os.path.normpath(os.path.join(os.path.dirname(cudapool.__file__), "..", "..", "lib",
                                             "libcudapool.so"))
    assert (repo_lib, "repository lib/") in [(p, w) for w, p in _lib.candidates({})]


def test_unloadable_library_error_names_it(tmp_path):
    bad = tmp_path / "libcudapool.so"
    bad.write_bytes(b"not an ELF file")
    out = run_code("""
        import cudapool
        try:
            cudapool.memory_stats()
        except cudapool.CudapoolError as e:
            print(e)
        """, env={"CUDAPOOL_LIBRARY": str(bad)})
    assert out.returncode == 0, out.stderr
    assert f"cannot load {bad}" in out.stdout
