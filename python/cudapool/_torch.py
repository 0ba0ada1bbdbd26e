# SPDX-License-Identifier: Apache-2.0
"""PyTorch integration: install() (whole-process mode), allocator()
(per-pool mode) and the routing of torch.cuda's statistics to cudapool."""

import os
import sys
import threading

from . import _ext, _lib
from ._lib import CudapoolError

# PyTorch hook setter -> exported symbol. The four torch_* entry points are
# C++ functions with exactly the types PyTorch calls (see pytorch-facts.md).
_HOOKS = (
    ("set_init_fn", "cudapool_init"),
    ("set_reset_fn", "cudapool_empty_cache"),
    ("set_memory_fraction_fn", "cudapool_set_memory_fraction"),
    ("set_base_alloc_fn", "cudapool_base_allocation"),
    ("set_record_stream_fn", "cudapool_record_stream"),
    ("set_begin_allocate_to_pool", "cudapool_torch_begin_allocate_to_pool"),
    ("set_end_allocate_to_pool_fn", "cudapool_torch_end_allocate_to_pool"),
    ("set_release_pool", "cudapool_torch_release_pool"),
)

_lock = threading.RLock()
_installed = None  # the allocator object made current by install()
_mode = None  # "class" or "pluggable" once installed
_per_pool = None  # the one allocator() hands out
_originals = {}  # (module, name) -> the torch function we replaced


def _import_torch(what):
    try:
        import torch
    except ImportError as e:
        raise CudapoolError(
            f"{what} requires PyTorch, but `import torch` failed ({e}). Install PyTorch with "
            "CUDA support; cudapool's statistics functions work without it."
        ) from e
    if not hasattr(torch, "cuda") or not hasattr(torch.cuda, "memory") or not hasattr(
        torch.cuda.memory, "CUDAPluggableAllocator"
    ):
        raise CudapoolError(f"{what}: this PyTorch ({getattr(torch, '__version__', '?')}) has no CUDAPluggableAllocator")
    return torch


def installed():
    """True once install() has made cudapool PyTorch's CUDA allocator."""
    return _installed is not None


def mode():
    """How cudapool is PyTorch's allocator: "class" (the C++ allocator class,
    full fidelity), "pluggable" (torch's CUDAPluggableAllocator with hooks),
    or None (not installed)."""
    return _mode


_FALLBACK_LOST = (
    "torch.compile(mode='reduce-overhead') runs with CUDA graph trees off, and cuDNN benchmark mode "
    "(cacheInfo), CUDA IPC, MemPool(), torch._C memory statistics and memory history with stacks are "
    "unavailable"
)


def install(patch_torch=True, cpp_class=None):
    """Make cudapool the CUDA allocator of this process.

    Must run before CUDA is initialized (before the first CUDA tensor).
    Idempotent. Returns the allocator object PyTorch holds.

    cpp_class: None (default) uses cudapool's C++ allocator class
    (csrc/torch_allocator.cpp, built against this torch on first use and
    cached), through which every torch.cuda and torch._C memory function
    reaches cudapool; if it cannot be built here it falls back to PyTorch's
    CUDAPluggableAllocator with cudapool's hooks, saying once on stderr what
    is then unavailable and why. True requires the class (CudapoolError if
    unavailable); False forces the fallback. $CUDAPOOL_TORCH_EXT=0 also
    forces it.

    With patch_torch (the default), in the fallback only, torch.cuda's
    statistics functions (memory_stats, memory_allocated, ...,
    memory._snapshot) are pointed at cudapool, since PyTorch refuses them
    for pluggable allocators.
    """
    global _installed, _mode
    with _lock:
        torch = _import_torch("cudapool.install()")
        if _installed is None:
            if torch.cuda.is_initialized():
                raise CudapoolError(
                    "cudapool.install() must run before CUDA is initialized, but "
                    "torch.cuda.is_initialized() is True: something already used the GPU. "
                    "Call cudapool.install() at the very start of the program, or run it "
                    "with `python -m cudapool script.py`."
                )
            if cpp_class is not False:
                try:
                    _ext.install(fast=os.environ.get("CUDAPOOL_TORCH_EXT_FAST", "1").strip() != "0")
                    _installed = torch.cuda.memory._get_current_allocator()
                    _mode = "class"
                except _ext.ExtensionUnavailable as e:
                    if cpp_class:
                        raise CudapoolError(f"cudapool.install(cpp_class=True): the C++ allocator class is unavailable: {e}") from e
                    _fallback_note(torch, str(e))
            if _installed is None:
                _installed = _install_pluggable(torch)
                _mode = "pluggable"
        if patch_torch and _mode == "pluggable":
            _patch_torch(torch)
        return _installed


def _fallback_note(torch, why):
    """Say once why the C++ class is not used, and turn CUDA graph trees off
    (they need graph-pool checkpoints, which only the class provides)."""
    try:
        import torch._inductor.config as inductor_config

        inductor_config.triton.cudagraph_trees = False
    except Exception:  # no inductor in this torch: nothing to turn off
        pass
    sys.stderr.write(
        "cudapool: using PyTorch's CUDAPluggableAllocator path: the C++ allocator class is unavailable ("
        + why.replace("\n", " ").strip()
        + "); "
        + _FALLBACK_LOST
        + ".\n"
    )


def _install_pluggable(torch):
    path = _lib.library_path()
    try:
        alloc = torch.cuda.memory.CUDAPluggableAllocator(path, "cudapool_torch_malloc", "cudapool_torch_free")
    except (AttributeError, RuntimeError, OSError) as e:
        raise CudapoolError(f"cudapool.install(): cannot create a CUDAPluggableAllocator from {path}: {e}") from e
    hooks = alloc._allocator
    for setter, symbol in _HOOKS:
        getattr(hooks, setter)(_lib.address(symbol))
    try:
        torch.cuda.memory.change_current_allocator(alloc)
    except RuntimeError as e:
        raise CudapoolError(f"cudapool.install(): PyTorch refused the allocator: {e}") from e
    return alloc


def allocator():
    """A CUDAPluggableAllocator over cudapool for per-pool use::

        pool = torch.cuda.MemPool(allocator=cudapool.allocator().allocator())

    PyTorch's own caching allocator then takes that pool's segments from
    cudapool. Needs no install(). Its alloc returns NULL on failure, which
    PyTorch's caching allocator turns into its usual out-of-memory handling.
    """
    global _per_pool
    with _lock:
        if _per_pool is None:
            torch = _import_torch("cudapool.allocator()")
            _per_pool = torch.cuda.memory.CUDAPluggableAllocator(
                _lib.library_path(), "cudapool_malloc", "cudapool_free"
            )
        return _per_pool


# ---------------------------------------------------------------------------
# Routing torch.cuda's introspection to cudapool


def _torch_record_memory_history(enabled="all", *args, **kwargs):
    """torch.cuda.memory._record_memory_history, recording in cudapool.

    Only the entry limit is honoured (stack traces are not recorded); an
    unlimited request keeps 1,000,000 entries per device."""
    from . import record_memory_history

    if isinstance(enabled, bool):  # legacy form: (enabled, record_context, trace_alloc_max_entries, ...)
        limit = kwargs.get("trace_alloc_max_entries", args[1] if len(args) > 1 else 1)
    else:  # (enabled, context, stacks, max_entries, ...)
        limit = kwargs.get("max_entries", args[2] if len(args) > 2 else sys.maxsize)
        enabled = enabled is not None
    if kwargs.get("clear_history"):
        record_memory_history(0)
    record_memory_history(min(int(limit), 1_000_000) if enabled else 0)


def _replacements():
    import cudapool as cp

    return {
        "memory_stats": cp.memory_stats,
        "memory_stats_as_nested_dict": cp.memory_stats_as_nested_dict,
        "memory_allocated": cp.memory_allocated,
        "max_memory_allocated": cp.max_memory_allocated,
        "memory_reserved": cp.memory_reserved,
        "max_memory_reserved": cp.max_memory_reserved,
        "reset_peak_memory_stats": cp.reset_peak_memory_stats,
        "reset_accumulated_memory_stats": cp.reset_accumulated_memory_stats,
        "memory_summary": cp.memory_summary,
        "memory_snapshot": cp.memory_snapshot,
    }


def _patch_torch(torch):
    """Point torch.cuda.X and torch.cuda.memory.X at cudapool's versions."""
    targets = [(torch.cuda, name, fn) for name, fn in _replacements().items()]
    targets += [(torch.cuda.memory, name, fn) for name, fn in _replacements().items()]
    import cudapool as cp

    targets += [
        (torch.cuda.memory, "_snapshot", cp.snapshot),
        (torch.cuda.memory, "_record_memory_history", _torch_record_memory_history),
    ]
    for module, name, fn in targets:
        if not hasattr(module, name):
            continue
        key = (module.__name__, name)
        if key not in _originals:
            _originals[key] = (module, getattr(module, name))
        setattr(module, name, fn)


def _unpatch_torch():
    """Undo _patch_torch (for tests)."""
    for (_, name), (module, fn) in list(_originals.items()):
        setattr(module, name, fn)
    _originals.clear()


def original(module_name, name):
    """The torch function _patch_torch replaced (None if not replaced)."""
    entry = _originals.get((module_name, name))
    return None if entry is None else entry[1]
