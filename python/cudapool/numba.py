# SPDX-License-Identifier: Apache-2.0
"""cudapool as Numba's device memory manager (an External Memory Management
plugin, numba-cuda's ``BaseCUDAMemoryManager`` interface, version 1).

    NUMBA_CUDA_MEMORY_MANAGER=cudapool.numba python script.py

or in code, before Numba creates its CUDA context (its first device array or
kernel launch)::

    import cudapool.numba
    cudapool.numba.install()

Device allocations (``memalloc``) come from cudapool, on the device of
Numba's context and on the default stream Numba uses (the legacy default
stream, or the per-thread one with NUMBA_CUDA_PER_THREAD_DEFAULT_STREAM=1):
memory Numba frees is reused by later allocations on that stream, from
Numba, CuPy's null stream or PyTorch's default stream alike. Host (pinned,
mapped) and managed allocations stay Numba's own (HostOnlyCUDAMemoryManager).
"""

import contextlib
import ctypes
import gc
import sys
import threading

from . import _lib

try:
    from numba import cuda as _cuda
    from numba.cuda.cudadrv import driver as _driver
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"cudapool.numba needs numba-cuda ({e}); install it, e.g. `pip install numba-cuda`"
    ) from e

__all__ = ["CudapoolNumbaManager", "SharedIpcHandle", "install", "_numba_memory_manager"]

# CU_STREAM_PER_THREAD: the per-thread default stream's handle.
_PER_THREAD_STREAM = 2


try:
    from numba.cuda.core import config as _config
except ImportError:  # pragma: no cover - older numba-cuda layouts
    from numba.core import config as _config


def _default_stream():
    """The stream Numba's default-stream work runs on (read each time: the
    setting may change after import, as Numba's own reads do)."""
    return _PER_THREAD_STREAM if getattr(_config, "CUDA_PER_THREAD_DEFAULT_STREAM", 0) else 0


def _own_function(name, restype, argtypes):
    """A ctypes function object of our own (lib[name] is a new one each
    time), so its types leave the shared binding's alone."""
    fn = _lib.load()[name]
    fn.restype, fn.argtypes = restype, argtypes
    return fn


class _C:
    """The C functions this module calls, typed once."""

    def __init__(self):
        vp, sz, i, u64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_ulonglong
        self.malloc = _own_function("cudapool_malloc_ctx", vp, [sz, i, vp, u64])
        self.free = _own_function("cudapool_free_ctx", i, [vp, sz, i, u64])
        self.ipc_handle = _own_function(
            "cudapool_ipc_handle", i, [vp, ctypes.POINTER(ctypes.c_ubyte * 64), ctypes.POINTER(sz), ctypes.POINTER(i)]
        )


_c = None
_c_lock = threading.Lock()


def _lib_c():
    global _c
    if _c is None:
        with _c_lock:
            if _c is None:
                _c = _C()
    return _c


class OutOfMemoryError(_driver.CudaAPIError, _lib.OutOfMemoryError):
    """cudapool could not allocate: both Numba's CudaAPIError with
    CUDA_ERROR_OUT_OF_MEMORY (what Numba's own manager raises) and
    cudapool.OutOfMemoryError."""

    def __init__(self, msg):
        code = getattr(getattr(_driver.binding, "CUresult", None), "CUDA_ERROR_OUT_OF_MEMORY", 2)
        _driver.CudaAPIError.__init__(self, code, msg)


class CudapoolNumbaManager(_cuda.HostOnlyCUDAMemoryManager):
    """Numba's device memory from cudapool. Numba makes one per context;
    set_memory_manager also makes one with context=None to read
    interface_version."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._defer_lock = threading.Lock()
        self._defer_depth = 0
        self._deferred = []  # (ptr, size, device) freed while cleanup is deferred

    @property
    def interface_version(self):
        return 1

    def _device(self):
        return self.context.device.id

    def initialize(self):
        _lib_c()  # loads libcudapool.so: fail here, not at the first allocation
        # Numba sizes its queue of pending host frees from the device memory,
        # as its own manager does.
        pending = self.deallocations
        if pending.memory_capacity is getattr(_driver, "_SizeNotSet", None):
            try:
                pending.memory_capacity = self.get_memory_info().total
            except Exception:  # no driver to ask: keep Numba's default
                pass

    def memalloc(self, size):
        ctx = self.context
        if size == 0:  # as Numba's empty arrays: a NULL pointer nobody frees
            binding = getattr(_driver, "binding", None)  # absent in numba's own numba.cuda
            null = binding.CUdeviceptr(0) if binding is not None else ctypes.c_void_p(0)
            return _driver.MemoryPointer(ctx, null, 0)
        dev = self._device()
        c = _lib_c()
        ptr = c.malloc(size, dev, _default_stream(), 0)
        if not ptr:
            gc.collect()  # device arrays waiting in reference cycles
            ptr = c.malloc(size, dev, _default_stream(), 0)
        if not ptr:
            err = _lib._error(f"cudapool could not allocate {size} bytes on device {dev}")
            if isinstance(err, _lib.OutOfMemoryError):
                raise OutOfMemoryError(str(err))
            raise err
        return _driver.MemoryPointer(ctx, ctypes.c_void_p(ptr), size, finalizer=self._finalizer(ptr, size, dev))

    def _finalizer(self, ptr, size, dev):
        free = self._free

        def core():
            free(ptr, size, dev)

        return core

    def _free(self, ptr, size, dev):
        with self._defer_lock:
            if self._defer_depth:
                self._deferred.append((ptr, size, dev))
                return
        self._free_now(ptr, size, dev)

    @staticmethod
    def _free_now(ptr, size, dev):
        # Called from finalizers, which must not raise.
        if _lib_c().free(ptr, size, dev, 0) != 0:
            print(f"cudapool.numba: free of {ptr:#x}: {_lib.last_error()}", file=sys.stderr)

    @contextlib.contextmanager
    def defer_cleanup(self):
        """While active, memory Numba frees is not given back to cudapool
        (so not reused by other work), e.g. while asynchronous work on
        other streams may still use it."""
        with self._defer_lock:
            self._defer_depth += 1
        try:
            with super().defer_cleanup():
                yield
        finally:
            with self._defer_lock:
                self._defer_depth -= 1
                pending = self._deferred if self._defer_depth == 0 else []
                if pending:
                    self._deferred = []
            for item in pending:
                self._free_now(*item)

    def reset(self):
        """Numba's context reset (cuda.close()): host allocations are
        cleaned up by Numba, the frees this manager held back are performed,
        and cudapool's cached memory is returned to the driver."""
        super().reset()
        with self._defer_lock:
            pending, self._deferred = self._deferred, []
        for item in pending:
            self._free_now(*item)
        _lib.empty_cache()

    def get_memory_info(self):
        """(free, total): the driver's free memory plus what cudapool caches
        on this device, which Numba's allocations can use."""
        try:
            free, total = _driver.driver.cuMemGetInfo()  # numba-cuda's binding
        except TypeError:
            # The numba.cuda inside numba itself binds the driver with ctypes
            # and out-arguments (seen on the GPU machine when numba-cuda's
            # redirect is not active).
            f, t = ctypes.c_size_t(), ctypes.c_size_t()
            _driver.driver.cuMemGetInfo(ctypes.byref(f), ctypes.byref(t))
            free, total = f.value, t.value
        stats = _lib.memory_stats(self._device())
        cached = stats.get("reserved_bytes.all.current", 0) - stats.get("allocated_bytes.all.current", 0)
        return _driver.MemoryInfo(free=int(free) + max(cached, 0), total=int(total))

    def get_ipc_handle(self, memory):
        """An IpcHandle for memory: for an ordinary segment
        (expandable_segments:False), Numba's own, with the segment's
        cudaIpcMemHandle_t (any Numba process opens it); for memory in an
        expandable segment (the default, stitched or not), a SharedIpcHandle
        carrying PyTorch's handle bytes, which the receiving process opens
        through cudapool."""
        ptr = memory.device_pointer_value
        raw = (ctypes.c_ubyte * 64)()
        offset, dev = ctypes.c_size_t(0), ctypes.c_int(-1)
        source = self.context.device.get_device_identity()
        if _lib_c().ipc_handle(ptr, ctypes.byref(raw), ctypes.byref(offset), ctypes.byref(dev)) != 0:
            if "expandable segment" not in (_lib.last_error() or ""):
                raise _lib._error(f"cudapool_ipc_handle({ptr:#x}) failed")
            handle, off, _ = _lib.ipc_share(ptr)
            return SharedIpcHandle(memory, handle, memory.size, source, offset=off)
        binding = getattr(_driver, "binding", None)
        if binding is not None:  # numba-cuda's driver binding
            handle = binding.CUipcMemHandle()
            ctypes.memmove(handle.getPtr(), raw, 64)
        else:  # the numba.cuda inside numba itself: a ctypes array
            from numba.cuda.cudadrv import drvapi

            handle = drvapi.cu_ipc_mem_handle()
            ctypes.memmove(handle, raw, 64)
        return _driver.IpcHandle(memory, handle, memory.size, source, offset=offset.value)


def _rebuild_shared(handle, size, source_info, offset):
    """Unpickles a SharedIpcHandle in the receiving process."""
    return SharedIpcHandle(None, handle, size, source_info, offset=offset)


class SharedIpcHandle(_driver.IpcHandle):
    """Numba's IpcHandle for memory in cudapool's expandable segments: its
    handle is PyTorch's handle bytes (cudapool_ipc_share: the physical
    allocations under the memory), which have no cudaIpcMemHandle_t, so the
    receiving process opens it through cudapool (cudapool_ipc_open_shared,
    on the device of the context it opens in) rather than with
    cuIpcOpenMemHandle. It pickles like Numba's own (cuda.open_ipc_array,
    a multiprocessing queue); the receiver needs cudapool installed, not as
    its memory manager."""

    def open(self, context):
        """Map the memory in context's device; returns a MemoryPointer to it."""
        if self.base is not None:
            raise ValueError("opening IpcHandle from original process")
        if self._impl is not None:
            raise ValueError("IpcHandle is already opened")
        base = _lib.ipc_open_shared(self.handle, context.device.id)
        self._impl = base
        return _driver.MemoryPointer(context, ctypes.c_void_p(base + self.offset), self.size)

    def open_direct(self, context):
        return self.open(context)

    def open_staged(self, context):
        return self.open(context)

    def close(self):
        if self._impl is None:
            raise ValueError("IpcHandle not opened")
        base, self._impl = self._impl, None
        _lib.ipc_close(base)

    def __reduce__(self):
        return (_rebuild_shared, (bytes(self.handle), self.size, self.source_info, self.offset))


#: What NUMBA_CUDA_MEMORY_MANAGER=cudapool.numba makes Numba use.
_numba_memory_manager = CudapoolNumbaManager


def install():
    """Make cudapool Numba's memory manager. Contexts Numba creates from now
    on use it: call it before Numba first uses the GPU."""
    _lib.load()
    _cuda.set_memory_manager(CudapoolNumbaManager)


def installed_in(context=None):
    """True if Numba's current (or the given) context uses cudapool."""
    ctx = context if context is not None else _cuda.current_context()
    return isinstance(ctx.memory_manager, CudapoolNumbaManager)

