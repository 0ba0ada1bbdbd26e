# SPDX-License-Identifier: Apache-2.0
"""Build step for the cudapool Python package: puts libcudapool.so into the
package (cudapool/_lib/libcudapool.so). Metadata lives in pyproject.toml.

Where the library comes from, first that works:
  1. $CUDAPOOL_LIBRARY (a built libcudapool.so), copied;
  2. built in the repository that holds this directory, when Go and bash are
     on PATH: capi/build_lib.sh (the Makefile's recipe: the Go toolchain as
     installed, cudapool_* exports only);
  3. the repository's lib/libcudapool.so (built with `make`), copied;
  4. a libcudapool.so already in cudapool/_lib/ of this source tree.
Otherwise the build fails and says what it tried; CUDAPOOL_ALLOW_NO_LIBRARY=1
installs the Python code alone (the library is then found at run time
through $CUDAPOOL_LIBRARY).

The license (python/LICENSE, a link to the repository's LICENSE) goes into
the wheel's .dist-info/licenses/ (pyproject.toml's license-files).

The wheel is tagged py3-none-manylinux_2_N_<arch>, N from the newest glibc
symbol version the bundled library needs (`make wheel` builds it, without a
C++ class prebuilt for the build machine's torch: CUDAPOOL_PREBUILD_CLASS=0).
"""

import os
import shutil
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
LIB = "libcudapool.so"


def _copy(src, dest):
    shutil.copyfile(src, dest)
    os.chmod(dest, 0o755)


def provide_library(dest):
    """Write libcudapool.so to dest; return a line saying where it came from."""
    dest = os.path.abspath(dest)  # go runs in the repository root
    tried = []
    explicit = os.environ.get("CUDAPOOL_LIBRARY")
    if explicit:
        if os.path.isfile(explicit):
            _copy(explicit, dest)
            return f"copied $CUDAPOOL_LIBRARY ({explicit})"
        tried.append(f"$CUDAPOOL_LIBRARY={explicit}: no such file")

    if os.path.isfile(os.path.join(REPO, "go.mod")) and os.path.isdir(os.path.join(REPO, "capi")):
        go, bash = shutil.which("go"), shutil.which("bash")
        if go and bash:
            cmd = [bash, os.path.join(REPO, "capi", "build_lib.sh"), dest]
            proc = subprocess.run(cmd, cwd=REPO)
            if proc.returncode == 0 and os.path.isfile(dest):
                return f"built with {' '.join(cmd)} in {REPO}"
            tried.append(f"`{' '.join(cmd)}` in {REPO} failed (exit {proc.returncode})")
        else:
            tried.append("go or bash is not on PATH, so the library could not be built")
    else:
        tried.append(f"no Go sources (go.mod, capi/) at {REPO}")

    for what, path in (
        ("the repository's lib/", os.path.join(REPO, "lib", LIB)),
        ("the source tree's cudapool/_lib/", os.path.join(HERE, "cudapool", "_lib", LIB)),
    ):
        if os.path.isfile(path):
            _copy(path, dest)
            return f"copied {what} ({path})"
        tried.append(f"{path}: not found")

    if os.environ.get("CUDAPOOL_ALLOW_NO_LIBRARY") == "1":
        return "no library bundled (CUDAPOOL_ALLOW_NO_LIBRARY=1); set CUDAPOOL_LIBRARY at run time"
    raise RuntimeError(
        "cudapool: no libcudapool.so to bundle. Tried:\n  - "
        + "\n  - ".join(tried)
        + "\nInstall Go and retry, run `make` in the repository first, set CUDAPOOL_LIBRARY to a "
        "built library, or set CUDAPOOL_ALLOW_NO_LIBRARY=1 to install without it."
    )


def provide_torch_class(pkg_dir, lib_path):
    """Build the C++ allocator class against the torch importable here, if
    any (pip's build isolation usually hides it: then install() builds it on
    first use). CUDAPOOL_PREBUILD_CLASS=0 skips it (`make wheel`: a wheel
    for other machines must not carry a class built for this torch).
    Returns a line saying what happened."""
    if os.environ.get("CUDAPOOL_PREBUILD_CLASS") == "0":
        return "C++ allocator class not prebuilt (CUDAPOOL_PREBUILD_CLASS=0); built on first install()"
    try:
        import torch  # noqa: F401
    except Exception as e:
        return f"C++ allocator class not prebuilt (torch is not importable at build time: {e}); built on first install()"
    # The build directory's copy of the package, with the library just put in.
    sys.path.insert(0, os.path.dirname(pkg_dir))
    try:
        from cudapool import _ext  # the copy in the build directory
        import torch

        name = "cudapool_torch_prebuilt.so"
        _ext.build(out=os.path.join(pkg_dir, "_lib", name), library=lib_path, rpath="$ORIGIN")
        with open(os.path.join(pkg_dir, "_lib", "torch_ext.txt"), "w") as f:
            f.write(f"{torch.__version__} {name}\n")
        return f"C++ allocator class prebuilt for torch {torch.__version__}"
    except Exception as e:
        return f"C++ allocator class not prebuilt ({e}); built on first install()"
    finally:
        sys.path.pop(0)
        for m in [m for m in sys.modules if m == "cudapool" or m.startswith("cudapool.")]:
            del sys.modules[m]


# ---------------------------------------------------------------------------
# The wheel's platform tag. A wheel is tagged manylinux_X_Y when the library
# in it needs nothing newer than glibc X.Y: read from the symbol versions it
# needs (ELF .gnu.version_r), the way auditwheel judges it.

_ELF_ARCH = {62: "x86_64", 183: "aarch64"}
SHT_GNU_VERNEED = 0x6FFFFFFE


def elf_version_needs(path):
    """(architecture, {library: [version names]}) of a 64-bit little-endian
    ELF file: the symbol versions it needs from each shared library."""
    import struct

    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path}: not a 64-bit little-endian ELF file")
    machine = struct.unpack_from("<H", data, 18)[0]
    shoff = struct.unpack_from("<Q", data, 40)[0]
    shentsize, shnum = struct.unpack_from("<HH", data, 58)

    def section(i):  # (type, offset, size, link)
        base = shoff + i * shentsize
        _, typ, _, _, off, size, link = struct.unpack_from("<IIQQQQI", data, base)
        return typ, off, size, link

    def cstr(off):
        return data[off:data.index(b"\0", off)].decode("ascii", "replace")

    needs = {}
    for i in range(shnum):
        typ, off, _, link = section(i)
        if typ != SHT_GNU_VERNEED:
            continue
        strtab = section(link)[1]
        entry = off
        while True:
            _, cnt, file_, aux, nxt = struct.unpack_from("<HHIII", data, entry)
            names = needs.setdefault(cstr(strtab + file_), [])
            a = entry + aux
            for _ in range(cnt):
                _, _, _, name, anext = struct.unpack_from("<IHHII", data, a)
                names.append(cstr(strtab + name))
                a += anext
            if nxt == 0:
                break
            entry += nxt
    return _ELF_ARCH.get(machine, f"machine{machine}"), needs


def manylinux_tag(path):
    """manylinux_2_N_<arch>: N is the newest GLIBC_2.N symbol version the
    library needs (from libc, libm, libpthread, ld-linux...)."""
    arch, needs = elf_version_needs(path)
    newest = (2, 5)  # manylinux's oldest glibc
    for names in needs.values():
        for v in names:
            if v.startswith("GLIBC_") and v[6:].replace(".", "").isdigit():
                parts = tuple(int(x) for x in v[6:].split("."))[:2]
                newest = max(newest, parts + (0,) * (2 - len(parts)))
    return f"manylinux_{newest[0]}_{newest[1]}_{arch}"


class BuildPyWithLibrary(build_py):
    def run(self):
        super().run()
        if self.dry_run:
            return
        pkg_dir = os.path.join(self.build_lib, "cudapool")
        dest_dir = os.path.join(pkg_dir, "_lib")
        os.makedirs(dest_dir, exist_ok=True)
        how = provide_library(os.path.join(dest_dir, LIB))
        self.announce(f"cudapool: {how}", level=2)
        print(f"cudapool: {how}")
        # The C++ allocator class's source and the C ABI header it includes.
        csrc = os.path.join(pkg_dir, "csrc")
        os.makedirs(csrc, exist_ok=True)
        _copy(os.path.join(HERE, "cudapool", "csrc", "torch_allocator.cpp"), os.path.join(csrc, "torch_allocator.cpp"))
        header = os.path.join(REPO, "include", "cudapool.h")
        if os.path.isfile(header):
            _copy(header, os.path.join(csrc, "cudapool.h"))
        if os.path.isfile(os.path.join(dest_dir, LIB)):
            how = provide_torch_class(pkg_dir, os.path.join(dest_dir, LIB))
            print(f"cudapool: {how}")


class BinaryDistribution(Distribution):
    """The wheel holds a native library: tag it for this platform."""

    def has_ext_modules(self):
        return True


cmdclass = {"build_py": BuildPyWithLibrary}
try:  # setuptools >= 70.1 has its own bdist_wheel; older ones use wheel's
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:
    try:
        from wheel.bdist_wheel import bdist_wheel
    except ImportError:
        bdist_wheel = None
if bdist_wheel is not None:

    class BdistWheelAnyPython(bdist_wheel):
        """The library does not use Python's C API: py3-none-<platform>,
        where the platform is manylinux_2_N_<arch> for the glibc the bundled
        library needs (plain linux_<arch> when there is none to read)."""

        def get_tag(self):
            _, _, plat = super().get_tag()
            lib = os.path.join(self.bdist_dir or "", "cudapool", "_lib", LIB)
            build_lib = getattr(self.get_finalized_command("build_py"), "build_lib", "")
            for cand in (lib, os.path.join(build_lib, "cudapool", "_lib", LIB)):
                if plat.startswith("linux_") and os.path.isfile(cand):
                    plat = manylinux_tag(cand)
                    break
            return "py3", "none", plat

    cmdclass["bdist_wheel"] = BdistWheelAnyPython

if __name__ == "__main__":  # importable by the tests without building anything
    setup(cmdclass=cmdclass, distclass=BinaryDistribution)
