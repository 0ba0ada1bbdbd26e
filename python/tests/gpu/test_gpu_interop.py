# SPDX-License-Identifier: Apache-2.0
"""CuPy and Numba on cudapool beside PyTorch (installed by conftest): kernels
of each library on cudapool memory with results checked, a CuPy stream
destroyed while its memory stays cached, memory freed by one library reused
by another without reserving more, a CuPy graph captured
(while PyTorch announces its own captures) and replayed, CuPy's
out-of-memory error, Numba IPC handles, several threads mixing the three,
and no allocation left behind by any test.

CuPy tests skip without CuPy, Numba tests without a usable numba-cuda; the
module skips without torch and a GPU."""

import gc
import threading

import pytest

import gpu_common

torch = gpu_common.require_cuda()
import cudapool  # noqa: E402
import numpy as np  # noqa: E402  (comes with torch)

MiB, GiB = gpu_common.MiB, gpu_common.GiB

# Each library's adapter is installed before that library first uses the
# GPU (Numba picks its memory manager when it makes its context).
try:
    import cupy as cp
    import cudapool.cupy

    CUPY_MODE = cudapool.cupy.install()
    CUPY_ERROR = None
except Exception as e:  # reported by the tests that need it
    cp, CUPY_MODE, CUPY_ERROR = None, None, f"{type(e).__name__}: {e}"

# numba-cuda 0.x still registers an overload for np.row_stack, which NumPy
# 2.4 removed: every kernel compile then fails with an AttributeError (seen
# on the GPU machine, with or without cudapool). Alias it for this test.
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack

try:
    from numba import cuda as ncuda
    import cudapool.numba

    cudapool.numba.install()
    NUMBA_ERROR = None
except Exception as e:  # reported by the tests that need it
    ncuda, NUMBA_ERROR = None, f"{type(e).__name__}: {e}"


@pytest.fixture
def cupy():
    if cp is None:
        if CUPY_ERROR and "No module named 'cupy'" in CUPY_ERROR:
            pytest.skip(f"CuPy is not installed ({CUPY_ERROR})")
        pytest.fail(f"cudapool.cupy.install() failed: {CUPY_ERROR}")
    assert cudapool.cupy.installed() and CUPY_MODE == "c", f"mode {CUPY_MODE}: expected the C path with CuPy 14"
    return cp


@pytest.fixture
def numba():
    if ncuda is None:
        pytest.skip(f"numba-cuda is not usable ({NUMBA_ERROR})")
    if not ncuda.is_available():
        pytest.skip("numba-cuda sees no GPU")
    assert cudapool.numba.installed_in(), "Numba's context does not use cudapool's manager"
    return ncuda


def settle():
    gc.collect()
    torch.cuda.synchronize()
    if cp is not None:
        cp.cuda.runtime.deviceSynchronize()


@pytest.fixture(autouse=True)
def no_leaks():
    gpu_common.require_installed()
    settle()
    before = cudapool.memory_allocated(0)
    yield
    settle()
    after = cudapool.memory_allocated(0)
    assert after == before, f"allocated bytes went from {before} to {after}: something was not freed"


def pool_of(ptr):
    return gpu_common.pool_of(ptr)


# ---------------------------------------------------------------------------
# Kernels on cudapool memory


def test_cupy_kernels(cupy):
    before = cudapool.memory_allocated(0)
    n = 1 << 22
    x = cupy.arange(n, dtype=cupy.float32)
    assert pool_of(x.data.ptr) == (0, 0), "CuPy's array is in cudapool's default pool"
    assert cudapool.memory_allocated(0) == before + 4 * n, "and counted in cudapool's statistics"
    assert torch.cuda.memory_allocated(0) == cudapool.memory_allocated(0), "which torch.cuda reports too"
    square = cupy.ElementwiseKernel("float32 a", "float32 b", "b = a * a + 1.0f", "cudapool_square")
    y = square(x)
    z = (y - x).astype(cupy.float64)
    expect = np.arange(n, dtype=np.float32)
    np.testing.assert_allclose(cupy.asnumpy(y), expect * expect + 1, rtol=1e-6)
    np.testing.assert_allclose(cupy.asnumpy(z), (expect * expect + 1 - expect).astype(np.float64), rtol=1e-6)
    del x, y, z


def test_cupy_on_its_current_stream(cupy):
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        a = cupy.ones(1 << 20, dtype=cupy.float32)
        b = a * 3
    seg = next(g for g in cudapool.snapshot()["segments"] if g["address"] <= b.data.ptr < g["address"] + g["total_size"])
    assert seg["stream"] == s.ptr, "allocated on CuPy's current stream"
    s.synchronize()
    assert float(b.sum()) == 3 * (1 << 20)
    del a, b


def test_cupy_stream_destroyed_while_its_memory_is_cached(cupy):
    """CuPy destroys a Stream when the object dies, while cudapool keeps the
    memory allocated on it cached. Later growth on other streams (each miss
    records stitching's progress marks) must never name the dead stream to
    the driver: recording an event on it reads freed driver memory, and the
    process may crash at a later allocation."""
    for k in range(4):
        s = cupy.cuda.Stream(non_blocking=True)
        with s:
            a = cupy.full(1 << 20, k, dtype=cupy.float32)  # large pool, on s
            b = cupy.full(64, k, dtype=cupy.float32)  # small pool, on s
            assert float(a[-1]) == k and float(b[-1]) == k
        del a, b, s  # the stream is destroyed; its blocks stay cached
        settle()
        x = cupy.full(32 * MiB, k + 1, dtype=cupy.uint8)  # misses on the null stream
        t = torch.full((48 * MiB,), k + 2, dtype=torch.uint8, device="cuda")
        assert int(x[-1]) == k + 1 and int(t[-1]) == k + 2
        del x, t
        settle()
        cudapool.empty_cache()
        y = cupy.full(96 * MiB, k + 3, dtype=cupy.uint8)  # and after empty_cache
        assert int(y[-1]) == k + 3
        del y


def test_numba_kernels(numba):
    @numba.jit
    def axpy(a, x, y, out):
        i = ncuda.grid(1)  # a global: Numba resolves it at compile time
        if i < out.size:
            out[i] = a * x[i] + y[i]

    n = 1 << 20
    before = cudapool.memory_allocated(0)
    hx, hy = np.arange(n, dtype=np.float32), np.full(n, 2.0, dtype=np.float32)
    dx, dy = numba.to_device(hx), numba.to_device(hy)
    out = numba.device_array(n, dtype=np.float32)
    assert cudapool.memory_allocated(0) == before + 3 * 4 * n, "Numba's arrays are cudapool's"
    assert pool_of(out.device_ctypes_pointer.value) == (0, 0)
    axpy[(n + 255) // 256, 256](3.0, dx, dy, out)
    np.testing.assert_allclose(out.copy_to_host(), 3 * hx + hy)
    del dx, dy, out


def test_numba_kernel_on_a_cupy_array(cupy, numba):
    @numba.jit
    def double(a):
        i = ncuda.grid(1)  # a global: Numba resolves it at compile time
        if i < a.size:
            a[i] *= 2

    n = 1 << 16
    x = cupy.arange(n, dtype=cupy.float32)
    d = numba.as_cuda_array(x)  # no copy: the same cudapool block
    assert d.device_ctypes_pointer.value == x.data.ptr
    double[(n + 255) // 256, 256](d)
    numba.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(x), 2 * np.arange(n, dtype=np.float32))
    del d, x


def test_numba_memory_info_and_ipc(numba):
    ctx = numba.current_context()
    free, total = ctx.get_memory_info()
    driver_free, driver_total = torch.cuda.mem_get_info(0)
    assert total == driver_total and free >= driver_free * 0.9
    d = numba.device_array(1 << 20, dtype=np.uint8)
    ptr = d.device_ctypes_pointer.value
    seg = next(g for g in cudapool.snapshot()["segments"] if g["address"] <= ptr < g["address"] + g["total_size"])
    if seg["is_expandable"]:  # the default: PyTorch's handle bytes ('e'), from cudapool_ipc_share
        h = ctx.memory_manager.get_ipc_handle(d.gpu_data)
        raw, off, _ = cudapool._lib.ipc_share(ptr)
        assert isinstance(h, cudapool.numba.SharedIpcHandle) and h.handle == raw and raw[:2] == b"\x02e"
        assert h.offset == off and h.size == d.nbytes and h.source_info == ctx.device.get_device_identity()
        del h, d
        return
    ours = ctx.memory_manager.get_ipc_handle(d.gpu_data)
    import ctypes

    # The driver's own answer, asked directly (numba's GetIpcHandleMixin is
    # itself broken with the numba.cuda inside numba on the GPU machine).
    cu = ctypes.CDLL("libcuda.so.1")
    base, extent = ctypes.c_uint64(), ctypes.c_size_t()
    assert cu.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(extent), ctypes.c_uint64(ptr)) == 0

    def driver_handle():
        h = (ctypes.c_ubyte * 64)()
        assert cu.cuIpcGetMemHandle(h, ctypes.c_uint64(base.value)) == 0
        return bytes(h)

    def raw(h):  # numba-cuda's binding object, or numba's ctypes array
        return ctypes.string_at(h.getPtr(), 64) if hasattr(h, "getPtr") else bytes(h)

    assert ours.offset == ptr - base.value, "the offset in the segment is the driver's"
    assert ours.size == d.nbytes and ours.source_info == ctx.device.get_device_identity()
    native, again = driver_handle(), driver_handle()
    if native == again:  # the driver gives one handle per allocation
        assert raw(ours.handle) == native, "cudapool's IPC handle is the driver's for the segment"
    del ours, d


# ---------------------------------------------------------------------------
# One pool: memory freed by one library is reused by the next


def _reserved():
    return cudapool.memory_reserved(0)


def test_memory_moves_between_libraries(cupy, numba):
    size = 256 * MiB
    settle()
    cudapool.empty_cache()
    r0 = _reserved()

    x = cupy.empty(size, dtype=cupy.uint8)  # CuPy's null stream: cudapool's stream 0
    x.fill(1)
    p = x.data.ptr
    r1 = _reserved()
    assert r1 >= r0 + size
    del x

    t = torch.empty(size, dtype=torch.uint8, device="cuda")  # PyTorch's default stream is stream 0 too
    assert t.data_ptr() == p, "PyTorch got the block CuPy freed"
    assert _reserved() == r1, "without reserving more"
    t.fill_(2)
    del t

    d = numba.device_array(size, dtype=np.uint8)
    assert d.device_ctypes_pointer.value == p, "Numba got the block PyTorch freed"
    assert _reserved() == r1
    del d
    gc.collect()

    y = cupy.empty(size, dtype=cupy.uint8)
    assert y.data.ptr == p, "and CuPy got it back from Numba"
    assert _reserved() == r1
    del y


def test_cupy_then_torch_peak(cupy):
    """The shared pool's scenario at small scale: CuPy allocates, computes and
    frees 8 x 64 MiB; then PyTorch allocates 8 x 64 MiB: one pool holds
    the peak at 512 MiB."""
    settle()
    cudapool.empty_cache()
    cudapool.reset_peak_memory_stats(0)
    r0 = _reserved()
    xs = [cupy.full(16 * MiB, i, dtype=cupy.float32) for i in range(8)]
    for v in xs:
        v *= 2  # compute, in place
    assert [float(v[-1]) for v in xs] == [2.0 * i for i in range(8)]
    del xs, v  # the loop variable would keep the last array alive
    ts = [torch.full((16 * MiB,), float(i), device="cuda") for i in range(8)]
    assert [float(t[-1]) for t in ts] == [float(i) for i in range(8)]
    peak = cudapool.max_memory_reserved(0) - r0
    assert peak <= 512 * MiB + 40 * MiB, f"peak reserved grew by {peak / MiB:.0f} MiB, expected about 512"
    del ts


# ---------------------------------------------------------------------------
# CuPy graph capture


def test_cupy_graph_capture_and_replay(cupy):
    # PyTorch on cudapool has announced captures (it always does), so
    # cudapool cannot detect CuPy's on its own: cudapool.cupy announces them.
    torch.zeros(1, device="cuda")
    n = 1 << 20
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        x = cupy.arange(n, dtype=cupy.float32)
        warm = (x * 2) + 1  # compile the kernels before capturing
        del warm
        s.synchronize()
        s.begin_capture()
        tmp = x * 2  # allocated and freed inside the capture
        y = tmp + 1  # allocated inside the capture: the graph writes it
        del tmp
        g = s.end_capture()
    assert isinstance(g.host_funcargs, list), "cudapool.cupy ties the pool to the graph through this list"
    pool = pool_of(y.data.ptr)
    assert pool is not None and pool[0] >= 1 << 62, f"the capture's output is in a private pool, got {pool}"
    with s:
        other = cupy.empty(n, dtype=cupy.float32)
    assert pool_of(other.data.ptr) == (0, 0), "after the capture, the stream allocates from the default pool"
    for k in range(3):
        with s:
            x[...] = cupy.full(n, float(k), dtype=cupy.float32)
        g.launch(stream=s)
        s.synchronize()
        np.testing.assert_array_equal(cupy.asnumpy(y), np.full(n, 2.0 * k + 1, dtype=np.float32))
    del y, other
    settle()
    cudapool.empty_cache()
    assert gpu_common.segments_of_pool(pool), "the graph's pool stays reserved while the graph lives"
    del g
    settle()
    cudapool.empty_cache()
    assert gpu_common.segments_of_pool(pool) == [], "destroying the graph released its pool"
    del x


def test_cupy_calls_the_c_allocator_itself(cupy):
    # Expected of CuPy 14 (Cython 3, whose defaults propagate the exception
    # that cudapool_cupy_malloc_raising sets): install()'s probe passes and
    # no Python function of cudapool's runs per allocation.
    allocator = cupy.cuda.memory.get_allocator()
    assert isinstance(getattr(allocator, "__self__", None), cupy.cuda.memory.CFunctionAllocator), (
        f"the allocator is {allocator!r}: this CuPy ({cupy.__version__}) left the probe's exception set"
    )


def test_cupy_out_of_memory(cupy):
    with pytest.raises(cupy.cuda.memory.OutOfMemoryError) as info:
        cupy.empty(1 << 50, dtype=cupy.uint8)  # 1 PiB
    assert isinstance(info.value.__cause__, cudapool.OutOfMemoryError)
    a = cupy.ones(1 << 20)
    assert float(a.sum()) == 1 << 20, "CuPy allocates again after the failure"
    del a


# ---------------------------------------------------------------------------
# Threads


def test_threads_mix_the_libraries(cupy, numba):
    @numba.jit
    def inc(a):
        i = ncuda.grid(1)  # a global: Numba resolves it at compile time
        if i < a.size:
            a[i] += 1

    errors = []
    n = 1 << 16

    def cupy_worker():
        try:
            s = cupy.cuda.Stream(non_blocking=True)
            with s:
                for k in range(50):
                    a = cupy.full(n + k, k, dtype=cupy.int32)
                    b = a * 2
                    if int(b[-1]) != 2 * k:
                        raise AssertionError(f"cupy: {int(b[-1])} != {2 * k}")
                    del a, b
                s.synchronize()
        except Exception as e:  # reported by the test
            errors.append(("cupy", e))

    def torch_worker():
        try:
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                for k in range(50):
                    a = torch.full((n + k,), k, device="cuda", dtype=torch.int32)
                    if int((a * 3)[-1]) != 3 * k:
                        raise AssertionError("torch")
                    del a
            s.synchronize()
        except Exception as e:  # reported by the test
            errors.append(("torch", e))

    def numba_worker():
        try:
            for k in range(30):
                d = numba.to_device(np.full(n + k, k, dtype=np.int32))
                inc[(n + k + 255) // 256, 256](d)
                if d.copy_to_host()[-1] != k + 1:
                    raise AssertionError("numba")
                del d
        except Exception as e:  # reported by the test
            errors.append(("numba", e))

    threads = [threading.Thread(target=f) for f in (cupy_worker, cupy_worker, torch_worker, torch_worker, numba_worker)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


# ---------------------------------------------------------------------------
# The documented one-liners, each in a fresh process without PyTorch on
# cudapool


def _fresh(code, env=None):
    import textwrap

    out = gpu_common.python(["-c", textwrap.dedent(code)], env=env, timeout=240)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), f"stdout:\n{out.stdout}\nstderr:\n{out.stderr}"


def test_cupy_one_line_in_a_cupy_only_process(cupy):
    _fresh("""
        import numpy as np, cupy, cudapool, cudapool.cupy
        assert cudapool.cupy.install() == "c"
        x = cupy.ones(1 << 20, dtype=cupy.float64)
        assert cudapool.memory_allocated(0) == 8 << 20, cudapool.memory_allocated(0)
        s = cupy.cuda.Stream(non_blocking=True)
        with s:
            (x + 1).sum()
            s.synchronize()
            s.begin_capture()
            y = x + 1
            g = s.end_capture()
            g.launch(stream=s)
            s.synchronize()
        assert float(y.sum()) == 2 * (1 << 20)
        pools = {tuple(seg["segment_pool_id"]) for seg in cudapool.snapshot()["segments"]}
        assert any(p[0] >= 1 << 62 for p in pools), pools
        del x, y, g
        import gc; gc.collect()
        cudapool.empty_cache()
        assert cudapool.memory_allocated(0) == 0 and cudapool.memory_reserved(0) == 0, cudapool.memory_stats(0)
        print("OK")
    """)


def test_numba_environment_variable(numba):
    _fresh("""
        import numpy as np, cudapool
        from numba import cuda
        import cudapool.numba
        d = cuda.to_device(np.ones(1 << 20, dtype=np.float32))
        assert isinstance(cuda.current_context().memory_manager, cudapool.numba.CudapoolNumbaManager)
        assert cudapool.memory_allocated(0) == 4 << 20, cudapool.memory_allocated(0)
        assert d.copy_to_host().sum() == 1 << 20
        del d
        import gc; gc.collect()
        assert cudapool.memory_allocated(0) == 0
        print("OK")
    """, env={"NUMBA_CUDA_MEMORY_MANAGER": "cudapool.numba"})


def test_zz_no_private_pool_left():
    """Last: every CuPy graph pool of this module was released."""
    settle()
    cudapool.empty_cache()
    left = [s for s in cudapool.snapshot()["segments"] if s["segment_pool_id"][0] >= 1 << 62]
    assert left == [], f"CuPy graph pools still reserved: {[(s['segment_pool_id'], s['total_size']) for s in left]}"
