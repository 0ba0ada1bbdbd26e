# SPDX-License-Identifier: Apache-2.0
"""Statistics, empty_cache, the memory fraction, and out-of-memory with
recovery, with cudapool installed."""

import collections
import gc

import pytest

import gpu_common

torch = gpu_common.require_cuda()
import cudapool  # noqa: E402
from cudapool import _torch  # noqa: E402

MiB, GiB = gpu_common.MiB, gpu_common.GiB


@pytest.fixture(autouse=True)
def installed():
    gpu_common.require_installed()
    yield
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()


def test_stats_follow_allocations():
    torch.cuda.synchronize()
    before = cudapool.memory_stats()
    n = 3 * MiB + 400  # bytes
    t = torch.empty(n, dtype=torch.uint8, device="cuda")
    after = torch.cuda.memory_stats()  # routed to cudapool
    assert isinstance(after, collections.OrderedDict) and len(after) == 122
    assert list(after) == sorted(after)
    assert after["allocated_bytes.all.current"] - before["allocated_bytes.all.current"] == 3 * MiB + 512
    assert after["requested_bytes.all.current"] - before["requested_bytes.all.current"] == n
    assert after["allocation.large_pool.current"] - before["allocation.large_pool.current"] == 1
    assert torch.cuda.memory_allocated() == cudapool.memory_allocated() == after["allocated_bytes.all.current"]
    assert torch.cuda.memory_reserved() >= torch.cuda.memory_allocated()
    small = torch.empty(100, device="cuda")
    assert cudapool.memory_stats()["allocation.small_pool.current"] == after["allocation.small_pool.current"] + 1
    del t, small
    assert cudapool.memory_allocated() == before["allocated_bytes.all.current"]
    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.max_memory_allocated() == cudapool.memory_allocated()


def test_memory_summary_is_torchs_table():
    torch.empty(5 * MiB, dtype=torch.uint8, device="cuda")
    ours = cudapool.memory_summary()
    assert torch.cuda.memory_summary() == ours
    # PyTorch's own formatter, fed cudapool's stats, prints the same table:
    # with the C++ class torch.cuda's functions are PyTorch's own (nothing is
    # patched); on the pluggable path the patched-over original.
    if cudapool.mode() == "class":
        assert _torch.original("torch.cuda.memory", "memory_summary") is None, "nothing patched"
        theirs = torch.cuda.memory.memory_summary
    else:
        theirs = _torch.original("torch.cuda.memory", "memory_summary")
    assert theirs is not None
    assert theirs() == ours
    assert theirs(abbreviated=True) == cudapool.memory_summary(abbreviated=True)


def test_empty_cache_gives_memory_back():
    # The driver's free memory is the whole device's: another process
    # allocating on the same GPU meanwhile hides the rise, so a round whose
    # rise falls short is tried again (at most three rounds); cudapool's own
    # reserved bytes must drop every round.
    rises = []
    for _ in range(3):
        x = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
        del x
        torch.cuda.synchronize()
        reserved = cudapool.memory_reserved()
        assert reserved >= 512 * MiB
        free_before = torch.cuda.mem_get_info()[0]
        torch.cuda.empty_cache()
        rises.append(torch.cuda.mem_get_info()[0] - free_before)
        assert cudapool.memory_reserved() <= reserved - 512 * MiB
        if rises[-1] >= 500 * MiB:
            break
    assert rises[-1] >= 500 * MiB, f"the driver's free memory rose by {rises} bytes per round"


def test_memory_fraction_limits_allocation():
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(0.05)
    with pytest.raises(RuntimeError, match="out of memory"):
        torch.empty(int(total * 0.10), dtype=torch.uint8, device="cuda")
    ok = torch.empty(int(total * 0.02), dtype=torch.uint8, device="cuda")
    assert ok.numel() == int(total * 0.02)
    del ok
    torch.cuda.set_per_process_memory_fraction(1.0)
    big = torch.empty(int(total * 0.10), dtype=torch.uint8, device="cuda")
    del big


def test_out_of_memory_then_recovery():
    torch.cuda.empty_cache()
    ooms = cudapool.memory_stats()["num_ooms"]
    chunks = []
    with pytest.raises(RuntimeError, match="CUDA out of memory") as info:
        for _ in range(10_000):
            chunks.append(torch.empty(2 * GiB, dtype=torch.uint8, device="cuda"))
    assert "Tried to allocate" in str(info.value)
    n = len(chunks)
    assert n >= 1
    assert cudapool.memory_stats()["num_ooms"] == ooms + 1
    del chunks, info
    gc.collect()
    again = [torch.empty(2 * GiB, dtype=torch.uint8, device="cuda") for _ in range(n)]
    again[-1].fill_(1)
    torch.cuda.synchronize()
    assert int(again[-1][-1]) == 1
    del again


def test_oom_is_torch_out_of_memory_error():
    """Users catch torch.OutOfMemoryError: capi/torch.cpp throws PyTorch's
    own c10::OutOfMemoryError, with the native message."""
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(0.01)
    with pytest.raises(torch.OutOfMemoryError) as info:
        torch.empty(int(total * 0.05), dtype=torch.uint8, device="cuda")
    assert str(info.value).startswith("CUDA out of memory. Tried to allocate")
