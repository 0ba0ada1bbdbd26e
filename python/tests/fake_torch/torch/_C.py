# SPDX-License-Identifier: Apache-2.0
import torch


class _CUDAPluggableAllocator:
    """torch._C._CUDAPluggableAllocator: the eight hook setters."""

    SETTERS = ("set_init_fn", "set_reset_fn", "set_memory_fraction_fn", "set_base_alloc_fn",
               "set_record_stream_fn", "set_begin_allocate_to_pool", "set_end_allocate_to_pool_fn",
               "set_release_pool")

    def __init__(self, alloc_fn, free_fn):
        self.alloc_fn, self.free_fn, self.hooks = alloc_fn, free_fn, {}

    def __getattr__(self, name):
        if name not in self.SETTERS:
            raise AttributeError(name)

        def setter(addr):
            if not isinstance(addr, int) or addr == 0:
                raise TypeError(f"{name}: expected a function address, got {addr!r}")
            self.hooks[name] = addr
            torch.log.append(name)

        return setter


def _cuda_customAllocator(alloc_fn, free_fn):
    return _CUDAPluggableAllocator(alloc_fn, free_fn)
