# SPDX-License-Identifier: Apache-2.0
"""cudapool.cupy on the simulator, through a stand-in for CuPy (fake_cupy.py)
that calls the allocator exactly as CuPy 14's Cython code does: the C
functions through CFunctionAllocator, the current stream through the
get_current_stream_ptr capsule, graph captures through Stream.begin_capture
and end_capture. Real CuPy on a GPU: tests/gpu/test_gpu_interop.py."""

import gc
import threading

import pytest

import cudapool
import cudapool.cupy as cpc
from cudapool import _lib

import fake_cupy

MiB = 1 << 20
GiB = 1 << 30


@pytest.fixture
def cupy(monkeypatch):
    cp = fake_cupy.installed_into(monkeypatch)
    yield cp
    cpc.uninstall()
    gc.collect()
    _lib.sim_complete_all()


def allocated(dev=0):
    return cudapool.memory_allocated(dev)


def segment_of(ptr):
    for seg in cudapool.snapshot()["segments"]:
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return seg
    raise AssertionError(f"{ptr:#x} is in no segment")


def test_install_uses_the_c_functions(cupy):
    assert cpc.install() == "c" and cpc.mode() == "c" and cpc.installed()
    allocator = cupy.cuda.memory.get_allocator()
    assert isinstance(allocator.__self__, cupy.cuda.memory.CFunctionAllocator), (
        "CuPy calls the C allocator's own malloc: no Python function of cudapool's around it"
    )
    assert cupy.get_default_memory_pool().freed == 1, "CuPy's cached blocks are given back at install"
    assert cpc.install() == "c", "idempotent"
    mem = cupy.alloc(5000)
    assert mem.ptr and allocated() == 5120, "the allocation is cudapool's (rounded to 512 B)"
    ptr = mem.ptr
    del mem
    assert allocated() == 0, "the free reaches cudapool (queued, performed by the statistics call)"
    again = cupy.alloc(5000)
    assert again.ptr == ptr, "the freed block is reused"
    stats = cudapool.memory_stats(0)
    assert stats["allocation.all.allocated"] == 2 and stats["allocation.all.freed"] == 1
    assert cupy.alloc(0).ptr == 0, "size 0 allocates nothing"


def test_allocations_use_cupys_current_stream(cupy):
    cpc.install()
    a, b = cupy.cuda.Stream(0x7100), cupy.cuda.Stream(0x7200)
    with a:
        x = cupy.alloc(4096)
        px = x.ptr
    assert segment_of(px)["stream"] == 0x7100
    del x
    with b:
        y = cupy.alloc(4096)
    assert y.ptr != px, "a block freed on stream a is not handed to stream b"
    with a:
        z = cupy.alloc(4096)
    assert z.ptr == px, "but is reused on stream a"
    assert segment_of(y.ptr)["stream"] == 0x7200
    w = cupy.alloc(4096)
    assert segment_of(w.ptr)["stream"] == 0, "no stream entered: the legacy default stream"


def test_out_of_memory_raises_cupys_error(cupy):
    cpc.install()
    with pytest.raises(cupy.cuda.memory.OutOfMemoryError) as info:
        cupy.alloc(20 * GiB)  # the simulated devices have 8 GiB
    assert isinstance(info.value.__cause__, cudapool.OutOfMemoryError)
    assert "out of memory" in str(info.value.__cause__).lower()
    ok = cupy.alloc(1 * MiB)
    assert ok.ptr, "allocation works after the failure"


@pytest.mark.parametrize("path", ["raising", "checking", "python"])
def test_out_of_memory_collects_cycles_first(monkeypatch, path):
    # Every path's failure rule (cudapool.cupy._failure_handler): collect
    # reference cycles and retry once, then raise.
    cp = fake_cupy.installed_into(monkeypatch, noexcept=path == "checking")
    try:
        assert cpc.install(mode="python" if path == "python" else None) == ("python" if path == "python" else "c")
        assert hasattr(cp.cuda.memory.get_allocator(), "__self__") == (path != "checking"), "the path asked for"

        class Holder:
            pass

        h = Holder()
        h.self, h.mem = h, cp.alloc(5 * GiB)
        del h  # unreachable, but only the cycle collector frees it
        gc.disable()
        try:
            big = cp.alloc(5 * GiB)  # needs the memory the cycle holds
        finally:
            gc.enable()
        assert big.ptr
        with pytest.raises(cp.cuda.memory.OutOfMemoryError):
            cp.alloc(20 * GiB)
    finally:
        cpc.uninstall()
        gc.collect()


def test_a_cupy_that_leaves_the_exception_set_gets_the_checking_function(monkeypatch):
    # A CuPy built with legacy_implicit_noexcept: install's probe sees
    # SystemError and falls back to a Python function that checks for NULL
    # around cudapool_cupy_malloc; the probe's -1 is freed as nothing.
    cp = fake_cupy.installed_into(monkeypatch, noexcept=True)
    try:
        _lib._fn("cudapool_clear_error")()
        assert cpc.install() == "c"
        allocator = cp.cuda.memory.get_allocator()
        assert not hasattr(allocator, "__self__"), "a Python function checks the pointer"
        gc.collect()
        stats = cudapool.memory_stats(0)  # performs any queued free
        assert stats["allocation.all.allocated"] == 0 and stats["num_ooms"] == 0, "the probe allocated nothing"
        assert _lib.last_error() is None, "the probe's -1 pointer was freed as nothing"
        with pytest.raises(cp.cuda.memory.OutOfMemoryError) as info:
            cp.alloc(20 * GiB)
        assert isinstance(info.value.__cause__, cudapool.OutOfMemoryError)
        assert cp.alloc(4096).ptr
    finally:
        cpc.uninstall()
        gc.collect()


def test_the_probe_touches_no_device(cupy):
    cupy.cuda.runtime.getDevice = lambda: 1 / 0  # install must not ask CuPy for a device either
    cpc.install()
    assert hasattr(cupy.cuda.memory.get_allocator(), "__self__"), "and the probe passed"
    stats = cudapool.memory_stats(0)
    assert stats["allocation.all.allocated"] == 0 and stats["num_ooms"] == 0
    assert stats["reserved_bytes.all.current"] == 0


def test_uninstall_unregisters_the_failure_handler(cupy):
    import ctypes

    cpc.install()
    cpc.uninstall()
    raising = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)(
        _lib.address("cudapool_cupy_malloc_raising")
    )
    assert raising(None, 20 * GiB, 0) is None, "without a handler a failure is NULL, and nothing is raised"


def test_other_failures_raise_cudapool_errors(cupy):
    cpc.install()
    cupy.cuda.runtime.device = 5  # the simulator has 2 devices
    with pytest.raises(cudapool.CudapoolError, match="device"):
        cupy.alloc(4096)
    cupy.cuda.runtime.device = 1
    m = cupy.alloc(4096)
    assert m.ptr and allocated(1) == 4096 and allocated(0) == 0, "CuPy's device is passed on"


def test_python_mode(cupy):
    assert cpc.install(mode="python") == "python"
    with cupy.cuda.Stream(0x7300):
        x = cupy.alloc(4096)
    assert segment_of(x.ptr)["stream"] == 0x7300
    assert allocated() == 4096
    del x
    assert allocated() == 0
    with pytest.raises(cupy.cuda.memory.OutOfMemoryError):
        cupy.alloc(20 * GiB)


def test_without_the_capsule(monkeypatch):
    fake_cupy.installed_into(monkeypatch, capsule=False)
    try:
        with pytest.raises(cudapool.CudapoolError, match="get_current_stream_ptr"):
            cpc.install(mode="c")
        assert cpc.install() == "python", "falls back to the Python allocator"
    finally:
        cpc.uninstall()


def test_bad_arguments_and_missing_cupy(monkeypatch):
    with pytest.raises(ValueError):
        cpc.install(mode="fast")
    monkeypatch.setitem(__import__("sys").modules, "cupy", None)
    with pytest.raises(cudapool.CudapoolError, match="needs CuPy"):
        cpc.install()
    assert not cpc.installed()


def test_uninstall_restores(cupy):
    before_alloc = cupy.cuda.memory.get_allocator()
    begin = fake_cupy._BaseStream.begin_capture
    cpc.install()
    assert fake_cupy._BaseStream.begin_capture is not begin
    x = cupy.alloc(4096)
    cpc.uninstall()
    assert cupy.cuda.memory.get_allocator() is before_alloc and cpc.mode() is None
    assert fake_cupy._BaseStream.begin_capture is begin
    del x
    assert allocated() == 0, "memory handed out before uninstall still returns to cudapool"


def pool_reserved(pool):
    return sum(s["total_size"] for s in cudapool.snapshot()["segments"] if tuple(s["segment_pool_id"]) == pool)


def test_capture_gets_a_private_pool(cupy):
    cpc.install()
    v0 = _lib.sim_violations()
    cudapool.empty_cache()
    reserved0 = cudapool.memory_reserved(0)
    s, other = cupy.cuda.Stream(0x7400), cupy.cuda.Stream(0x7500)
    with s:
        s.begin_capture()
        x = cupy.alloc(4096)
        y = cupy.alloc(30 * MiB)
        with other:
            z = cupy.alloc(4096)
        del x  # freed inside the capture
        g = s.end_capture()
    pool = tuple(segment_of(y.ptr)["segment_pool_id"])
    assert pool[0] >= 1 << 62 and pool[1] == 0, f"the capture's allocations are in a private pool, got {pool}"
    assert tuple(segment_of(z.ptr)["segment_pool_id"]) == (0, 0), "another stream's allocation is not"
    assert _lib.sim_violations() == v0, "nothing CUDA forbids during a capture"
    with s:
        after = cupy.alloc(4096)
    assert tuple(segment_of(after.ptr)["segment_pool_id"]) == (0, 0), "after end_capture: the default pool"
    del y, z, after
    cudapool.empty_cache()
    assert pool_reserved(pool) > 0, "the graph's pool stays reserved while the graph lives"
    g.launch()
    del g
    gc.collect()
    cudapool.empty_cache()
    assert pool_reserved(pool) == 0, "destroying the graph releases its pool"
    assert cudapool.memory_reserved(0) == reserved0


def test_two_captures_get_two_pools(cupy):
    cpc.install()
    s = cupy.cuda.Stream(0x7600)
    pools, graphs, keep = [], [], []
    for _ in range(2):
        with s:
            s.begin_capture()
            m = cupy.alloc(4096)
            graphs.append(s.end_capture())
        pools.append(tuple(segment_of(m.ptr)["segment_pool_id"]))
        keep.append(m)
    assert pools[0] != pools[1]
    assert cpc.release_graph(graphs[0]) is True
    assert cpc.release_graph(graphs[0]) is False, "released once"
    del keep
    cudapool.empty_cache()
    assert pool_reserved(pools[0]) == 0 and pool_reserved(pools[1]) > 0


def test_failed_captures_release_their_pool(cupy):
    cpc.install()
    legacy = cupy.cuda.Stream(0)
    with pytest.raises(RuntimeError, match="legacy"):
        legacy.begin_capture()
    s = cupy.cuda.Stream(0x7700)
    with s:
        s.begin_capture()
        x = cupy.alloc(4096)
        pool = tuple(segment_of(x.ptr)["segment_pool_id"])
        _lib.sim_end_capture(s.ptr)  # someone else ends it: CuPy's end_capture then fails
        _lib.sim_begin_capture(0x7701, 2)
        _lib.sim_end_capture(0x7701)
        with pytest.raises(RuntimeError):
            s.end_capture()
        y = cupy.alloc(4096)
    assert tuple(segment_of(y.ptr)["segment_pool_id"]) == (0, 0), "routing ended"
    del x
    cudapool.empty_cache()
    assert pool_reserved(pool) == 0, "no graph: the pool is released"


@pytest.mark.parametrize("graph_class", [fake_cupy.GraphWithoutFuncargs, fake_cupy.GraphCopyingFuncargs])
def test_graph_without_funcargs(monkeypatch, capsys, graph_class):
    monkeypatch.setattr(cpc, "_warned_unbound", False)
    cp = fake_cupy.installed_into(monkeypatch, graph_class=graph_class)
    cpc.install()
    try:
        s = cp.cuda.Stream(0x7800)
        with s:
            s.begin_capture()
            x = cp.alloc(4096)
            g = s.end_capture()
        pool = tuple(segment_of(x.ptr)["segment_pool_id"])
        assert "release_graph" in capsys.readouterr().err, "says once how to release such pools"
        del x
        cudapool.empty_cache()
        gc.collect()
        assert pool_reserved(pool) > 0, "the pool is not released before release_graph"
        assert cpc.release_graph(g) is True
        cudapool.empty_cache()
        assert pool_reserved(pool) == 0
    finally:
        cpc.uninstall()


def test_threads(cupy):
    cpc.install()
    errors = []

    def work(i):
        try:
            with cupy.cuda.Stream(0x8000 + i):
                keep = []
                for k in range(300):
                    keep.append(cupy.alloc(512 * (1 + (k * 7 + i) % 64)))
                    if len(keep) > 8:
                        keep.pop(0)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert allocated() == 0
    assert cudapool.memory_stats(0)["allocation.all.allocated"] == 6 * 300


def test_install_with_cupy_true():
    """cudapool.install(cupy=True): PyTorch (the stand-in torch) and CuPy
    (the stand-in CuPy) on cudapool in one call."""
    from helpers import TESTS, run_code

    out = run_code(
        """
        import sys
        sys.path.insert(0, %r)
        import fake_cupy
        sys.modules.update(fake_cupy.build())
        import cupy, cudapool, cudapool.cupy
        alloc = cudapool.install(cupy=True)
        assert cudapool.installed() and alloc is not None
        assert cudapool.cupy.mode() == "c", cudapool.cupy.mode()
        m = cupy.alloc(4096)
        assert cudapool.memory_allocated(0) == 4096
        print("OK")
        """ % TESTS,
        torch="fake",
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr
