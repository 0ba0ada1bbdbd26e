# SPDX-License-Identifier: Apache-2.0
"""Per-pool mode, in a process WITHOUT install(): PyTorch's own caching
allocator takes one MemPool's segments from cudapool.
(run_gpu_tests.sh runs this module with CUDAPOOL_GPU_NO_INSTALL=1.)"""

import gc

import pytest

import gpu_common

torch = gpu_common.require_cuda()
import cudapool  # noqa: E402
from cudapool import _lib  # noqa: E402

MiB = gpu_common.MiB

if cudapool.installed():
    pytest.skip("needs a process without cudapool.install() (CUDAPOOL_GPU_NO_INSTALL=1)", allow_module_level=True)


def test_mem_pool_takes_its_segments_from_cudapool():
    base = cudapool.memory_allocated(0)
    pool = torch.cuda.MemPool(allocator=cudapool.allocator().allocator())
    with torch.cuda.use_mem_pool(pool):
        x = torch.randn(1 << 20, device="cuda")  # 4 MiB: a 20 MiB segment from cudapool
    in_pool = cudapool.memory_allocated(0)
    assert in_pool - base >= 4 * MiB
    _lib.base_allocation(x.data_ptr())  # x lies in a cudapool segment (raises otherwise)
    # the native allocator is still PyTorch's, so its own statistics work
    assert torch.cuda.memory_stats()["allocated_bytes.all.current"] >= 4 * MiB

    y = torch.randn(1 << 20, device="cuda")  # outside the pool: PyTorch's cudaMalloc
    assert cudapool.memory_allocated(0) == in_pool
    with pytest.raises(cudapool.CudapoolError):
        _lib.base_allocation(y.data_ptr())
    torch.testing.assert_close((x + y).cpu(), x.cpu() + y.cpu())

    del x
    del pool
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert cudapool.memory_allocated(0) == base, "the pool's segments went back to cudapool"
