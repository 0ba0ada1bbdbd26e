# SPDX-License-Identifier: Apache-2.0
"""Build and load cudapool's C++ allocator class (csrc/torch_allocator.cpp).

The class derives from torch's CUDAPluggableAllocator and implements every
method the pluggable base refuses (graph-pool checkpoints for
torch.compile's CUDA graph trees, cacheInfo, CUDA IPC, MemPool, stats,
snapshots, memory history, OOM observers), forwarding to libcudapool.so's C
ABI. It must be compiled against the torch it runs with (C++ ABI), so it is
built on the user's machine: at ``pip install`` when torch is importable
there, else on the first ``cudapool.install()``, and cached.

It is one translation unit compiled by the C++ compiler directly, with the
include and library directories torch.utils.cpp_extension reports; unlike
``cpp_extension.load`` this needs no ninja and builds a plain shared library
(no Python module: the class is installed through an ``extern "C"``
function called with ctypes). CUDA headers come from the CUDA toolkit
($CUDA_HOME, /usr/local/cuda) or from NVIDIA's pip packages
(nvidia-cuda-runtime and nvidia-cuda-crt).

``python -m cudapool._ext --torch-dir DIR`` builds against an unpacked torch
without importing it (CI checks that the class compiles against several
torch releases this way).
"""

import argparse
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile

from . import _lib

__all__ = ["ExtensionUnavailable", "source_path", "header_dir", "cuda_include_dirs", "build", "ensure", "install"]

_HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = "torch_allocator.cpp"
# The version the C++ file reports (cudapool_torch_ext_version): a cached
# build with another is stale.
INTERFACE_VERSION = 5


class ExtensionUnavailable(Exception):
    """The C++ allocator class cannot be built or loaded here; the message says why."""


def source_path():
    return os.path.join(_HERE, "csrc", SOURCE)


def header_dir():
    """The directory holding cudapool.h: the package's csrc/ (installed) or the checkout's include/."""
    for d in (os.path.join(_HERE, "csrc"), os.path.normpath(os.path.join(_HERE, os.pardir, os.pardir, "include"))):
        if os.path.isfile(os.path.join(d, "cudapool.h")):
            return d
    raise ExtensionUnavailable("cudapool.h is missing from the package (csrc/) and the checkout (include/)")


def _has_cuda_headers(d):
    return os.path.isfile(os.path.join(d, "cuda_runtime_api.h"))


def cuda_include_dirs(env=None, cuda_home=None, search_path=None):
    """Include directories that provide cuda_runtime_api.h and crt/host_config.h.

    Looked at in order: $CUDA_HOME, $CUDA_PATH, torch's CUDA_HOME,
    /usr/local/cuda, and NVIDIA's pip packages on sys.path (nvidia/cu13,
    nvidia/cuda_runtime with nvidia/cuda_crt or nvidia/cuda_nvcc).
    """
    env = os.environ if env is None else env
    homes = [env.get("CUDA_HOME"), env.get("CUDA_PATH"), cuda_home, "/usr/local/cuda"]
    for h in homes:
        if h and _has_cuda_headers(os.path.join(h, "include")):
            return [os.path.join(h, "include")]
    for base in search_path if search_path is not None else sys.path:
        nv = os.path.join(base or ".", "nvidia")
        if not os.path.isdir(nv):
            continue
        runtime = [d for d in glob.glob(os.path.join(nv, "*", "include")) if _has_cuda_headers(d)]
        crt = [d for d in glob.glob(os.path.join(nv, "*", "include")) if os.path.isfile(os.path.join(d, "crt", "host_config.h"))]
        if runtime and crt:
            return sorted(set(runtime[:1] + crt[:1]))
    return []


def _torch_info():
    """(torch_dir, version, cxx11_abi, cuda_home) of the importable torch."""
    try:
        import torch
    except ImportError as e:
        raise ExtensionUnavailable(f"`import torch` failed ({e})")
    torch_dir = os.path.dirname(os.path.abspath(getattr(torch, "__file__", "") or ""))
    if not os.path.isfile(os.path.join(torch_dir, "include", "torch", "csrc", "cuda", "CUDAPluggableAllocator.h")):
        raise ExtensionUnavailable(f"this torch ({getattr(torch, '__version__', '?')}) ships no C++ headers for CUDA allocators")
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    cuda_home = None
    try:
        from torch.utils import cpp_extension

        cuda_home = cpp_extension.CUDA_HOME
    except Exception:  # CUDA_HOME is a convenience only
        pass
    return torch_dir, str(torch.__version__), abi, cuda_home


def _detect_abi(torch_dir):
    """The C++ ABI of an unpacked torch, read from libc10's symbol names."""
    lib = os.path.join(torch_dir, "lib", "libc10.so")
    try:
        out = subprocess.run(["nm", "-D", "--defined-only", lib], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise ExtensionUnavailable(f"cannot read the symbols of {lib}: {e}")
    return 1 if "cxx11" in out else 0


def _version_of(torch_dir):
    try:
        with open(os.path.join(torch_dir, "version.py")) as f:
            for line in f:
                if line.startswith("__version__"):
                    return line.split("=", 1)[1].strip().strip("'\"")
    except OSError:
        pass
    return "unknown"


def cache_dir(env=None):
    env = os.environ if env is None else env
    root = env.get("CUDAPOOL_CACHE") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "cudapool"
    )
    return os.path.join(root, "torch-ext")


def _key(parts):
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else str(p).encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def build(torch_dir=None, out=None, cuda_include=None, abi=None, library=None, cxx=None, verbose=False, announce=False,
          rpath=None, source=None, name="cudapool_torch", include=(), depends=()):
    """Compile the class; returns the path of the shared library.

    Without torch_dir, the importable torch is used. library is the
    libcudapool.so to link against (default: the one cudapool loads).
    Raises ExtensionUnavailable with the reason when it cannot be built.
    rpath: where the loader finds libcudapool.so (default: its directory).
    source, include and depends compile another translation unit than the
    class's own (a build of it with more code, such as the benchmark's, which
    includes the class's source): its path, more include directories, and
    the files it includes whose contents key the cache; name prefixes the
    cached library's file name.
    """
    version, cuda_home = None, None
    if torch_dir is None:
        torch_dir, version, abi_detected, cuda_home = _torch_info()
        abi = abi_detected if abi is None else abi
    else:
        torch_dir = os.path.abspath(torch_dir)
        version = _version_of(torch_dir)
        abi = _detect_abi(torch_dir) if abi is None else abi
    inc = cuda_include if cuda_include is not None else cuda_include_dirs(cuda_home=cuda_home)
    if not inc:
        raise ExtensionUnavailable(
            "no CUDA headers (cuda_runtime_api.h and crt/host_config.h) found: install the CUDA toolkit and set "
            "CUDA_HOME, or `pip install nvidia-cuda-runtime nvidia-cuda-crt` (matching torch's CUDA version)"
        )
    cxx = cxx or os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise ExtensionUnavailable("no C++ compiler: install g++ (or set CXX)")
    library = os.path.abspath(library or _lib.library_path())
    src, hdir = os.path.abspath(source or source_path()), header_dir()
    src_bytes = []
    for path in [src] + list(depends):
        with open(path, "rb") as f:
            src_bytes.append(f.read())
    with open(os.path.join(hdir, "cudapool.h"), "rb") as f:
        hdr_bytes = f.read()
    libdir = os.path.dirname(library)
    # Where the loader looks for libcudapool.so: its directory, or "$ORIGIN"
    # for a build that ships next to it (setup.py).
    rpath = rpath or libdir
    key = _key(src_bytes + [hdr_bytes, torch_dir, version, abi, library, cxx, rpath, INTERFACE_VERSION] + list(inc))
    if out is None:
        # The cache: the name is a hash of everything the build depends on.
        out = os.path.join(cache_dir(), f"{name}_{key}.so")
        if os.path.isfile(out):
            return out
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    torch_lib = os.path.join(torch_dir, "lib")
    cmd = [cxx, "-std=c++20", "-O2", "-fPIC", "-shared", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
           "-I", os.path.join(torch_dir, "include"),
           "-I", os.path.join(torch_dir, "include", "torch", "csrc", "api", "include"),
           "-I", hdir]
    for d in list(include) + list(inc):
        cmd += ["-I", d]
    # Link libcudapool.so by path with an rpath to its directory: the loader
    # then reuses the copy cudapool already loaded (one Go runtime).
    tmp = tempfile.NamedTemporaryFile(dir=os.path.dirname(os.path.abspath(out)), suffix=".so", delete=False)
    tmp.close()
    cmd += [src, "-o", tmp.name, "-L", torch_lib, "-lc10", "-lc10_cuda", "-ltorch_cuda", "-ltorch_cpu",
            f"-Wl,-rpath,{torch_lib}", "-L", libdir, "-l:" + os.path.basename(library), f"-Wl,-rpath,{rpath}"]
    if verbose:
        print(" ".join(cmd), file=sys.stderr)
    elif announce:
        print(f"cudapool: compiling the C++ allocator class for torch {version} (once; cached in {os.path.dirname(out)})",
              file=sys.stderr)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp.name)
        err = (proc.stderr or proc.stdout).strip().splitlines()
        first = [l for l in err if "error" in l][:5] or err[-5:]
        raise ExtensionUnavailable(f"compiling {os.path.basename(src)} against torch {version} failed:\n  "
                                   + "\n  ".join(first))
    os.replace(tmp.name, out)  # atomic: concurrent builders race harmlessly
    return out


_state = {"path": None, "handle": None, "why": None}


def ensure(verbose=False):
    """The built class for the importable torch, building it once; (path, None) or (None, reason)."""
    if _state["path"] or _state["why"]:
        return _state["path"], _state["why"]
    if os.environ.get("CUDAPOOL_TORCH_EXT", "1") == "0":
        _state["why"] = "disabled by CUDAPOOL_TORCH_EXT=0"
        return None, _state["why"]
    try:
        _state["path"] = _prebuilt() or build(verbose=verbose, announce=True)
    except ExtensionUnavailable as e:
        _state["why"] = str(e)
    except Exception as e:  # never let the build break install(): fall back, saying why
        _state["why"] = f"building it failed unexpectedly: {e!r}"
    return _state["path"], _state["why"]


def _prebuilt():
    """A build made at pip install time for exactly this torch, if any (cudapool/_lib/torch_ext.txt)."""
    stamp = os.path.join(_HERE, "_lib", "torch_ext.txt")
    if not os.path.isfile(stamp):
        return None
    try:
        import torch

        with open(stamp) as f:
            version, name = f.read().split()
        path = os.path.join(_HERE, "_lib", name)
        if version == str(torch.__version__) and os.path.isfile(path):
            return path
    except Exception:
        return None
    return None


def install(fast=True):
    """Make the class PyTorch's CUDA allocator. Raises ExtensionUnavailable.

    fast: True, the direct path; False, the pluggable base's (for comparison)."""
    import ctypes

    path, why = ensure()
    if path is None:
        raise ExtensionUnavailable(why)
    _lib.load()  # libcudapool.so first, from the path the extension links
    try:
        h = ctypes.CDLL(path)
    except OSError as e:
        raise ExtensionUnavailable(f"loading {path} failed: {e}")
    if h.cudapool_torch_ext_version() != INTERFACE_VERSION:
        raise ExtensionUnavailable(f"{path} is a stale build (interface {h.cudapool_torch_ext_version()})")
    buf = ctypes.create_string_buffer(4096)
    h.cudapool_torch_ext_install.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    if h.cudapool_torch_ext_install(1 if fast else 0, buf, len(buf)) != 0:
        raise ExtensionUnavailable(buf.value.decode(errors="replace"))
    _state["handle"] = h
    return h


def fast_path():
    """1: the direct malloc/free path; 0: the pluggable base's; -1: not installed."""
    h = _state["handle"]
    return -1 if h is None else h.cudapool_torch_ext_fast()


def main(argv=None):
    ap = argparse.ArgumentParser(description="Build cudapool's C++ allocator class.")
    ap.add_argument("--torch-dir", help="an unpacked torch package directory (default: the importable torch)")
    ap.add_argument("--cuda-include", action="append", help="CUDA include directory (repeatable)")
    ap.add_argument("--library", help="libcudapool.so to link against")
    ap.add_argument("--out", help="output path (default: the cache)")
    args = ap.parse_args(argv)
    try:
        path = build(torch_dir=args.torch_dir, out=args.out, cuda_include=args.cuda_include, library=args.library, verbose=True)
    except ExtensionUnavailable as e:
        print(f"cudapool: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
