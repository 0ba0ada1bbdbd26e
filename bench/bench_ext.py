# SPDX-License-Identifier: Apache-2.0
"""The benchmark's build of cudapool's C++ allocator class
(bench/torch_allocator_bench.cpp): the shipped class with the benchmark's
switches in a subclass, built and cached like the shipped one (under
~/.cache/cudapool/torch-ext, by another name) and installed in its place.

    import bench_ext
    bench_ext.install()          # instead of cudapool.install()
    bench_ext.passthrough(True)  # torch's allocations go to PyTorch's allocator
    ...

Switches:
  passthrough  hands allocate() (torch.empty and every tensor PyTorch makes),
               the raw calls (raw_alloc, raw_delete, raw_deleter),
               empty_cache and the captures begun meanwhile (their private
               pools, their checkpoints, to their last release) to
               PyTorch's own allocator, the one cudapool replaced, or takes
               them back: bench/torch_bench.py's alt and altcompile sections
               alternate the two allocators within one process. Tensors
               keep the deleter of the allocator that made them.
  timing       times each allocate() and each deleter call of tensors made
               meanwhile, for both allocators, and cudapool's call into the
               library alone and its begin/endAllocateToPool
               (torch_bench.py --alt-timing).
  fast=2       (install) the deleter frees at once instead of queueing
               (gpu/bench_class_paths.py); also CUDAPOOL_TORCH_EXT_FAST=2.

``python3 bench/bench_ext.py --torch-dir DIR ...`` compiles it against an
unpacked torch without importing it, with the arguments of
``python -m cudapool._ext`` (.ci/torch_ext_compile.sh).
"""

import argparse
import ctypes
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SOURCE = os.path.join(HERE, "torch_allocator_bench.cpp")
# cudapool_torch_bench_version: a cached build with another is stale.
VERSION = 3

# cudapool_torch_bench_timing_take's kinds, in its order (timing::Kind).
TIMING_KINDS = (("native", "alloc"), ("native", "free"), ("cudapool", "alloc"), ("cudapool", "free"),
                ("cudapool", "alloc_lib"), ("native", "cross"), ("cudapool", "begin_pool"),
                ("cudapool", "end_pool"), ("cudapool", "filter"), ("cudapool", "empty_cache"),
                ("native", "empty_cache"), ("native", "begin_pool"), ("native", "end_pool"))


def _cudapool():
    try:
        import cudapool  # noqa: F401
    except ImportError:
        sys.path.insert(0, os.path.join(REPO, "python"))
    from cudapool import _ext, _lib

    return _ext, _lib


def _unavailable():
    return _cudapool()[0].ExtensionUnavailable


def __getattr__(name):
    # ExtensionUnavailable is cudapool._ext's, resolved when first asked for
    # (importing this module does not import cudapool).
    if name == "ExtensionUnavailable":
        return _unavailable()
    raise AttributeError(name)


_state = {"handle": None}


def build(**kw):
    """Compiles the benchmark's build (cached); the keywords are
    cudapool._ext.build's. Returns the library's path."""
    _ext, _ = _cudapool()
    product = _ext.source_path()
    return _ext.build(source=SOURCE, name="cudapool_torch_bench", include=[os.path.dirname(product)],
                      depends=[product], **kw)


def _fast_from_env(environ=None):
    v = (os.environ if environ is None else environ).get("CUDAPOOL_TORCH_EXT_FAST", "1").strip()
    return {"0": 0, "2": 2}.get(v, 1)


def install(fast=None):
    """cudapool.install() with the benchmark's build of the class; must run
    instead of it, before CUDA is initialized. fast: 1 the direct path
    (needed by the switches), 0 the pluggable base's, 2 the direct path with
    frees made at once; default $CUDAPOOL_TORCH_EXT_FAST, else 1. Raises
    cudapool._ext.ExtensionUnavailable when the build cannot be made or
    installed."""
    _ext, _lib = _cudapool()
    import cudapool
    import torch

    Unavailable = _ext.ExtensionUnavailable
    if cudapool.installed():
        raise Unavailable("bench_ext.install() must run instead of cudapool.install(), which ran before")
    if torch.cuda.is_initialized():
        raise Unavailable("bench_ext.install() must run before CUDA is initialized")
    fast = _fast_from_env() if fast is None else int(fast)
    path = build(announce=True)
    _lib.load()  # libcudapool.so first, from the path the build links
    try:
        h = ctypes.CDLL(path)
    except OSError as e:
        raise Unavailable(f"loading {path} failed: {e}")
    if h.cudapool_torch_bench_version() != VERSION:
        raise Unavailable(f"{path} is a stale build (interface {h.cudapool_torch_bench_version()})")
    buf = ctypes.create_string_buffer(4096)
    h.cudapool_torch_bench_install.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    if h.cudapool_torch_bench_install(fast, buf, len(buf)) != 0:
        raise Unavailable(buf.value.decode(errors="replace"))
    _state["handle"] = h
    # cudapool.install() then loads this build (its class installed above,
    # so the shipped entry point keeps it) instead of building the shipped one.
    _ext._state.update(path=path, why=None)
    cudapool.install(cpp_class=True)
    return h


def _handle(what):
    h = _state["handle"]
    if h is None:
        raise _unavailable()(f"{what} needs the benchmark's build of the class: bench_ext.install()")
    return h


def passthrough(on):
    """Hands torch's allocations to PyTorch's own allocator (True) or back to
    cudapool (False); see the module's note. Raises ExtensionUnavailable when
    the build is not installed on its direct path or PyTorch's allocator is
    not at hand."""
    if _handle("passthrough").cudapool_torch_bench_passthrough(1 if on else 0) != 0:
        raise _unavailable()("passthrough needs the benchmark's build installed on its direct path, "
                             "over PyTorch's own allocator")


def timing(on, cross=False):
    """Turns call timing on (a new measurement) or off. cross: after each of
    native's allocate() calls, also make a call into cudapool's Go code that
    does almost nothing (timed as ("native", "cross")), to see what a
    crossing costs what runs around it."""
    if _handle("timing").cudapool_torch_bench_timing((2 if cross else 1) if on else 0) != 0:
        raise _unavailable()("timing needs the benchmark's build installed on its direct path")


def native_counts(device=0):
    """PyTorch's own allocator's (device_allocs, device_frees, reserved bytes)
    on device, what torch.cuda.memory_stats() reports of cudapool's as
    num_device_alloc, num_device_free and reserved_bytes.all.current (an
    allocator that does not count them, such as the cudaMallocAsync
    backend's, may report 0). Raises ExtensionUnavailable when PyTorch's
    allocator is not at hand or has not started."""
    f = _handle("native_counts").cudapool_torch_bench_native_counts
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int64)]
    out = (ctypes.c_int64 * 3)()
    if f(device, out) != 0:
        raise _unavailable()("native_counts needs PyTorch's own allocator, started, under the benchmark's build")
    return tuple(out)


def timing_take(cap=1 << 17):
    """The samples timed since the last take, in ns, and forgets them:
    {(allocator, call): (samples, calls)} over TIMING_KINDS, where calls
    counts every timed call (more than the samples when the build's buffer
    of 2^17 per kind filled)."""
    f = _handle("timing").cudapool_torch_bench_timing_take
    f.restype = ctypes.c_long
    f.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_uint32), ctypes.c_size_t,
                  ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_double)]
    buf = (ctypes.c_uint32 * cap)()
    out = {}
    for k, key in enumerate(TIMING_KINDS):
        calls, scale = ctypes.c_uint64(), ctypes.c_double()
        n = f(k, buf, cap, ctypes.byref(calls), ctypes.byref(scale))
        if n < 0:
            raise _unavailable()(f"timing kind {k} refused: a stale build")
        out[key] = ([buf[i] * scale.value for i in range(n)], calls.value)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description="Build the benchmark's build of cudapool's C++ allocator class.")
    ap.add_argument("--torch-dir", help="an unpacked torch package directory (default: the importable torch)")
    ap.add_argument("--cuda-include", action="append", help="CUDA include directory (repeatable)")
    ap.add_argument("--library", help="libcudapool.so to link against")
    ap.add_argument("--out", help="output path (default: the cache)")
    args = ap.parse_args(argv)
    Unavailable = _unavailable()
    try:
        path = build(torch_dir=args.torch_dir, out=args.out, cuda_include=args.cuda_include, library=args.library,
                     verbose=True)
    except Unavailable as e:
        print(f"cudapool: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
