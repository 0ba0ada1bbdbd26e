# SPDX-License-Identifier: Apache-2.0
"""malloc/free through the thin ctypes binding, on the simulator."""

import random
import threading

import pytest

import cudapool
from cudapool import _lib

MiB = 1 << 20


def test_malloc_free_roundtrip(allocs):
    p = allocs.malloc(1000)
    assert p != 0 and p % 512 == 0
    assert cudapool.memory_allocated() == 1024  # rounded up to 512 B
    allocs.free(p)
    assert cudapool.memory_allocated() == 0


def test_size_zero_is_null_without_error():
    assert _lib.malloc(0) == 0
    assert cudapool.memory_stats()["allocation.all.allocated"] == 0


def test_live_allocations_never_overlap(allocs):
    rng = random.Random(1)
    sizes = [rng.choice([1, 511, 512, 4000, 65536, MiB, MiB + 1, 3 * MiB, 11 * MiB]) for _ in range(200)]
    ranges = sorted((allocs.malloc(s), s) for s in sizes)
    for (p, s), (q, _) in zip(ranges, ranges[1:]):
        assert p + s <= q, f"{p:#x}+{s} overlaps {q:#x}"


def test_freed_block_is_reused_on_its_stream(allocs):
    p = allocs.malloc(4096, stream=0x11)
    allocs.free(p)
    before = cudapool.memory_stats()
    q = allocs.malloc(4096, stream=0x11)
    after = cudapool.memory_stats()
    assert q == p
    assert after["num_device_alloc"] == before["num_device_alloc"]
    # another stream does not get it
    r = allocs.malloc(4096, stream=0x12)
    assert r != p


def test_base_allocation_finds_the_segment(ordinary, allocs):
    p = allocs.malloc(1000)
    q = allocs.malloc(3000)
    base, size = _lib.base_allocation(q)
    assert size == 2 * MiB  # a small-pool segment
    assert base <= p < q < base + size
    assert _lib.base_allocation(q + 100) == (base, size)
    big = allocs.malloc(12 * MiB)
    assert _lib.base_allocation(big) == (big, 12 * MiB)


def test_devices_are_separate(allocs):
    p = allocs.malloc(MiB, device=1)
    assert cudapool.memory_allocated(1) == MiB
    assert cudapool.memory_allocated(0) == 0
    q = allocs.malloc(MiB, device=0)
    assert _lib.base_allocation(p) != _lib.base_allocation(q)
    with pytest.raises(cudapool.CudapoolError, match="device 0, not device 1"):
        _lib.free(q, MiB, 1)


def test_init_checks_the_device_count():
    _lib.init(-1)
    _lib.init(2)
    with pytest.raises(cudapool.CudapoolError, match="counts 5 devices"):
        _lib._checked("cudapool_init", 5)


def test_threads_allocate_and_free_concurrently():
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        live = []
        try:
            for _ in range(300):
                if live and rng.random() < 0.5:
                    p, s, st = live.pop(rng.randrange(len(live)))
                    _lib.free(p, s, 0, st)
                else:
                    s = rng.choice([512, 4000, 100_000, MiB, 2 * MiB + 7, 12 * MiB])
                    st = rng.choice([0, 0x100 + seed])
                    live.append((_lib.malloc(s, 0, st), s, st))
            # every live pointer is distinct within this thread
            assert len({p for p, _, _ in live}) == len(live)
        except Exception as e:  # reported below
            errors.append(e)
        finally:
            for p, s, st in live:
                _lib.free(p, s, 0, st)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    stats = cudapool.memory_stats()
    assert stats["allocated_bytes.all.current"] == 0
    assert stats["allocation.all.allocated"] == stats["allocation.all.freed"] > 0
