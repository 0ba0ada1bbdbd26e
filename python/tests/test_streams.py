# SPDX-License-Identifier: Apache-2.0
"""record_stream: a block used by another stream is not reused before that
stream's work (queued when it was freed) completes."""

import pytest

import cudapool
from cudapool import _lib

S1, S2, S3 = 0x1001, 0x1002, 0x1003


def block_state(p):
    for seg in cudapool.snapshot()["segments"]:
        for b in seg["blocks"]:
            if b["address"] == p:
                return b["state"]
    return None


def test_block_waits_for_the_recorded_stream(allocs):
    p = allocs.malloc(4096, stream=S1)
    _lib.record_stream(p, S2)
    _lib.sim_submit(S2)  # S2 has queued work that reads p
    allocs.free(p)
    assert block_state(p) == "active_awaiting_free"
    s = cudapool.memory_stats()
    assert s["allocated_bytes.all.current"] == 0
    assert s["active_bytes.all.current"] == 4096

    q = allocs.malloc(4096, stream=S1)
    assert q != p, "reused while S2 may still read it"
    assert block_state(p) == "active_awaiting_free"

    _lib.sim_complete_all()
    r = allocs.malloc(4096, stream=S1)  # processes the completed events
    assert r == p
    assert cudapool.memory_stats()["active_bytes.all.current"] == 2 * 4096


def test_every_recorded_stream_must_finish(allocs):
    p = allocs.malloc(4096, stream=S1)
    _lib.record_stream(p, S2)
    _lib.record_stream(p, S3)
    _lib.sim_submit(S2)
    allocs.free(p)
    _lib.sim_submit(S3)  # work queued after the free does not count
    allocs.malloc(512, stream=S1)  # triggers event processing
    assert block_state(p) == "active_awaiting_free"
    _lib.sim_complete_all()
    allocs.malloc(512, stream=S1)
    assert block_state(p) != "active_awaiting_free"


def test_allocating_stream_is_ignored(allocs):
    p = allocs.malloc(4096, stream=S1)
    _lib.record_stream(p, S1)
    _lib.sim_submit(S1)
    allocs.free(p)
    assert block_state(p) == "inactive"
    assert allocs.malloc(4096, stream=S1) == p


def test_empty_cache_waits_for_pending_frees(allocs):
    p = allocs.malloc(4096, stream=S1)
    _lib.record_stream(p, S2)
    _lib.sim_submit(S2)
    allocs.free(p)
    before = cudapool.memory_stats()["num_sync_all_streams"]
    cudapool.empty_cache()
    s = cudapool.memory_stats()
    assert s["num_sync_all_streams"] == before + 1
    assert s["reserved_bytes.all.current"] == 0
    assert s["active_bytes.all.current"] == 0


def test_record_stream_of_unknown_pointer():
    with pytest.raises(cudapool.CudapoolError, match="not allocated by cudapool"):
        _lib.record_stream(0xABC000, S2)
    with pytest.raises(cudapool.CudapoolError, match="NULL"):
        _lib.record_stream(0, S2)
