# SPDX-License-Identifier: Apache-2.0
"""Thin ctypes binding of libcudapool.so's C ABI (include/cudapool.h).

The library is found by :func:`find_library` and loaded once per process (a Go
c-shared library cannot be unloaded). Every wrapper here raises
:class:`CudapoolError` with the library's message when the call fails.
"""

import ctypes
import json
import os
import re
import threading

__all__ = [
    "CudapoolError",
    "OutOfMemoryError",
    "InvalidDeviceError",
    "LIBRARY_NAME",
    "find_library",
    "library_path",
    "library_version",
    "check_version",
    "load",
    "address",
]

LIBRARY_NAME = "libcudapool.so"

_HERE = os.path.dirname(os.path.abspath(__file__))


class CudapoolError(RuntimeError):
    """A cudapool operation failed; the message is the library's."""


class OutOfMemoryError(CudapoolError):
    """cudapool could not find memory for an allocation."""


class InvalidDeviceError(CudapoolError, ValueError):
    """A device index that names none of cudapool's devices (a ValueError,
    as PyTorch raises for a bad device)."""


#: The largest device index a C int holds: larger ones would wrap around.
MAX_DEVICE = 2**31 - 1


# ---------------------------------------------------------------------------
# Locating the library


def candidates(env=None, package_dir=_HERE):
    """The places looked at, in order, as (description, path) pairs.

    1. ``$CUDAPOOL_LIBRARY``;
    2. the copy shipped inside the installed package (``cudapool/_lib/``);
    3. the repository's ``lib/`` when running from a checkout
       (``python/cudapool/_lib`` -> ``lib/libcudapool.so``).
    """
    env = os.environ if env is None else env
    out = []
    explicit = env.get("CUDAPOOL_LIBRARY")
    if explicit:
        out.append(("$CUDAPOOL_LIBRARY", explicit))
    out.append(("bundled with the package", os.path.join(package_dir, LIBRARY_NAME)))
    repo = os.path.normpath(os.path.join(package_dir, os.pardir, os.pardir, os.pardir))
    out.append(("repository lib/", os.path.join(repo, "lib", LIBRARY_NAME)))
    return out


def find_library(env=None, package_dir=_HERE):
    """Return the absolute path of libcudapool.so, or raise CudapoolError.

    ``$CUDAPOOL_LIBRARY``, when set, must name an existing file: it is not
    silently skipped.
    """
    env = os.environ if env is None else env
    looked = []
    for what, path in candidates(env, package_dir):
        if os.path.isfile(path):
            return os.path.realpath(path)
        looked.append(f"  {path} ({what}): not found")
        if what == "$CUDAPOOL_LIBRARY":
            raise CudapoolError(
                "cudapool: CUDAPOOL_LIBRARY is set but names no file:\n"
                + "\n".join(looked)
                + "\nUnset it or point it at a built libcudapool.so."
            )
    raise CudapoolError(
        "cudapool: cannot find libcudapool.so. Looked in:\n"
        + "\n".join(looked)
        + "\nBuild it with `make` (or `go build -buildmode=c-shared -o lib/libcudapool.so ./capi`) "
        "in the repository, reinstall the package with `pip install ./python` where Go is "
        "available, or set CUDAPOOL_LIBRARY to a built library."
    )


# ---------------------------------------------------------------------------
# Loading

stream_t = ctypes.c_void_p
#: int (*)(void* ctx, cudapool_stream stream): nonzero if the stream's
#: allocations go to the pool (see begin_allocate_to_pool).
STREAM_FILTER = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)

_u64 = ctypes.c_ulonglong
_SIGNATURES = {
    "cudapool_malloc": (ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_int, stream_t]),
    "cudapool_free": (None, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, stream_t]),
    "cudapool_init": (None, [ctypes.c_int]),
    "cudapool_empty_cache": (None, []),
    "cudapool_set_memory_fraction": (None, [ctypes.c_double, ctypes.c_int]),
    "cudapool_base_allocation": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]),
    "cudapool_record_stream": (None, [ctypes.c_void_p, stream_t]),
    "cudapool_begin_allocate_to_pool": (None, [ctypes.c_int, _u64, _u64, STREAM_FILTER, ctypes.c_void_p]),
    "cudapool_end_allocate_to_pool": (None, [ctypes.c_int, _u64, _u64]),
    "cudapool_release_pool": (None, [ctypes.c_int, _u64, _u64]),
    # char* results are taken as void* so that they can be given back.
    "cudapool_memory_stats_json": (ctypes.c_void_p, [ctypes.c_int]),
    "cudapool_snapshot_json": (ctypes.c_void_p, []),
    "cudapool_string_free": (None, [ctypes.c_void_p]),
    "cudapool_reset_peak_stats": (None, [ctypes.c_int]),
    "cudapool_get_front_counters": (ctypes.c_int, [ctypes.c_int, ctypes.c_void_p]),
    "cudapool_reset_accumulated_stats": (None, [ctypes.c_int]),
    "cudapool_configure": (ctypes.c_int, [ctypes.c_char_p]),
    "cudapool_last_error": (ctypes.c_char_p, []),
    "cudapool_clear_error": (None, []),
    "cudapool_get_memory_fraction": (ctypes.c_double, [ctypes.c_int]),
    "cudapool_version": (ctypes.c_char_p, []),
    "cudapool_abi_version": (ctypes.c_int, []),
    # Tags: pause and resume.
    "cudapool_tag_push": (ctypes.c_int, [ctypes.c_char_p]),
    "cudapool_tag_pop": (ctypes.c_int, []),
    "cudapool_pause": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_int]),
    "cudapool_resume": (ctypes.c_int, [ctypes.c_char_p]),
    "cudapool_paused_bytes": (ctypes.c_longlong, [ctypes.c_int]),
    "cudapool_release_host_memory": (ctypes.c_int, []),
    # Simulator controls (include/cudapool_testing.h; meaningful with CUDAPOOL_BACKEND=sim).
    "cudapool_sim_begin_capture": (ctypes.c_int, [stream_t, ctypes.c_int]),
    "cudapool_sim_end_capture": (ctypes.c_int, [stream_t]),
    "cudapool_sim_submit": (None, [stream_t]),
    "cudapool_sim_complete_all": (None, []),
    "cudapool_sim_violations": (ctypes.c_longlong, []),
    "cudapool_sim_set_pidfd_errors": (ctypes.c_int, [ctypes.c_int, ctypes.c_int]),
    "cudapool_sim_write": (ctypes.c_int, [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]),
    "cudapool_sim_read": (ctypes.c_int, [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]),
    # CUDA IPC in PyTorch's handle format.
    "cudapool_ipc_share": (
        ctypes.c_int,
        [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t),
         ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_int)],
    ),
    "cudapool_ipc_open_shared": (ctypes.c_void_p, [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]),
    "cudapool_ipc_close": (ctypes.c_int, [ctypes.c_void_p]),
}

#: The C++ entry points PyTorch's CUDAPluggableAllocator hooks call.
TORCH_SYMBOLS = (
    "cudapool_torch_malloc",
    "cudapool_torch_begin_allocate_to_pool",
    "cudapool_torch_end_allocate_to_pool",
    "cudapool_torch_release_pool",
)

_load_lock = threading.Lock()
_lib = None
_path = None


def load():
    """Load the library (once) and return the ctypes handle."""
    global _lib, _path
    if _lib is not None:
        return _lib
    with _load_lock:
        if _lib is None:
            path = find_library()
            try:
                # Plain CDLL, as torch's CUDAPluggableAllocator does: dlopen of
                # the same path returns the same handle, so the hooks and
                # this binding share one Go runtime.
                lib = ctypes.CDLL(path)
            except OSError as e:
                raise CudapoolError(f"cudapool: cannot load {path}: {e}") from e
            for name, (restype, argtypes) in _SIGNATURES.items():
                fn = getattr(lib, name, None)
                if fn is not None:
                    fn.restype, fn.argtypes = restype, argtypes
            check_version(path, *library_version(lib))
            _path = path
            _lib = lib
    return _lib


def library_version(lib):
    """(version string, ABI number) of a loaded library; (None, None) for a
    library older than cudapool_version()."""
    if getattr(lib, "cudapool_version", None) is None or getattr(lib, "cudapool_abi_version", None) is None:
        return None, None
    v = lib.cudapool_version()
    return (v.decode("ascii", "replace") if v is not None else None), lib.cudapool_abi_version()


def check_version(path, version, abi):
    """Raise CudapoolError unless the library at path is this package's
    version with its ABI: the bindings here and the C++ class's sources are
    written for exactly that library, and a mismatch (a stale lib/ in a
    checkout, $CUDAPOOL_LIBRARY naming another build) would otherwise show
    up as wrong results or crashes far from the cause."""
    from .._version import ABI_VERSION, __version__

    if version == __version__ and abi == ABI_VERSION:
        return
    have = "has no cudapool_version() (built before versions were recorded)" if version is None else \
        f"is version {version} (ABI {abi})"
    raise CudapoolError(
        f"cudapool: {path} {have}, but this cudapool Python package is version {__version__} and needs "
        f"that version of the library (ABI {ABI_VERSION}). Rebuild the library (`make` in the repository), "
        "reinstall the package (`pip install ./python`, or the wheel of the same version), or point "
        "CUDAPOOL_LIBRARY at a matching libcudapool.so.")


def library_path():
    """The path of the library in use (loading it if needed)."""
    load()
    return _path


def address(name):
    """Raw address of an exported function, for PyTorch's hook setters."""
    fn = getattr(load(), name, None)
    if fn is None:
        raise CudapoolError(f"cudapool: {library_path()} does not export {name}")
    return ctypes.cast(fn, ctypes.c_void_p).value


def _fn(name):
    fn = getattr(load(), name, None)
    if fn is None:
        raise CudapoolError(f"cudapool: {library_path()} does not export {name} (built without it?)")
    return fn


# ---------------------------------------------------------------------------
# Errors. cudapool_last_error is per thread and errno-like: it keeps the last
# failure's message until the next failure. A failure is known from the
# return value (NULL, non-zero); void functions are checked by clearing the
# slot first (see _checked). Messages start with the name of the C function
# that failed ("cudapool_free: ...").

# The library's message for a device that does not exist.
_NO_DEVICE = re.compile(r"\bdevice -?\d+ does not exist \(\d+ devices?\)")


def last_error():
    """This thread's last failure message, or None."""
    msg = _fn("cudapool_last_error")()
    return None if msg is None else msg.decode("utf-8", "replace")


def _error(default):
    msg = last_error() or default
    if "out of memory" in msg:
        return OutOfMemoryError(msg)
    if _NO_DEVICE.search(msg):
        return InvalidDeviceError(msg)
    return CudapoolError(msg)


_marker_lock = threading.Lock()
_marker_count = 0


def _arm():
    """Set this thread's last error to a fresh marker and return it (for
    callers that check a void function by the marker's absence).

    cudapool_configure rejects an item without ':' before changing anything,
    so this has no effect but the message.
    """
    global _marker_count
    with _marker_lock:
        _marker_count += 1
        token = f"cudapool-python-marker-{os.getpid()}-{_marker_count}"
    rc = _fn("cudapool_configure")(token.encode())
    if rc == 0:  # pragma: no cover - would mean configure accepts anything
        raise CudapoolError("cudapool: cannot arm the error marker (configure accepted it)")
    return token


def _checked(name, *args):
    """Call a void function; raise if it recorded a failure."""
    _fn("cudapool_clear_error")()
    _fn(name)(*args)
    if last_error() is not None:
        raise _error(f"{name} failed")


def check_device(device):
    """Raise InvalidDeviceError unless device is one of cudapool's devices
    (an int; the library knows the count)."""
    if not 0 <= device <= MAX_DEVICE:
        raise InvalidDeviceError(f"cudapool: invalid device {device}: expected 0 to the device count - 1")
    if _fn("cudapool_get_memory_fraction")(device) < 0:
        raise _error(f"cudapool: device {device} cannot be used")


def c_string(s, what="the configuration"):
    """s (a str) encoded for the C ABI: TypeError for anything else, and
    ValueError for a NUL inside it, which C would read as its end."""
    if not isinstance(s, str):
        raise TypeError(f"{what} must be a str, not {type(s).__name__}")
    if "\0" in s:
        raise ValueError(f"{what} contains a NUL character (at index {s.index(chr(0))}), which would cut it short")
    return s.encode()


# ---------------------------------------------------------------------------
# Wrappers


def malloc(size, device=0, stream=0):
    """Allocate; return the address as an int (0 for size 0)."""
    p = _fn("cudapool_malloc")(size, device, stream)
    if p is None:
        if size == 0:
            return 0
        raise _error(f"cudapool_malloc({size}, device={device}) failed")
    return p


def free(ptr, size=0, device=0, stream=0):
    _checked("cudapool_free", ptr, size, device, stream)


def init(device_count):
    _fn("cudapool_init")(device_count)


def empty_cache():
    _checked("cudapool_empty_cache")


def set_memory_fraction(fraction, device=0):
    _checked("cudapool_set_memory_fraction", fraction, device)


def base_allocation(ptr):
    """(segment base, segment size) of the segment holding ptr."""
    size = ctypes.c_size_t(0)
    base = _fn("cudapool_base_allocation")(ptr, ctypes.byref(size))
    if base is None:
        raise _error(f"cudapool_base_allocation({ptr:#x}) failed")
    return base, size.value


def record_stream(ptr, stream):
    _checked("cudapool_record_stream", ptr, stream)


def begin_allocate_to_pool(device, pool_id, filter=None, ctx=None):
    """Route allocations whose stream passes filter (a STREAM_FILTER, or None
    for every stream) to the private pool pool_id (a pair of ints). The
    caller keeps filter alive until end_allocate_to_pool."""
    a, b = pool_id
    _checked("cudapool_begin_allocate_to_pool", device, a, b, filter or STREAM_FILTER(), ctx)


def end_allocate_to_pool(device, pool_id):
    a, b = pool_id
    _checked("cudapool_end_allocate_to_pool", device, a, b)


def release_pool(device, pool_id):
    a, b = pool_id
    _checked("cudapool_release_pool", device, a, b)


def _take_string(p, what):
    if p is None:
        raise _error(f"{what} failed")
    try:
        return ctypes.string_at(p).decode("utf-8")
    finally:
        _fn("cudapool_string_free")(p)


class FrontCounters(ctypes.Structure):
    """cudapool_front_counters (include/cudapool_testing.h)."""

    _fields_ = [(name, ctypes.c_ulonglong) for name in ("hits", "pool_hits", "cold_skipped", "cold_verdicts")]


def front_counters(device=0):
    """The front cache's counters of device as a dict (cudapool_get_front_counters)."""
    c = FrontCounters()
    if _fn("cudapool_get_front_counters")(device, ctypes.byref(c)) != 0:
        raise CudapoolError(f"cudapool_get_front_counters({device}): the front cache serves devices 0-15 only")
    return {name: getattr(c, name) for name, _ in FrontCounters._fields_}


def memory_stats_json(device=0):
    return _take_string(_fn("cudapool_memory_stats_json")(device), f"cudapool_memory_stats_json({device})")


def memory_stats(device=0):
    """The flat stats dict as the library reports it (unsorted)."""
    return json.loads(memory_stats_json(device))


def snapshot_json():
    return _take_string(_fn("cudapool_snapshot_json")(), "cudapool_snapshot_json")


def reset_peak_stats(device=0):
    _checked("cudapool_reset_peak_stats", device)


def reset_accumulated_stats(device=0):
    _checked("cudapool_reset_accumulated_stats", device)


def configure(conf):
    """Apply a PYTORCH_CUDA_ALLOC_CONF-style string (see cudapool.configure)."""
    if _fn("cudapool_configure")(c_string(conf)) != 0:
        raise _error("cudapool_configure failed")


def tag_push(tag):
    """Push tag (a str) on the calling thread's tag stack."""
    if _fn("cudapool_tag_push")(c_string(tag, "the tag")) != 0:
        raise _error("cudapool_tag_push failed")


def tag_pop():
    """Pop the calling thread's top tag."""
    if _fn("cudapool_tag_pop")() != 0:
        raise _error("cudapool_tag_pop failed")


def _tag_arg(tag):
    return None if tag is None else c_string(tag, "the tag")


def pause(tag=None, keep=False):
    """Pause tag (None: every tag); keep: keep the contents."""
    if _fn("cudapool_pause")(_tag_arg(tag), 1 if keep else 0) != 0:
        raise _error("cudapool_pause failed")


def resume(tag=None):
    """Resume tag (None: every paused tag)."""
    if _fn("cudapool_resume")(_tag_arg(tag)) != 0:
        raise _error("cudapool_resume failed")


def paused_bytes(device=0):
    """Device memory of device given back by pauses and not yet resumed."""
    n = _fn("cudapool_paused_bytes")(device)
    if n < 0:
        raise _error(f"cudapool_paused_bytes({device}) failed")
    return n


def release_host_memory():
    """Free the pinned host memory kept for the copies of later pauses."""
    if _fn("cudapool_release_host_memory")() != 0:
        raise _error("cudapool_release_host_memory failed")


def sim_begin_capture(stream, mode=0):
    """Begin a simulated capture (mode 0 global, 1 thread-local, 2 relaxed);
    returns the CUresult (0 on success)."""
    return _fn("cudapool_sim_begin_capture")(stream, mode)


def sim_end_capture(stream):
    return _fn("cudapool_sim_end_capture")(stream)


def sim_submit(stream):
    """Queue one unit of simulated work on stream (pending until
    sim_complete_all)."""
    _checked("cudapool_sim_submit", stream)


def sim_complete_all():
    _fn("cudapool_sim_complete_all")()


def sim_violations():
    return _fn("cudapool_sim_violations")()


def sim_set_pidfd_errors(open_errno=0, getfd_errno=0):
    """Make the simulated process's pidfd_open / pidfd_getfd fail with these
    errno values (0: work)."""
    if _fn("cudapool_sim_set_pidfd_errors")(open_errno, getfd_errno) != 0:
        raise _error("cudapool_sim_set_pidfd_errors failed")


def sim_write(ptr, data, device=0):
    """Write bytes to simulated device memory at ptr."""
    buf = ctypes.create_string_buffer(bytes(data), len(data))
    if _fn("cudapool_sim_write")(device, ptr, buf, len(data)) != 0:
        raise _error(f"cudapool_sim_write({ptr:#x}) failed")


def sim_read(ptr, n, device=0):
    """Read n bytes of simulated device memory at ptr."""
    buf = ctypes.create_string_buffer(n)
    if _fn("cudapool_sim_read")(device, ptr, buf, n) != 0:
        raise _error(f"cudapool_sim_read({ptr:#x}) failed")
    return buf.raw


# ---------------------------------------------------------------------------
# CUDA IPC in PyTorch's handle format (include/cudapool.h, cudapool_ipc_share)


def ipc_share(ptr):
    """PyTorch's shareable handle of the allocation at ptr: (handle bytes,
    offset, device). Works for ordinary and expandable memory."""
    fn = _fn("cudapool_ipc_share")
    n, off, dev = ctypes.c_size_t(0), ctypes.c_size_t(0), ctypes.c_int(-1)
    buf = ctypes.create_string_buffer(256)
    if fn(ptr, buf, len(buf), ctypes.byref(n), ctypes.byref(off), ctypes.byref(dev)) != 0:
        if n.value <= len(buf):
            raise _error(f"cudapool_ipc_share({ptr:#x}) failed")
        buf = ctypes.create_string_buffer(n.value)  # longer than guessed
        if fn(ptr, buf, len(buf), ctypes.byref(n), ctypes.byref(off), ctypes.byref(dev)) != 0:
            raise _error(f"cudapool_ipc_share({ptr:#x}) failed")
    return buf.raw[: n.value], off.value, dev.value


def ipc_open_shared(handle, device=0):
    """Map the memory another process shared (a handle from ipc_share or
    PyTorch) on device; returns its address (the handle's offset is from
    there). Close with ipc_close."""
    handle = bytes(handle)
    p = _fn("cudapool_ipc_open_shared")(device, handle, len(handle))
    if not p:
        raise _error(f"cudapool_ipc_open_shared({len(handle)} bytes, device={device}) failed")
    return p


def ipc_close(ptr):
    """Drop one open of the mapping at ptr (what ipc_open_shared returned)."""
    if _fn("cudapool_ipc_close")(ptr) != 0:
        raise _error(f"cudapool_ipc_close({ptr:#x}) failed")
