# SPDX-License-Identifier: Apache-2.0
"""cudapool.numba (Numba's External Memory Management plugin) on the
simulator, with the real numba-cuda but no GPU: the manager is given a
stand-in for Numba's context (it reads only context.device.id and
device.get_device_identity()). Skipped where numba-cuda cannot be imported.
Real kernels on a GPU: tests/gpu/test_gpu_interop.py."""

import ctypes
import gc
import pickle
import threading
import types

import pytest

import cudapool
from cudapool import _lib

try:
    import cudapool.numba as cn
    from numba.cuda.cudadrv import driver as ndriver
except Exception as e:  # ImportError, or numba-cuda failing to find the CUDA runtime
    pytest.skip(f"numba-cuda is not usable here: {type(e).__name__}: {e}", allow_module_level=True)

MiB = 1 << 20
GiB = 1 << 30
IDENTITY = {"pci_domain_id": 0, "pci_bus_id": 7, "pci_device_id": 0}


def context(dev=0):
    device = types.SimpleNamespace(id=dev, get_device_identity=lambda: dict(IDENTITY))
    return types.SimpleNamespace(device=device)


@pytest.fixture
def mgr():
    m = cn.CudapoolNumbaManager(context=context())
    yield m
    gc.collect()


def segment_of(ptr):
    for seg in cudapool.snapshot()["segments"]:
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return seg
    raise AssertionError(f"{ptr:#x} is in no segment")


def test_memalloc_and_free(mgr):
    assert mgr.interface_version == 1
    mgr.initialize()
    mp = mgr.memalloc(5000)
    assert isinstance(mp, ndriver.MemoryPointer) and mp.size == 5000
    ptr = mp.device_pointer_value
    assert cudapool.memory_allocated(0) == 5120 and segment_of(ptr)["stream"] == 0
    del mp
    gc.collect()
    assert cudapool.memory_allocated(0) == 0, "the finalizer frees through cudapool"
    again = mgr.memalloc(5000)
    assert again.device_pointer_value == ptr, "and the block is reused"
    again.free()
    assert cudapool.memory_allocated(0) == 0


def test_second_device(monkeypatch):
    m = cn.CudapoolNumbaManager(context=context(1))
    mp = m.memalloc(4096)
    assert cudapool.memory_allocated(1) == 4096 and cudapool.memory_allocated(0) == 0
    mp.free()


def test_empty_allocation(mgr):
    mp = mgr.memalloc(0)
    assert mp.device_pointer_value is None and mp.size == 0
    assert cudapool.memory_stats(0)["allocation.all.allocated"] == 0


def test_out_of_memory(mgr):
    with pytest.raises(cn.OutOfMemoryError) as info:
        mgr.memalloc(20 * GiB)  # the simulated devices have 8 GiB
    err = info.value
    assert isinstance(err, ndriver.CudaAPIError) and isinstance(err, cudapool.OutOfMemoryError)
    assert "out of memory" in str(err).lower()
    assert int(err.code) == 2, "CUDA_ERROR_OUT_OF_MEMORY"
    ok = mgr.memalloc(MiB)
    assert ok.device_pointer_value
    ok.free()


def test_bad_device_is_a_cudapool_error():
    m = cn.CudapoolNumbaManager(context=context(9))
    with pytest.raises(cudapool.CudapoolError, match="device") as info:
        m.memalloc(4096)
    assert not isinstance(info.value, cudapool.OutOfMemoryError)


def test_defer_cleanup(mgr):
    a, b = mgr.memalloc(4096), mgr.memalloc(4096)
    with mgr.defer_cleanup():
        with mgr.defer_cleanup():
            a.free()
        b.free()
        assert cudapool.memory_allocated(0) == 8192, "frees are held back while deferred"
    assert cudapool.memory_allocated(0) == 0, "and performed when the outermost context exits"


def test_reset(mgr):
    cudapool.empty_cache()
    a = mgr.memalloc(30 * MiB)
    with mgr.defer_cleanup():
        a.free()
        mgr.reset()
        assert cudapool.memory_allocated(0) == 0, "reset performs the held-back frees"
    assert cudapool.memory_reserved(0) == 0, "and returns cudapool's cache to the driver"


def test_get_memory_info(mgr, monkeypatch):
    monkeypatch.setattr(ndriver, "driver", types.SimpleNamespace(cuMemGetInfo=lambda: (1000, 8 * GiB)))
    cudapool.empty_cache()
    mp = mgr.memalloc(MiB)
    info = mgr.get_memory_info()
    cached = cudapool.memory_reserved(0) - cudapool.memory_allocated(0)
    assert cached > 0 and info == (1000 + cached, 8 * GiB)
    mp.free()


def test_ipc_handle(ordinary, mgr):  # cuIpcGetMemHandle names cuMemAlloc'd segments
    first, second = mgr.memalloc(4096), mgr.memalloc(4096)
    h = mgr.get_ipc_handle(second)
    assert isinstance(h, ndriver.IpcHandle) and h.base is second and h.size == 4096
    raw = (ctypes.c_ubyte * 64)()
    off, dev = ctypes.c_size_t(), ctypes.c_int()
    lib = _lib.load()
    assert lib.cudapool_ipc_handle(ctypes.c_void_p(second.device_pointer_value), raw, ctypes.byref(off), ctypes.byref(dev)) == 0
    assert ctypes.string_at(h.handle.getPtr(), 64) == bytes(raw), "the handle is cudapool's"
    base, _ = _lib.base_allocation(second.device_pointer_value)
    assert h.offset == second.device_pointer_value - base and h.offset > 0
    assert h.source_info == IDENTITY
    del h
    first.free()
    second.free()


def test_ipc_of_an_unknown_pointer(mgr):
    fake = ndriver.MemoryPointer(context(), ctypes.c_void_p(0x1234), 16)
    with pytest.raises(cudapool.CudapoolError):
        mgr.get_ipc_handle(fake)


def test_per_thread_default_stream(mgr, monkeypatch):
    from numba.cuda.core import config

    monkeypatch.setattr(config, "CUDA_PER_THREAD_DEFAULT_STREAM", 1, raising=False)
    mp = mgr.memalloc(4096)
    assert segment_of(mp.device_pointer_value)["stream"] == 2, "CU_STREAM_PER_THREAD"
    mp.free()


def test_numba_accepts_the_plugin(monkeypatch):
    from numba.cuda.core import config

    monkeypatch.setattr(ndriver, "_memory_manager", None)
    monkeypatch.setattr(config, "CUDA_MEMORY_MANAGER", "cudapool.numba")
    ndriver._ensure_memory_manager()
    assert ndriver._memory_manager is cn.CudapoolNumbaManager, "NUMBA_CUDA_MEMORY_MANAGER=cudapool.numba"
    monkeypatch.setattr(ndriver, "_memory_manager", None)
    cn.install()
    assert ndriver._memory_manager is cn.CudapoolNumbaManager, "cudapool.numba.install()"


def test_threads(mgr):
    errors = []

    def work(i):
        try:
            keep = []
            for k in range(200):
                keep.append(mgr.memalloc(512 * (1 + (k * 5 + i) % 40)))
                if len(keep) > 6:
                    keep.pop(0).free()
            with mgr.defer_cleanup():
                for mp in keep:
                    mp.free()
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert cudapool.memory_allocated(0) == 0
    assert cudapool.memory_stats(0)["allocation.all.allocated"] == 6 * 200


@pytest.mark.parametrize("conf", ["expandable_segments:True", "expandable_segments:True,stitch:False"],
                         ids=["stitching", "expandable"])
def test_ipc_of_expandable_memory(mgr, conf):
    """Memory in an expandable segment (the default, with stitching, or
    without) has no cudaIpcMemHandle_t: its handle carries
    PyTorch's handle bytes, pickles, and opens through cudapool (here in the
    same simulated process, which the simulator allows)."""
    _lib.configure(conf)
    mp = mgr.memalloc(4096)
    try:
        ptr = mp.device_pointer_value
        _lib.sim_write(ptr, b"numba ipc")
        h = mgr.get_ipc_handle(mp)
        assert isinstance(h, cn.SharedIpcHandle) and isinstance(h, ndriver.IpcHandle)
        assert h.base is mp and h.size == 4096 and h.source_info == IDENTITY
        raw, off, _ = _lib.ipc_share(ptr)
        assert h.handle == raw and raw[:2] == b"\x02e" and h.offset == off
        with pytest.raises(ValueError, match="original process"):
            h.open(context())
        got = pickle.loads(pickle.dumps(h))
        assert isinstance(got, cn.SharedIpcHandle) and got.base is None
        assert got.handle == raw and got.offset == off and got.size == 4096
        opened = got.open(context())
        assert opened.device_pointer_value != ptr, "mapped at an address of its own"
        assert _lib.sim_read(opened.device_pointer_value, 9) == b"numba ipc"
        got.close()
        with pytest.raises(ValueError, match="not opened"):
            got.close()
    finally:
        mp.free()


def test_region_tags_numba_memory(mgr):
    """Numba allocates through the C ABI on the calling thread: inside
    cudapool.region its memory is the tag's, paused and resumed with it."""
    mgr.initialize()
    with cudapool.region("numba"):
        mp = mgr.memalloc(8 * MiB)
    ptr = mp.device_pointer_value
    assert segment_of(ptr).get("tag") == "numba"
    cudapool.pause("numba", keep=True)
    assert segment_of(ptr).get("paused") is True and cudapool.paused_bytes(0) > 0
    cudapool.resume("numba")
    assert cudapool.paused_bytes(0) == 0
    mp.free()
