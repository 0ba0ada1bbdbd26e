# SPDX-License-Identifier: Apache-2.0
"""A stand-in for the parts of CuPy 14 that cudapool.cupy uses, running on
cudapool's simulator, so that the adapter is tested without a GPU or CuPy.

It does what CuPy's Cython code does (cupy/cuda/memory.pyx, stream.pyx,
graph.pyx of CuPy 14.2):
- CFunctionAllocator.malloc(size) makes a CFunctionAllocatorMemory
  (cupy.cuda.memory exports the class), which calls the C malloc(param,
  size, device_id) with the GIL held unless size is 0 and does not check the
  result, but propagates a Python exception the C function set (Cython 3's
  default for a cdef function returning intptr_t: except? -1; the ctypes
  prototype below checks after every call). With build(noexcept=True) it
  behaves as a CuPy built with legacy_implicit_noexcept: the exception is
  left set, the pointer (-1) kept, and CPython raises SystemError when the
  constructor returns; its destructor calls free(param, ptr, device_id) when
  ptr is not 0.
- cupy.cuda.stream.__pyx_capi__["get_current_stream_ptr"] is a capsule
  named "intptr_t (void)" holding a C function that returns the current
  stream of the calling thread.
- Stream.begin_capture(mode=None) captures in relaxed mode by default and
  refuses the legacy stream; end_capture() returns a Graph, which has no
  __weakref__ and no __dict__ but keeps its capture's host_funcargs list.
- OutOfMemoryError(size, total, limit=0) is a MemoryError.
Simulated captures use cudapool's simulator controls.
"""

import ctypes
import sys
import threading
import types

from cudapool import _lib

_malloc_t = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_free_t = ctypes.PYFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)
_stream_fn_t = ctypes.CFUNCTYPE(ctypes.c_ssize_t)


class OutOfMemoryError(MemoryError):
    def __init__(self, size, total, limit=0):
        self._size, self._total, self._limit = size, total, limit
        super().__init__(f"Out of memory allocating {size:,} bytes (allocated so far: {total:,} bytes).")


class MemoryPointer:
    def __init__(self, mem, offset):
        self.mem, self.ptr = mem, mem.ptr + offset if mem.ptr else 0


class CFunctionAllocatorMemory:
    noexcept = False  # build(noexcept=True): legacy_implicit_noexcept

    def __init__(self, size, param, malloc_func, free_func, device_id):
        self._param, self._free_func, self.device_id, self.size, self.ptr = param, free_func, device_id, size, 0
        if size > 0:
            if not self.noexcept:
                self.ptr = _malloc_t(malloc_func)(param, size, device_id) or 0
                return
            try:
                self.ptr = _malloc_t(malloc_func)(param, size, device_id) or 0
            except BaseException as e:
                self.ptr = (1 << 64) - 1  # the -1 the C function returned, kept
                raise SystemError(f"{type(self).__name__} returned a result with an exception set") from e

    def __del__(self):
        if self.ptr:
            _free_t(self._free_func)(self._param, self.ptr, self.device_id)


class CFunctionAllocator:
    memory_class = CFunctionAllocatorMemory

    def __init__(self, param, malloc_func, free_func, owner):
        self._param, self._malloc_func, self._free_func, self._owner = param or 0, malloc_func, free_func, owner

    def malloc(self, size):
        mem = self.memory_class(size, self._param, self._malloc_func, self._free_func, runtime.getDevice())
        return MemoryPointer(mem, 0)


class PythonFunctionAllocatorMemory:
    def __init__(self, size, malloc_func, free_func, device_id):
        self._free_func, self.device_id, self.size, self.ptr = free_func, device_id, size, 0
        if size > 0:
            self.ptr = malloc_func(size, device_id)

    def __del__(self):
        if self.ptr:
            self._free_func(self.ptr, self.device_id)


class PythonFunctionAllocator:
    def __init__(self, malloc_func, free_func):
        self._malloc_func, self._free_func = malloc_func, free_func

    def malloc(self, size):
        return MemoryPointer(
            PythonFunctionAllocatorMemory(size, self._malloc_func, self._free_func, runtime.getDevice()), 0
        )


class Graph:
    __slots__ = ("host_funcargs", "launched")

    def __init__(self, host_funcargs):
        self.host_funcargs, self.launched = host_funcargs, 0

    def launch(self, stream=None):
        self.launched += 1


class GraphWithoutFuncargs:
    """A CuPy graph as older CuPy releases had it: nothing to hang a pool on."""

    __slots__ = ("launched",)

    def __init__(self, host_funcargs):
        self.launched = 0


class GraphCopyingFuncargs:
    """A graph whose host_funcargs hands out a copy: appending to it would
    not tie anything to the graph."""

    __slots__ = ("_funcargs", "launched")

    def __init__(self, host_funcargs):
        self._funcargs, self.launched = host_funcargs, 0

    @property
    def host_funcargs(self):
        return list(self._funcargs)


class _BaseStream:
    graph_class = Graph

    def __init__(self, ptr, device_id=-1):
        self.ptr, self.device_id = ptr, device_id
        self._graph_host_funcargs = None

    def __enter__(self):
        _tls.stack = getattr(_tls, "stack", []) + [self]
        return self

    def __exit__(self, *args):
        _tls.stack.pop()

    def begin_capture(self, mode=None):
        if self.ptr in (0, 1):
            raise RuntimeError("cannot capture on the default (legacy) stream")
        if _lib.sim_begin_capture(self.ptr, 2 if mode is None else mode) != 0:
            raise RuntimeError("cudaStreamBeginCapture failed")
        self._graph_host_funcargs = []

    def end_capture(self):
        funcargs, self._graph_host_funcargs = self._graph_host_funcargs, None
        if _lib.sim_end_capture(self.ptr) != 0:
            raise RuntimeError("cudaErrorStreamCaptureInvalidated")
        return self.graph_class(funcargs)


class Stream(_BaseStream):
    pass


_tls = threading.local()
_null = Stream(0)
runtime = None  # the cupy.cuda.runtime module of the latest build()


def get_current_stream():
    stack = getattr(_tls, "stack", None)
    return stack[-1] if stack else _null


@_stream_fn_t
def _get_current_stream_ptr():
    return get_current_stream().ptr


def _capsule(fn, name):
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new(ctypes.cast(fn, ctypes.c_void_p), name, None)


class _Pool:
    def __init__(self):
        self.freed = 0

    def free_all_blocks(self):
        self.freed += 1


def build(capsule=True, graph_class=Graph, noexcept=False):
    """The fake cupy, cupy.cuda, cupy.cuda.memory, .stream and .runtime
    modules, as a dict for sys.modules."""
    cupy = types.ModuleType("cupy")
    cupy.__version__ = "14.2.0-fake"
    cuda = types.ModuleType("cupy.cuda")
    memory = types.ModuleType("cupy.cuda.memory")
    stream = types.ModuleType("cupy.cuda.stream")
    rt = types.ModuleType("cupy.cuda.runtime")

    global runtime
    rt.device = 0
    rt.getDevice = lambda: rt.device
    runtime = rt

    memory.OutOfMemoryError = OutOfMemoryError
    memory.MemoryPointer = MemoryPointer
    memory.CFunctionAllocatorMemory = type("CFunctionAllocatorMemory", (CFunctionAllocatorMemory,),
                                           {"noexcept": noexcept})
    memory.CFunctionAllocator = type("CFunctionAllocator", (CFunctionAllocator,),
                                     {"memory_class": memory.CFunctionAllocatorMemory})
    memory.PythonFunctionAllocator = PythonFunctionAllocator
    memory.allocator = None  # None: CuPy's raw cudaMalloc, never used here

    def set_allocator(allocator=None):
        memory.allocator = allocator

    memory.set_allocator = set_allocator
    memory.get_allocator = lambda: memory.allocator

    class _Stream(Stream):
        pass

    _Stream.graph_class = graph_class
    stream.Stream = _Stream
    stream._BaseStream = _BaseStream
    stream.get_current_stream = get_current_stream
    # The name must outlive the capsule, which keeps only its address.
    stream._capsule_name = b"intptr_t (void)"
    stream.__pyx_capi__ = {"get_current_stream_ptr": _capsule(_get_current_stream_ptr, stream._capsule_name)} if capsule else {}

    cuda.memory, cuda.stream, cuda.runtime = memory, stream, rt
    cuda.Stream = _Stream
    cuda.get_current_stream = get_current_stream
    cuda.set_allocator = set_allocator
    cupy.cuda = cuda
    pool = _Pool()
    cupy.get_default_memory_pool = lambda: pool

    def alloc(size):
        """cupy.cuda.alloc: a MemoryPointer from the current allocator."""
        return memory.allocator(size)

    cupy.alloc = alloc
    return {
        "cupy": cupy,
        "cupy.cuda": cuda,
        "cupy.cuda.memory": memory,
        "cupy.cuda.stream": stream,
        "cupy.cuda.runtime": rt,
    }


def installed_into(monkeypatch, **kw):
    """Put a fresh fake CuPy in sys.modules (undone by monkeypatch)."""
    mods = build(**kw)
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return mods["cupy"]
