# SPDX-License-Identifier: Apache-2.0
import ctypes

import torch

_current = None


def _refused(what):
    raise RuntimeError(f"CUDAPluggableAllocator does not yet support {what}. "
                       "If you need it, please file an issue describing your use case.")


def memory_stats(device=None):
    _refused("getDeviceStats")


def memory_stats_as_nested_dict(device=None):
    _refused("getDeviceStats")


def memory_allocated(device=None):
    # like PyTorch: through the module's memory_stats
    return memory_stats(device=device).get("allocated_bytes.all.current", 0)


def max_memory_allocated(device=None):
    return memory_stats(device=device).get("allocated_bytes.all.peak", 0)


def memory_reserved(device=None):
    return memory_stats(device=device).get("reserved_bytes.all.current", 0)


def max_memory_reserved(device=None):
    return memory_stats(device=device).get("reserved_bytes.all.peak", 0)


def reset_peak_memory_stats(device=None):
    _refused("resetPeakStats")


def reset_accumulated_memory_stats(device=None):
    _refused("resetAccumulatedStats")


def memory_summary(device=None, abbreviated=False):
    return str(memory_stats(device))


def memory_snapshot(mempool_id=None, include_traces=True):
    return _snapshot()["segments"]


def _snapshot(device=None, augment_with_fx_traces=False):
    _refused("snapshot")


def _record_memory_history(enabled="all", *args, **kwargs):
    _refused("recordHistory")


class _CUDAAllocator:
    def __init__(self, allocator):
        self._allocator = allocator

    def allocator(self):
        return self._allocator


class CUDAPluggableAllocator(_CUDAAllocator):
    def __init__(self, path_to_so_file, alloc_fn_name, free_fn_name):
        lib = ctypes.CDLL(path_to_so_file)
        alloc_fn = ctypes.cast(getattr(lib, alloc_fn_name), ctypes.c_void_p).value
        free_fn = ctypes.cast(getattr(lib, free_fn_name), ctypes.c_void_p).value
        self.path, self.handle = path_to_so_file, lib._handle
        self._allocator = torch._C._cuda_customAllocator(alloc_fn, free_fn)
        torch.log.append(f"CUDAPluggableAllocator({alloc_fn_name},{free_fn_name})")


def change_current_allocator(allocator):
    global _current
    if torch.cuda.is_initialized():
        raise RuntimeError("Can't swap an already initialized allocator")
    _current = allocator
    torch.log.append("change_current_allocator")
