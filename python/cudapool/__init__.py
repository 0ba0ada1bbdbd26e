# SPDX-License-Identifier: Apache-2.0
"""cudapool: a CUDA caching memory allocator for PyTorch, written in Go.

Whole-process mode (before CUDA is initialized)::

    import cudapool
    cudapool.install()          # or: python -m cudapool train.py ...

Per-pool mode (no install needed)::

    pool = torch.cuda.MemPool(allocator=cudapool.allocator().allocator())
    with torch.cuda.use_mem_pool(pool):
        ...

Statistics and introspection have PyTorch's shapes: memory_stats(),
memory_summary(), snapshot() (readable by torch.cuda._memory_viz), ...
"""

import collections
import contextlib
import json
import operator
import sys

from . import _lib
from ._lib import CudapoolError, InvalidDeviceError, OutOfMemoryError
from ._summary import format_summary
from ._torch import allocator, installed, mode
from ._torch import install as _torch_install
from ._version import ABI_VERSION, __version__

__all__ = [
    "CudapoolError",
    "OutOfMemoryError",
    "InvalidDeviceError",
    "install",
    "installed",
    "mode",
    "allocator",
    "library_path",
    "configure",
    "memory_stats",
    "memory_stats_as_nested_dict",
    "front_counters",
    "memory_allocated",
    "memory_reserved",
    "max_memory_allocated",
    "max_memory_reserved",
    "reset_peak_memory_stats",
    "reset_accumulated_memory_stats",
    "memory_summary",
    "snapshot",
    "memory_snapshot",
    "record_memory_history",
    "empty_cache",
    "set_per_process_memory_fraction",
    "region",
    "pause",
    "resume",
    "paused",
    "paused_bytes",
    "release_host_memory",
]



def install(*args, cupy=False, numba=False, **kwargs):
    """Make cudapool PyTorch's CUDA allocator (see cudapool._torch.install
    for the arguments); with cupy=True also CuPy's (cudapool.cupy.install()),
    with numba=True also Numba's memory manager (cudapool.numba.install()),
    so that the libraries share one pool. Returns PyTorch's allocator."""
    alloc = _torch_install(*args, **kwargs)
    if cupy:
        from . import cupy as _cupy

        _cupy.install()
    if numba:
        from . import numba as _numba

        _numba.install()
    return alloc


def library_path():
    """Path of the libcudapool.so in use."""
    return _lib.library_path()


def _current_device():
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                return torch.cuda.current_device()
        except Exception:  # a torch without CUDA support
            pass
    return 0


def _device_index(device):
    """None (current device), int, "cuda[:N]" or torch.device -> int.

    TypeError for anything else (bool included); InvalidDeviceError (a
    ValueError) for a negative index or one no C int holds. Whether the
    device exists is the library's to say: the functions that pass the
    index on raise InvalidDeviceError for one it does not have."""
    if device is None:
        return _current_device()
    if isinstance(device, bool):
        raise TypeError(f"invalid device {device!r}: expected None, an int, a 'cuda:N' string or a torch.device")
    if isinstance(device, str):
        if "\0" in device:
            raise ValueError(f"invalid device {device!r}: it contains a NUL character")
        kind, _, index = device.partition(":")
        if kind != "cuda" or (index and not (index.isascii() and index.isdigit())):
            raise ValueError(f"invalid device {device!r}: expected 'cuda' or 'cuda:N'")
        return _in_range(int(index)) if index else _current_device()
    kind, index = getattr(device, "type", None), getattr(device, "index", None)
    if kind is not None:  # torch.device
        if kind != "cuda":
            raise ValueError(f"expected a CUDA device, got {device!r}")
        return _current_device() if index is None else _in_range(int(index))
    if hasattr(type(device), "__index__"):  # int, numpy integers
        return _in_range(operator.index(device))
    raise TypeError(f"invalid device {device!r}: expected None, an int, a 'cuda:N' string or a torch.device")


def _in_range(index):
    if not 0 <= index <= _lib.MAX_DEVICE:
        raise InvalidDeviceError(f"invalid device {index}: a device index is between 0 and the device count - 1")
    return index


def configure(conf):
    """Replace the allocator settings with conf, in PYTORCH_CUDA_ALLOC_CONF
    syntax, e.g. ``"max_split_size_mb:256,garbage_collection_threshold:0.8"``
    (include/cudapool.h, cudapool_configure, lists the keys; cudapool's own
    include ``record_history:N`` and ``debug_checks:True``).

    Keys are case-sensitive, as in PyTorch. A key neither cudapool nor
    PyTorch knows, or a bad value, raises CudapoolError naming it (and, for a
    key, the known ones; long input is shown cut), and the settings in force
    stay as they were. PyTorch keys cudapool has no use for (the pinned-memory
    ones) are accepted. conf must be a str (TypeError otherwise) without NUL
    characters (ValueError)."""
    _lib.configure(conf)


def memory_stats(device=None):
    """torch.cuda.memory_stats() for cudapool: an OrderedDict sorted by key."""
    stats = _lib.memory_stats(_device_index(device))
    return collections.OrderedDict(sorted(stats.items()))


def front_counters(device=None):
    """What cudapool's front cache did on device since the process started:
    ``hits`` (mallocs it served without entering Go), ``pool_hits`` (of
    those, in a graph capture's or MemPool's private pool), ``cold_skipped``
    (blocks it did not track because sizes stopped repeating) and
    ``cold_verdicts``. All 0 with ``front_cache:False``."""
    dev = _device_index(device)
    _lib.check_device(dev)
    return _lib.front_counters(dev)


def memory_stats_as_nested_dict(device=None):
    """memory_stats() as nested dicts ("a.b.c" -> d["a"]["b"]["c"])."""
    out = {}
    for key, value in memory_stats(device).items():
        node = out
        *path, last = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def _stat(key, device):
    return _lib.memory_stats(_device_index(device))[key]


def memory_allocated(device=None):
    """Bytes currently allocated to tensors on device."""
    return _stat("allocated_bytes.all.current", device)


def max_memory_allocated(device=None):
    """Peak of memory_allocated() since start or the last peak reset."""
    return _stat("allocated_bytes.all.peak", device)


def memory_reserved(device=None):
    """Bytes held by cudapool on device (allocated and cached)."""
    return _stat("reserved_bytes.all.current", device)


def max_memory_reserved(device=None):
    """Peak of memory_reserved() since start or the last peak reset."""
    return _stat("reserved_bytes.all.peak", device)


def reset_peak_memory_stats(device=None):
    """Set every peak statistic to its current value."""
    _lib.reset_peak_stats(_device_index(device))


def reset_accumulated_memory_stats(device=None):
    """Zero the allocated/freed totals and the event counters."""
    _lib.reset_accumulated_stats(_device_index(device))


def memory_summary(device=None, abbreviated=False):
    """The table torch.cuda.memory_summary() prints, for cudapool's stats."""
    dev = _device_index(device)
    return format_summary(_lib.memory_stats(dev), dev, abbreviated)


def snapshot(device=None, augment_with_fx_traces=False):
    """torch.cuda.memory._snapshot() for cudapool: {"segments",
    "device_traces", "allocator_settings", "external_annotations"}, which
    torch.cuda._memory_viz and pytorch.org/memory_viz read. Traces are kept
    only after record_memory_history(). The arguments are accepted for
    compatibility; all devices are reported, as PyTorch does, but a device
    that does not exist raises InvalidDeviceError (a ValueError)."""
    dev = None if device is None else _device_index(device)
    snap = json.loads(_lib.snapshot_json())
    count = len(snap.get("device_traces", ()))
    if dev is not None and dev >= count:
        raise InvalidDeviceError(f"invalid device {dev}: cudapool has {count} device{'s' if count != 1 else ''}")
    for seg in snap.get("segments", ()):
        if isinstance(seg.get("segment_pool_id"), list):
            seg["segment_pool_id"] = tuple(seg["segment_pool_id"])
    return snap


def memory_snapshot(mempool_id=None, include_traces=True):
    """torch.cuda.memory_snapshot(): the segment list, optionally of one pool."""
    segments = snapshot()["segments"]
    if mempool_id is not None:
        want = tuple(mempool_id)
        segments = [s for s in segments if tuple(s["segment_pool_id"]) == want]
    return segments


def _settings():
    return snapshot()["allocator_settings"].get("PYTORCH_CUDA_ALLOC_CONF", "")


def record_memory_history(max_entries=100_000):
    """Keep the last max_entries allocator actions per device for
    snapshot()["device_traces"]; 0 or None stops recording."""
    if max_entries is not None and (isinstance(max_entries, bool) or not hasattr(type(max_entries), "__index__")):
        raise TypeError(f"max_entries must be an int or None, not {type(max_entries).__name__}")
    n = operator.index(max_entries or 0)
    if n < 0:
        raise ValueError(f"max_entries must be >= 0, got {max_entries}")
    kept = [item for item in _split_conf(_settings()) if not item.strip().startswith("record_history:")]
    _lib.configure(",".join(kept + [f"record_history:{n}"]))


def _split_conf(conf):
    """Split on commas outside brackets."""
    items, depth, cur = [], 0, ""
    for ch in conf:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        items.append(cur)
    return [i for i in items if i.strip()]


def empty_cache():
    """Return every cached, unused segment to the driver."""
    _lib.empty_cache()


def set_per_process_memory_fraction(fraction, device=None):
    """Limit what cudapool reserves on device to fraction of its memory."""
    if not isinstance(fraction, float):
        raise TypeError("Invalid type for fraction argument, must be `float`")
    if fraction < 0 or fraction > 1:
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    _lib.set_memory_fraction(fraction, _device_index(device))


# ---- Pause and resume by tag (include/cudapool.h, "Pause and resume by tag")


@contextlib.contextmanager
def region(tag):
    """Allocations the calling thread makes inside the block (PyTorch's,
    CuPy's, Numba's: every entry point of the library) belong to tag, and
    so does the private pool of a CUDA graph captured in it
    (torch.cuda.graph, torch.compile(mode="reduce-overhead"), a CuPy
    capture). pause(tag) gives that memory back to the driver; resume(tag)
    brings it back at the same addresses, so that captured graphs replay
    as they were. Regions nest (the innermost tag wins) and belong to the
    thread that enters them. Also usable as a decorator."""
    _lib.tag_push(tag)
    try:
        yield
    finally:
        _lib.tag_pop()


def pause(tag=None, keep=False):
    """Give back the device memory of tag (None: every tag), on every
    device: wait for the work queued on it, copy the contents of its live
    allocations to pinned host memory if keep, then release the physical
    memory; the addresses stay reserved and the tensors allocated. While it
    is paused, allocating under the tag raises and its memory must not be
    touched; freeing its tensors is allowed. Raises CudapoolError during a
    CUDA graph capture, for a tag never used, or for a tag whose memory is
    shared with another process."""
    _lib.pause(tag, keep)


def resume(tag=None):
    """Map new memory at the addresses of tag's paused memory (None: every
    paused tag) and restore the contents a pause with keep kept. A tag that
    is not paused is left alone. On failure (out of memory, for one) the
    tag stays paused and resume can be called again."""
    _lib.resume(tag)


def paused():
    """The paused tags: {tag: bytes of device memory given back, summed over
    the devices}."""
    tags = snapshot()["allocator_settings"].get("tags") or []
    return {t["tag"]: sum(t["paused_bytes"]) for t in tags if t["paused"]}


def paused_bytes(device=None):
    """Bytes of device memory of device that pauses gave back and no resume
    has mapped again."""
    return _lib.paused_bytes(_device_index(device))


def release_host_memory():
    """Free the pinned host memory cudapool keeps for the copies of later
    pauses (the contents a paused tag keeps stay)."""
    _lib.release_host_memory()
