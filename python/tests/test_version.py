# SPDX-License-Identifier: Apache-2.0
"""The package's version against the library's: one version string, and a
library of another version or ABI is refused with a clear message."""

import os
import shutil
import subprocess

import pytest

import cudapool
from cudapool import _lib
from helpers import run_code

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_loaded_library_is_the_package_version():
    version, abi = _lib.library_version(_lib.load())
    assert (version, abi) == (cudapool.__version__, cudapool.ABI_VERSION)


@pytest.mark.nolib
def test_package_version_is_the_repository_version():
    with open(os.path.join(REPO, "VERSION")) as f:
        assert cudapool.__version__ == f.read().strip()


@pytest.mark.nolib
@pytest.mark.parametrize("version, abi, says", [
    ("9.9.9", cudapool.ABI_VERSION, "is version 9.9.9"),
    (cudapool.__version__, cudapool.ABI_VERSION + 1, f"(ABI {cudapool.ABI_VERSION + 1})"),
    (None, None, "has no cudapool_version()"),
])
def test_check_version_refuses_a_mismatch(version, abi, says):
    with pytest.raises(cudapool.CudapoolError) as info:
        _lib.check_version("/x/libcudapool.so", version, abi)
    msg = str(info.value)
    assert "/x/libcudapool.so" in msg and says in msg
    assert f"package is version {cudapool.__version__}" in msg and "CUDAPOOL_LIBRARY" in msg


@pytest.mark.nolib
def test_check_version_accepts_the_same():
    _lib.check_version("/x/libcudapool.so", cudapool.__version__, cudapool.ABI_VERSION)


FAKE = r"""
const char *cudapool_version(void) { return "%s"; }
int cudapool_abi_version(void) { return %d; }
const char *cudapool_last_error(void) { return 0; }
"""


@pytest.mark.nolib
@pytest.mark.parametrize("version, abi", [("0.0.1", None), (None, 99)])
def test_a_library_of_another_version_is_refused_at_load(tmp_path, version, abi):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a stand-in library")
    version = version or cudapool.__version__
    abi = abi if abi is not None else cudapool.ABI_VERSION
    src = tmp_path / "fake.c"
    src.write_text(FAKE % (version, abi))
    so = tmp_path / "libcudapool.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    out = run_code("""
        import cudapool
        try:
            cudapool.memory_stats()
        except cudapool.CudapoolError as e:
            print(e)
        else:
            print("loaded")
        """, env={"CUDAPOOL_LIBRARY": str(so)})
    assert out.returncode == 0, out.stderr
    assert f"{so} is version {version} (ABI {abi})" in out.stdout, out.stdout
