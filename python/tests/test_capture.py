# SPDX-License-Identifier: Apache-2.0
"""CUDA graph capture on the simulator: allocations routed to a private pool
through begin_allocate_to_pool with a Python stream filter, and no call that
CUDA forbids during capture (the simulator counts them as violations)."""

import os
import subprocess
import sys
import textwrap

import pytest

import cudapool
from cudapool import _lib

MiB = 1 << 20
CAPTURE, OTHER = 0x2001, 0x2002
POOL = (1, 0)


def pools_of(*ptrs):
    """{ptr: segment_pool_id} for the segments holding ptrs."""
    out = {}
    for seg in cudapool.snapshot()["segments"]:
        for p in ptrs:
            if seg["address"] <= p < seg["address"] + seg["total_size"]:
                out[p] = seg["segment_pool_id"]
    return out


class Filter:
    """A stream filter in Python: accepts the capturing stream, and logs."""

    def __init__(self, stream):
        self.stream, self.seen = stream, []
        self.c = _lib.STREAM_FILTER(self._call)

    def _call(self, ctx, stream):
        self.seen.append(stream or 0)
        return 1 if stream == self.stream else 0


@pytest.fixture
def violations():
    before = _lib.sim_violations()
    assert before >= 0, "not running on the simulator"
    yield
    assert _lib.sim_violations() == before, "the allocator made a call CUDA forbids during capture"


def test_capture_routes_to_the_private_pool(allocs, violations):
    warm = allocs.malloc(4000, stream=CAPTURE)  # a cached block the capture must not take
    allocs.free(warm)
    f = Filter(CAPTURE)
    assert _lib.sim_begin_capture(CAPTURE, 0) == 0  # global mode, the strictest
    _lib.begin_allocate_to_pool(0, POOL, f.c)
    p = allocs.malloc(4000, stream=CAPTURE)  # needs a new segment: cuMemAlloc during capture
    big = allocs.malloc(30 * MiB, stream=CAPTURE)
    o = allocs.malloc(4000, stream=OTHER)  # not this capture's
    allocs.free(p)  # freed during capture: stays in the pool
    p2 = allocs.malloc(4000, stream=CAPTURE)
    with pytest.raises(cudapool.CudapoolError, match="capture is under way"):
        cudapool.empty_cache()
    _lib.end_allocate_to_pool(0, POOL)
    assert _lib.sim_end_capture(CAPTURE) == 0, _lib.last_error()

    assert CAPTURE in f.seen and OTHER in f.seen
    assert p2 == p and p != warm
    owners = pools_of(p, big, o, warm)
    assert owners[p] == owners[big] == POOL
    assert owners[o] == owners[warm] == (0, 0)

    after = allocs.malloc(4000, stream=CAPTURE)  # capture over: default pool
    assert pools_of(after)[after] == (0, 0)

    allocs.free(p2)
    allocs.free(big)
    cudapool.empty_cache()
    assert pools_of(p)[p] == POOL, "the pool's memory must stay while the graph lives"
    reserved = cudapool.memory_reserved()
    _lib.release_pool(0, POOL)
    cudapool.empty_cache()
    assert pools_of(p, big) == {}
    assert cudapool.memory_reserved() < reserved


def test_graphs_share_a_pool(allocs, violations):
    f = Filter(CAPTURE)
    _lib.sim_begin_capture(CAPTURE, 0)
    _lib.begin_allocate_to_pool(0, (2, 0), f.c)
    p = allocs.malloc(8192, stream=CAPTURE)
    allocs.free(p)
    _lib.end_allocate_to_pool(0, (2, 0))
    assert _lib.sim_end_capture(CAPTURE) == 0

    # a second graph captured into the first one's pool (pool=g1.pool())
    _lib.sim_begin_capture(CAPTURE, 1)
    _lib.begin_allocate_to_pool(0, (2, 0), f.c)
    q = allocs.malloc(8192, stream=CAPTURE)
    _lib.end_allocate_to_pool(0, (2, 0))
    assert _lib.sim_end_capture(CAPTURE) == 0
    assert q == p, "the shared pool's cached block is reused"
    allocs.free(q)

    _lib.release_pool(0, (2, 0))  # first graph dies: the second still holds it
    cudapool.empty_cache()
    assert pools_of(p)[p] == (2, 0)
    _lib.release_pool(0, (2, 0))
    cudapool.empty_cache()
    assert pools_of(p) == {}


def test_null_filter_takes_every_stream(allocs, violations):
    _lib.begin_allocate_to_pool(0, (3, 0))
    p = allocs.malloc(4096, stream=OTHER)
    _lib.end_allocate_to_pool(0, (3, 0))
    assert pools_of(p)[p] == (3, 0)
    allocs.free(p)
    _lib.release_pool(0, (3, 0))


def test_record_stream_free_during_capture_is_deferred(allocs, violations):
    x = allocs.malloc(4096, stream=OTHER)
    _lib.record_stream(x, 0x2003)
    _lib.sim_submit(0x2003)
    f = Filter(CAPTURE)
    _lib.sim_begin_capture(CAPTURE, 0)
    _lib.begin_allocate_to_pool(0, (4, 0), f.c)
    allocs.free(x)  # no event may be recorded for a later query now
    allocs.malloc(4096, stream=CAPTURE)
    _lib.end_allocate_to_pool(0, (4, 0))
    assert _lib.sim_end_capture(CAPTURE) == 0
    _lib.sim_complete_all()
    y = allocs.malloc(4096, stream=OTHER)
    assert y == x, "the deferred free completes once the capture is over"
    allocs.free_all()
    _lib.release_pool(0, (4, 0))


def test_pool_errors():
    with pytest.raises(cudapool.CudapoolError, match="default pool"):
        _lib.begin_allocate_to_pool(0, (0, 0))
    with pytest.raises(cudapool.CudapoolError, match="not recording"):
        _lib.end_allocate_to_pool(0, (77, 0))
    with pytest.raises(cudapool.CudapoolError):
        _lib.release_pool(0, (78, 0))
    with pytest.raises(cudapool.CudapoolError, match="device 4"):
        _lib.begin_allocate_to_pool(4, (5, 0))


def test_unannounced_capture_gets_its_own_pool(tmp_path):
    """Without begin_allocate_to_pool (a C program capturing by itself), the
    allocator asks the driver. Run in a fresh process: once any capture is
    announced, the allocator stops asking."""
    script = textwrap.dedent(f"""
        import cudapool
        from cudapool import _lib
        assert _lib.sim_begin_capture({CAPTURE}, 0) == 0
        p = _lib.malloc(4096, 0, {CAPTURE})
        q = _lib.malloc(4096, 0, {OTHER})
        _lib.free(p, 4096, 0, {CAPTURE})
        assert _lib.sim_end_capture({CAPTURE}) == 0, _lib.last_error()
        ids = {{s["segment_pool_id"] for s in cudapool.snapshot()["segments"]}}
        assert (0, 0) in ids and len(ids) == 2, ids
        assert _lib.sim_violations() == 0
        _lib.free(q, 4096, 0, {OTHER})
        print("OK")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(cudapool.__file__))]))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "OK", out.stderr
