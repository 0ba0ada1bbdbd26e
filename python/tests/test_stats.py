# SPDX-License-Identifier: Apache-2.0
"""memory_stats() and friends: PyTorch's 122 keys, values that follow the
allocations made."""

import collections
import json

import pytest

import cudapool
from cudapool import _lib

import helpers

MiB = 1 << 20

KINDS = ["allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
         "active_bytes", "inactive_split_bytes", "requested_bytes"]
METRICS = ["current", "peak", "allocated", "freed"]
EXPECTED_KEYS = sorted(
    [f"{k}.{p}.{m}" for k in KINDS for p in ("all", "large_pool", "small_pool") for m in METRICS]
    + [f"{k}.{m}" for k in ("oversize_allocations", "oversize_segments") for m in METRICS]
    + ["num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free",
       "max_split_size"]
)


def test_keys_are_pytorchs_122_sorted():
    stats = cudapool.memory_stats()
    assert isinstance(stats, collections.OrderedDict)
    assert len(EXPECTED_KEYS) == 122
    assert list(stats) == EXPECTED_KEYS
    assert all(type(v) is int for v in stats.values())
    assert stats["max_split_size"] == -1


# (requested, rounded); small pool up to 1 MiB
SMALL = [(100, 512), (512, 512), (513, 1024), (4000, 4096), (MiB, MiB)]
LARGE = [(MiB + 1, MiB + 512), (5 * MiB, 5 * MiB), (16 * MiB, 16 * MiB)]


def test_values_follow_allocations(ordinary, allocs):
    ptrs = [allocs.malloc(r) for r, _ in SMALL + LARGE]
    s = cudapool.memory_stats()
    small = sum(x for _, x in SMALL)
    large = sum(x for _, x in LARGE)
    assert s["allocated_bytes.small_pool.current"] == small
    assert s["allocated_bytes.large_pool.current"] == large
    assert s["allocated_bytes.all.current"] == small + large
    assert s["requested_bytes.all.current"] == sum(r for r, _ in SMALL + LARGE)
    assert s["active_bytes.all.current"] == small + large
    assert s["allocation.all.current"] == s["active.all.current"] == len(ptrs)
    assert s["allocation.small_pool.current"] == len(SMALL)
    # one 2 MiB small segment; a 20 MiB segment shared by the two mid-size
    # requests; the 16 MiB request does not fit in what is left of it and
    # gets a segment of its own
    assert s["reserved_bytes.small_pool.current"] == 2 * MiB
    assert s["reserved_bytes.large_pool.current"] == 36 * MiB
    assert s["segment.all.current"] == s["num_device_alloc"] == 3
    # the unused tails of split segments are inactive splits
    assert s["inactive_split_bytes.all.current"] == 2 * MiB - small + 20 * MiB - (MiB + 512) - 5 * MiB
    assert cudapool.memory_allocated() == small + large
    assert cudapool.memory_reserved() == 38 * MiB

    allocs.free_all()
    s = cudapool.memory_stats()
    assert s["allocated_bytes.all.current"] == 0
    assert s["allocated_bytes.all.freed"] == small + large
    assert s["allocated_bytes.all.peak"] == small + large
    assert s["inactive_split_bytes.all.current"] == 0  # freed blocks merged back
    assert s["reserved_bytes.all.current"] == 38 * MiB  # cached

    cudapool.empty_cache()
    s = cudapool.memory_stats()
    assert s["reserved_bytes.all.current"] == 0
    assert s["num_device_free"] == s["segment.all.freed"] == 3


def test_values_follow_allocations_with_stitching(stitching, allocs):
    """Expandable segments with stitching (the default, named): the same
    allocation statistics; memory is mapped, not allocated in segments."""
    ptrs = [allocs.malloc(r) for r, _ in SMALL + LARGE]
    s = cudapool.memory_stats()
    small = sum(x for _, x in SMALL)
    large = sum(x for _, x in LARGE)
    assert s["allocated_bytes.all.current"] == s["active_bytes.all.current"] == small + large
    assert s["requested_bytes.all.current"] == sum(r for r, _ in SMALL + LARGE)
    assert s["allocation.all.current"] == len(ptrs)
    # one mapped page for the small pool; the large pool's range maps 20 MiB
    # for the first two requests, 20 more when the 16 MiB one does not fit
    assert s["reserved_bytes.small_pool.current"] == 2 * MiB
    assert s["reserved_bytes.large_pool.current"] == 40 * MiB
    assert s["segment.all.current"] == 0  # expandable ranges are not segments (as in PyTorch)
    assert s["num_device_alloc"] == 3  # three mappings
    assert s["inactive_split_bytes.all.current"] == 0  # not counted in expandable segments (as in PyTorch)
    allocs.free_all()
    s = cudapool.memory_stats()
    assert s["allocated_bytes.all.current"] == 0
    assert s["reserved_bytes.all.current"] == 42 * MiB  # cached


# Ordinary segments: the small request gets a 2 MiB segment of its own. By
# default stitching gives it one of the free 30 MiB block's idle pages
# instead: the small and large pools share physical pages.
@pytest.mark.parametrize("conf,peak", [("expandable_segments:False", 32 * MiB), ("", 30 * MiB),
                                       ("expandable_segments:True", 30 * MiB)])
def test_peaks_and_their_reset(allocs, conf, peak):
    cudapool.configure(conf)
    p = allocs.malloc(30 * MiB)
    allocs.free(p)
    allocs.malloc(MiB)
    assert cudapool.max_memory_allocated() == 30 * MiB
    assert cudapool.max_memory_reserved() == peak
    cudapool.reset_peak_memory_stats()
    assert cudapool.max_memory_allocated() == MiB
    assert cudapool.max_memory_reserved() == cudapool.memory_reserved()


def test_reset_accumulated(allocs):
    allocs.free(allocs.malloc(4096))
    s = cudapool.memory_stats()
    assert s["allocation.all.allocated"] == s["allocation.all.freed"] == 1
    cudapool.reset_accumulated_memory_stats()
    s = cudapool.memory_stats()
    assert s["allocation.all.allocated"] == s["allocation.all.freed"] == 0
    assert s["num_device_alloc"] == 0
    assert s["reserved_bytes.all.current"] == 2 * MiB  # current values stay


def test_max_split_size_follows_configuration():
    cudapool.configure("max_split_size_mb:64")
    assert cudapool.memory_stats()["max_split_size"] == 64 * MiB


def test_nested_dict_matches_flat(allocs):
    allocs.malloc(4096)
    nested = cudapool.memory_stats_as_nested_dict()
    flat = cudapool.memory_stats()
    assert nested["allocated_bytes"]["all"]["current"] == flat["allocated_bytes.all.current"] == 4096
    assert nested["num_ooms"] == flat["num_ooms"]
    assert nested["oversize_allocations"]["peak"] == flat["oversize_allocations.peak"]


class FakeDevice:
    """Quacks like torch.device."""

    def __init__(self, type, index=None):
        self.type, self.index = type, index


def test_device_arguments(allocs):
    allocs.malloc(MiB, device=1)
    for dev in (1, "cuda:1", FakeDevice("cuda", 1)):
        assert cudapool.memory_allocated(dev) == MiB, dev
    for dev in (None, 0, "cuda", FakeDevice("cuda")):
        assert cudapool.memory_allocated(dev) == 0, dev
    with pytest.raises(ValueError, match="CUDA device"):
        cudapool.memory_allocated(FakeDevice("cpu"))
    with pytest.raises(ValueError):
        cudapool.memory_allocated("cpu")
    with pytest.raises(TypeError):
        cudapool.memory_allocated(True)
    with pytest.raises(TypeError):
        cudapool.memory_allocated(1.0)


def test_stats_of_each_device_are_separate(allocs):
    allocs.malloc(3 * MiB, device=1)
    assert cudapool.memory_stats(1)["allocation.all.current"] == 1
    assert cudapool.memory_stats(0)["allocation.all.current"] == 0
    assert _lib.memory_stats(1)["reserved_bytes.all.current"] == 20 * MiB



def test_front_counters_count_hits():
    """A free then a malloc of the same size and stream is served by the front
    cache and counted (in a fresh process: the front serves only once
    captures are announced, which is for good); bad devices raise."""
    out = helpers.run_code("""
        import ctypes, json
        import cudapool
        from cudapool import _lib
        ctypes.CDLL(cudapool.library_path()).cudapool_expect_announced_captures()
        before = cudapool.front_counters(0)
        p = _lib.malloc(8192)
        _lib.free(p, 8192)
        q = _lib.malloc(8192)
        after = cudapool.front_counters(0)
        _lib.free(q, 8192)
        try:
            _lib.front_counters(16)
            bad = "no error"
        except cudapool.CudapoolError as e:
            bad = str(e)
        print(json.dumps([sorted(before), p == q, after["hits"] - before["hits"], after["pool_hits"], bad]))
    """)
    assert out.returncode == 0, out.stderr
    keys, same, hits, pool_hits, bad = json.loads(out.stdout.splitlines()[-1])
    assert keys == ["cold_skipped", "cold_verdicts", "hits", "pool_hits"]
    assert same and hits == 1 and pool_hits == 0
    assert "devices 0-15" in bad
