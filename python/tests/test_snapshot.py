# SPDX-License-Identifier: Apache-2.0
"""snapshot(): torch.cuda.memory._snapshot()'s dict."""

import pickle

import cudapool

MiB = 1 << 20
SEGMENT_KEYS = {"device", "address", "total_size", "allocated_size", "active_size", "requested_size", "stream",
                "segment_type", "segment_pool_id", "is_expandable", "frames", "blocks"}
BLOCK_KEYS = {"address", "size", "requested_size", "state", "frames", "allocated", "active"}
TRACE_KEYS = {"action", "addr", "size", "stream", "time_us", "frames", "device", "pool_id", "compile_context", "user_metadata"}


def test_shape_and_consistency(allocs):
    p = allocs.malloc(1000, stream=0x33)
    q = allocs.malloc(3 * MiB, device=1)
    snap = cudapool.snapshot()
    assert set(snap) == {"segments", "device_traces", "allocator_settings", "external_annotations"}
    assert len(snap["device_traces"]) == 2
    assert len(snap["segments"]) == 2
    for seg in snap["segments"]:
        assert set(seg) == SEGMENT_KEYS
        assert seg["segment_pool_id"] == (0, 0)
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
        assert seg["allocated_size"] == sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated")
        addr = seg["address"]
        for b in seg["blocks"]:  # blocks tile the segment in address order
            assert set(b) == BLOCK_KEYS
            assert b["address"] == addr
            addr += b["size"]
    small = next(s for s in snap["segments"] if s["device"] == 0)
    assert (small["segment_type"], small["total_size"], small["stream"]) == ("small", 2 * MiB, 0x33)
    first = small["blocks"][0]
    assert (first["address"], first["size"], first["requested_size"], first["state"]) == (p, 1024, 1000, "active_allocated")
    assert small["blocks"][1]["state"] == "inactive"
    large = next(s for s in snap["segments"] if s["device"] == 1)
    assert (large["segment_type"], large["total_size"]) == ("large", 20 * MiB)
    assert large["blocks"][0]["address"] == q
    pickle.loads(pickle.dumps(snap))  # what _dump_snapshot writes


def test_no_traces_without_history(allocs):
    allocs.free(allocs.malloc(4096))
    assert cudapool.snapshot()["device_traces"] == [[], []]


def test_history(ordinary, allocs):
    cudapool.record_memory_history(100)
    p = allocs.malloc(5 * MiB, device=1)
    allocs.free(p)
    cudapool.empty_cache()
    snap = cudapool.snapshot()
    assert snap["device_traces"][0] == []
    trace = snap["device_traces"][1]
    assert all(set(e) == TRACE_KEYS for e in trace)
    assert [e["action"] for e in trace] == ["segment_alloc", "alloc", "free_requested", "free_completed",
                                            "segment_free"]
    assert [(e["addr"], e["size"]) for e in trace[1:4]] == [(p, 5 * MiB)] * 3
    assert trace[0]["size"] == trace[-1]["size"] == 20 * MiB
    times = [e["time_us"] for e in trace]
    assert times == sorted(times)
    assert snap["allocator_settings"]["record_history"] == 100

    cudapool.record_memory_history(0)
    allocs.free(allocs.malloc(4096))
    assert cudapool.snapshot()["device_traces"] == [[], []]


def test_history_ring_keeps_the_newest(allocs):
    cudapool.record_memory_history(3)
    for size in (4096, 8192, 512, 1024, 2048):
        allocs.free(allocs.malloc(size))
    trace = cudapool.snapshot()["device_traces"][0]
    assert [(e["action"], e["size"]) for e in trace] == [
        ("alloc", 2048), ("free_requested", 2048), ("free_completed", 2048)]


def test_history_keeps_other_settings():
    cudapool.configure("max_split_size_mb:64,garbage_collection_threshold:0.5")
    cudapool.record_memory_history(10)
    cudapool.record_memory_history(20)
    settings = cudapool.snapshot()["allocator_settings"]
    assert settings["max_split_size"] == 64 * MiB
    assert settings["garbage_collection_threshold"] == 0.5
    assert settings["record_history"] == 20
    assert settings["PYTORCH_CUDA_ALLOC_CONF"].count("record_history") == 1


def test_memory_snapshot_filters_by_pool(allocs):
    allocs.malloc(4096)
    assert len(cudapool.memory_snapshot()) == 1
    assert len(cudapool.memory_snapshot((0, 0))) == 1
    assert cudapool.memory_snapshot((1, 0)) == []


def test_expandable_segments(allocs):
    """With expandable_segments:True the snapshot shows each mapped run of a
    reserved range as one expandable segment, as PyTorch does."""
    cudapool.configure("expandable_segments:True,expandable_map_unit_mb:2")  # page by page
    p = allocs.malloc(3 * MiB)
    q = allocs.malloc(3 * MiB)
    assert q == p + 3 * MiB  # one block continues the other across a 2 MiB page
    snap = cudapool.snapshot()
    assert snap["allocator_settings"]["expandable_segments"] is True
    (seg,) = snap["segments"]
    assert set(seg) == SEGMENT_KEYS
    assert seg["is_expandable"] is True
    assert (seg["address"], seg["total_size"], seg["allocated_size"]) == (p, 6 * MiB, 6 * MiB)
    assert cudapool.memory_reserved(0) == 6 * MiB
    allocs.free(p)
    allocs.free(q)
    cudapool.empty_cache()
    assert cudapool.snapshot()["segments"] == []
    assert cudapool.memory_reserved(0) == 0
