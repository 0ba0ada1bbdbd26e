# SPDX-License-Identifier: Apache-2.0
"""Tags, pause and resume from Python (cudapool.region, pause, resume,
paused, paused_bytes, release_host_memory) on the simulator; CuPy through
the stand-in (fake_cupy.py), whose allocations and captures reach the same
C entry points on the same thread. The contents a pause keeps are checked
by the Go tests (allocator/pause_test.go), which can read simulated memory."""

import gc
import threading

import pytest

import cudapool
import cudapool.cupy as cpc
from cudapool import _lib

import fake_cupy

MiB = 1 << 20


def tag_of(ptr):
    for seg in cudapool.snapshot()["segments"]:
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return seg.get("tag"), seg.get("paused", False)
    raise AssertionError(f"{ptr:#x} is in no segment")


def test_region_routes_and_nests(allocs):
    plain = allocs.malloc(4 * MiB)
    with cudapool.region("outer"):
        o = allocs.malloc(4 * MiB)
        with cudapool.region("inner"):
            i = allocs.malloc(4 * MiB, device=1)
        o2 = allocs.malloc(4000)
    after = allocs.malloc(4 * MiB)
    assert tag_of(plain) == (None, False) and tag_of(after) == (None, False)
    assert tag_of(o)[0] == tag_of(o2)[0] == "outer"
    assert tag_of(i)[0] == "inner"


def test_region_pops_on_error_and_as_decorator(allocs):
    with pytest.raises(ZeroDivisionError):
        with cudapool.region("boom"):
            1 / 0
    assert tag_of(allocs.malloc(4 * MiB))[0] is None, "the region's tag was popped"

    @cudapool.region("deco")
    def make():
        return allocs.malloc(4 * MiB)

    assert tag_of(make())[0] == "deco"
    assert tag_of(allocs.malloc(4 * MiB))[0] is None


def test_region_is_per_thread(allocs):
    seen = {}

    def other():
        seen["p"] = allocs.malloc(4 * MiB)

    with cudapool.region("mine"):
        t = threading.Thread(target=other)
        t.start()
        t.join()
        mine = allocs.malloc(4 * MiB)
    assert tag_of(seen["p"])[0] is None
    assert tag_of(mine)[0] == "mine"


def test_bad_tags():
    with pytest.raises(TypeError):
        with cudapool.region(3):
            pass
    with pytest.raises(ValueError):
        with cudapool.region("a\0b"):
            pass
    with pytest.raises(cudapool.CudapoolError, match="the tag is empty"):
        with cudapool.region(""):
            pass
    with pytest.raises(cudapool.CudapoolError, match="no tag is named 'nope'|no tag is named \"nope\""):
        cudapool.pause("nope")
    with pytest.raises(cudapool.CudapoolError, match="cudapool_tag_pop: no tag is pushed"):
        _lib.tag_pop()


def test_pause_resume(allocs):
    with cudapool.region("kv"):
        a = allocs.malloc(64 * MiB)
        b = allocs.malloc(32 * MiB, device=1)
    res0 = cudapool.memory_reserved(0)
    alloc0 = cudapool.memory_allocated(0)
    cudapool.pause("kv", keep=True)
    try:
        assert cudapool.paused_bytes(0) == res0 and cudapool.paused_bytes("cuda:1") > 0
        assert cudapool.memory_reserved(0) == 0, "reserved drops by what was given back"
        assert cudapool.memory_allocated(0) == alloc0, "allocated stays"
        assert cudapool.paused() == {"kv": cudapool.paused_bytes(0) + cudapool.paused_bytes(1)}
        assert tag_of(a) == ("kv", True)
        with pytest.raises(cudapool.CudapoolError, match='tag "kv" is paused'):
            with cudapool.region("kv"):
                allocs.malloc(4096)
        allocs.free(b)  # freeing a paused tensor is allowed
        cudapool.pause("kv")  # a second pause does nothing
    finally:
        cudapool.resume("kv")
    assert cudapool.paused() == {} and cudapool.paused_bytes(0) == 0
    assert cudapool.memory_reserved(0) == res0
    assert tag_of(a) == ("kv", False)
    cudapool.resume("kv")  # not paused: nothing to do
    cudapool.pause(keep=False)  # every tag
    assert "kv" in cudapool.paused()
    cudapool.resume()
    cudapool.release_host_memory()
    with pytest.raises(cudapool.InvalidDeviceError):
        cudapool.paused_bytes(5)


@pytest.fixture
def cupy(monkeypatch):
    monkeypatch.setenv("CUDAPOOL_CUPY_DIRECT", "0")
    cp = fake_cupy.installed_into(monkeypatch)
    yield cp
    cpc.uninstall()
    gc.collect()
    _lib.sim_complete_all()


def test_cupy_region_and_capture(cupy):
    """CuPy allocates through cudapool_cupy_malloc on the calling thread:
    inside a region its arrays are the tag's, and so is the private pool of
    a graph it captures there, paused with the tag."""
    assert cpc.install() == "c"
    with cudapool.region("cupy"):
        m = cupy.alloc(8 * MiB)
        s = cupy.cuda.Stream(0x7700)
        with s:
            s.begin_capture()
            g_mem = cupy.alloc(16 * MiB)
            graph = s.end_capture()
    plain = cupy.alloc(8 * MiB)
    assert tag_of(m.ptr)[0] == "cupy"
    assert tag_of(g_mem.ptr)[0] == "cupy"
    assert tuple(next(seg for seg in cudapool.snapshot()["segments"]
                      if seg["address"] <= g_mem.ptr < seg["address"] + seg["total_size"])["segment_pool_id"]) != (0, 0)
    assert tag_of(plain.ptr)[0] is None
    cudapool.pause("cupy")
    assert tag_of(g_mem.ptr) == ("cupy", True) and tag_of(m.ptr) == ("cupy", True)
    assert tag_of(plain.ptr) == (None, False)
    cudapool.resume("cupy")
    del m, g_mem, plain, graph
