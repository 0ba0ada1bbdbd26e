# SPDX-License-Identifier: Apache-2.0
"""Failures raise CudapoolError with the library's message."""

import threading

import pytest

import cudapool
from cudapool import _lib

MiB = 1 << 20
GiB = 1 << 30


def test_bad_device():
    with pytest.raises(cudapool.CudapoolError, match=r"device 5 does not exist \(2 devices\)"):
        _lib.malloc(4096, 5)
    with pytest.raises(cudapool.CudapoolError, match="device 7 does not exist"):
        cudapool.memory_stats(7)
    with pytest.raises(cudapool.CudapoolError, match="device 9 does not exist"):
        cudapool.reset_peak_memory_stats(9)
    with pytest.raises(cudapool.CudapoolError, match="device 3 does not exist"):
        cudapool.set_per_process_memory_fraction(0.5, 3)


def test_unknown_pointer_free():
    bogus = 0x7F0000001000
    with pytest.raises(cudapool.CudapoolError, match=f"{bogus:#x} was not allocated by cudapool"):
        _lib.free(bogus, 4096, 0)


def test_double_free(allocs):
    p = allocs.malloc(4096)
    allocs.free(p)
    with pytest.raises(cudapool.CudapoolError, match="already freed"):
        _lib.free(p, 4096, 0)


def test_interior_pointer_free(allocs):
    p = allocs.malloc(4096)
    with pytest.raises(cudapool.CudapoolError, match="inside the block"):
        _lib.free(p + 512, 0, 0)
    assert cudapool.memory_allocated() == 4096  # nothing was freed


def test_wrong_size_frees_nothing(allocs):
    p = allocs.malloc(4096)
    with pytest.raises(cudapool.CudapoolError, match="allocated with 4096 bytes, freed with 100"):
        _lib.free(p, 100, 0)
    assert cudapool.memory_allocated() == 4096


def test_a_success_after_a_failure_does_not_raise(allocs):
    """last_error is sticky: success must not be mistaken for failure."""
    with pytest.raises(cudapool.CudapoolError):
        _lib.free(0x1234000, 1, 0)
    assert _lib.last_error() is not None
    p = allocs.malloc(4096)
    allocs.free(p)
    cudapool.empty_cache()
    cudapool.reset_peak_memory_stats()


def test_out_of_memory():
    with pytest.raises(cudapool.OutOfMemoryError) as info:
        _lib.malloc(9 * GiB)
    msg = str(info.value)
    assert isinstance(info.value, cudapool.CudapoolError)
    # cudapool_malloc is a C entry point: cudapool's words, not PyTorch's.
    assert msg.startswith("cudapool_malloc: out of memory on device 0: cannot allocate 9.00 GiB")
    assert "free of 8.00 GiB" in msg
    # The hint names the next step for the configuration in force: with
    # stitching (the default), where reserved memory may still be.
    assert "PYTORCH_CUDA_ALLOC_CONF" not in msg
    assert "With expandable segments and stitching (the default)" in msg
    assert "private pools (CUDA graphs, MemPools)" in msg and "max_split_size_mb" not in msg
    cudapool.configure("expandable_segments:True,stitch:False")
    with pytest.raises(cudapool.OutOfMemoryError, match=r"stitching \(cudapool's default: leave out stitch:False from CUDAPOOL_CONF\)"):
        _lib.malloc(9 * GiB)
    cudapool.configure("expandable_segments:False")
    with pytest.raises(cudapool.OutOfMemoryError,
                       match=r"cudapool's default configuration \(expandable segments with stitching: leave out "
                             r"expandable_segments:False from CUDAPOOL_CONF\) or max_split_size_mb:N"):
        _lib.malloc(9 * GiB)
    cudapool.configure("")
    assert cudapool.memory_stats()["num_ooms"] == 3


def test_memory_fraction_limits_and_validates(allocs):
    cudapool.set_per_process_memory_fraction(0.25)  # 2 GiB of 8
    p = allocs.malloc(GiB)
    with pytest.raises(cudapool.OutOfMemoryError, match="per_process_memory_fraction 0.25 allows cudapool 2.00 GiB"):
        _lib.malloc(GiB + 512 * MiB)
    allocs.free(p)
    cudapool.set_per_process_memory_fraction(1.0)
    allocs.malloc(3 * GiB)
    with pytest.raises(ValueError):
        cudapool.set_per_process_memory_fraction(1.5)
    with pytest.raises(TypeError):
        cudapool.set_per_process_memory_fraction(1)


def test_bad_configuration_is_refused_and_changes_nothing():
    cudapool.configure("max_split_size_mb:64")
    with pytest.raises(cudapool.CudapoolError, match="too small"):
        cudapool.configure("max_split_size_mb:1")
    with pytest.raises(cudapool.CudapoolError, match="expected key:value"):
        cudapool.configure("nonsense")
    assert cudapool.memory_stats()["max_split_size"] == 64 * MiB


def test_base_allocation_of_unknown_pointer():
    with pytest.raises(cudapool.CudapoolError, match="not in any cudapool segment"):
        _lib.base_allocation(0x5000)


def test_last_error_is_per_thread():
    with pytest.raises(cudapool.CudapoolError):
        _lib.malloc(1, 42)
    assert "device 42" in _lib.last_error()
    seen = {}

    def other():
        seen["before"] = _lib.last_error()
        try:
            _lib.malloc(1, 43)
        except cudapool.CudapoolError as e:
            seen["error"] = str(e)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen["before"] is None
    assert "device 43" in seen["error"]
    assert "device 42" in _lib.last_error()


def test_stats_of_invalid_device_in_summary():
    with pytest.raises(cudapool.CudapoolError, match="device 2 does not exist"):
        cudapool.memory_summary(2)
