# SPDX-License-Identifier: Apache-2.0
"""setup.py's platform tag: manylinux_2_N for the newest glibc symbol
version the bundled library needs, read from its ELF version needs."""

import importlib.util
import os
import re
import shutil
import subprocess

import pytest

from cudapool import _lib

pytestmark = pytest.mark.nolib

SETUP = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "setup.py")


@pytest.fixture(scope="module")
def setup_py():
    pytest.importorskip("setuptools", reason="setup.py needs setuptools")
    spec = importlib.util.spec_from_file_location("cudapool_setup", SETUP)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # defines the helpers; setup() runs only as __main__
    return mod


def readelf_needs(path):
    """The same facts from binutils' readelf, as an independent reading."""
    out = subprocess.run(["readelf", "-V", "--wide", path], capture_output=True, text=True, check=True).stdout
    needs, current = {}, None
    for line in out.splitlines():
        m = re.search(r"Version: \d+\s+File: (\S+)", line)
        if m:
            current = needs.setdefault(m.group(1), [])
            continue
        m = re.search(r"Name: (\S+)\s+Flags", line)
        if m and current is not None:
            current.append(m.group(1))
    return needs


def test_version_needs_match_readelf(setup_py):
    if shutil.which("readelf") is None:
        pytest.skip("readelf (binutils) is not installed")
    try:
        lib = _lib.find_library()
    except _lib.CudapoolError as e:
        pytest.skip(f"libcudapool.so is not built: {e}")
    arch, needs = setup_py.elf_version_needs(lib)
    assert arch == {"x86_64": "x86_64", "aarch64": "aarch64"}.get(os.uname().machine, arch)
    want = readelf_needs(lib)
    assert want and {k: sorted(v) for k, v in needs.items()} == {k: sorted(v) for k, v in want.items()}
    glibc = [tuple(int(x) for x in v[6:].split(".")) for vs in want.values() for v in vs if v.startswith("GLIBC_2")]
    newest = max(glibc)
    assert setup_py.manylinux_tag(lib) == f"manylinux_{newest[0]}_{newest[1]}_{arch}"


def test_a_library_needing_an_old_glibc_only(setup_py, tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src = tmp_path / "t.c"
    src.write_text("int f(int x) { return x + 1; }\n")  # no libc symbols at all
    so = tmp_path / "t.so"
    subprocess.run([cc, "-shared", "-fPIC", "-nostdlib", "-o", str(so), str(src)], check=True)
    assert setup_py.elf_version_needs(str(so))[1] == {}
    assert setup_py.manylinux_tag(str(so)).startswith("manylinux_2_5_")


def test_not_an_elf_file(setup_py, tmp_path):
    bad = tmp_path / "x.so"
    bad.write_bytes(b"#!/bin/sh\n")
    with pytest.raises(ValueError, match="not a 64-bit little-endian ELF"):
        setup_py.manylinux_tag(str(bad))
