# SPDX-License-Identifier: Apache-2.0
"""cudapool as CuPy's allocator: one pool for CuPy and PyTorch.

    import cudapool.cupy
    cudapool.cupy.install()     # CuPy allocates from cudapool from now on

CuPy then allocates on its current stream from cudapool, frees go back to
cudapool on the stream the memory was allocated on, CuPy's CUDA graph
captures (``Stream.begin_capture``/``end_capture``) get a private pool as
PyTorch's do, and the memory shows in cudapool's statistics
(``cudapool.memory_stats(device)``, and ``torch.cuda.memory_stats()`` when
PyTorch is installed on cudapool too).

The hot path has no Python of cudapool's: CuPy's ``CFunctionAllocator`` calls
``cudapool_cupy_malloc_raising``/``cudapool_cupy_free`` (include/cudapool.h)
directly, and the malloc asks CuPy's own C function ``get_current_stream_ptr``
(from ``cupy.cuda.stream.__pyx_capi__``) for the stream, as CuPy's memory
pool does. ``CFunctionAllocator`` does not check the pointer for NULL, but a
CuPy built by Cython 3 propagates a Python exception that its C malloc sets
along with a result of -1: on a failure the C function calls this module's
handler, which collects reference cycles and asks for one retry, then raises
``cupy.cuda.memory.OutOfMemoryError`` (cudapool's message as its cause).
install() checks that this CuPy propagates it (a probe allocation that
raises at once); where it does not, the allocator given to
``cupy.cuda.set_allocator`` is a Python function that checks for NULL around
``cudapool_cupy_malloc``: one Python frame more per allocation.

Without that C function (a CuPy that does not export it) the allocator falls
back to ``PythonFunctionAllocator`` with a Python function that reads
``cupy.cuda.get_current_stream()``: correct, slower.
"""

import ctypes
import gc
import itertools
import sys
import threading
import weakref

from . import _lib
from ._lib import CudapoolError

__all__ = ["install", "uninstall", "installed", "mode", "release_graph"]

_lock = threading.RLock()
_state = None  # _Installed while cudapool is CuPy's allocator

# Private pool ids of CuPy graph captures: {_POOL_BASE + n, 0}. PyTorch's
# graphs use {n, 0} and its MemPools {0, n} with small n; the high bit keeps
# these apart from both.
_POOL_BASE = 1 << 62
_pool_ids = itertools.count(1)

# The capsule signature of cupy.cuda.stream.get_current_stream_ptr that the
# C shim can call: no arguments, an intptr_t result.
_STREAM_FN_SIGNATURE = "intptr_t (void)"

# The Python C API functions cudapool_cupy_set_failure_handler takes, in its
# order, and the size cudapool_cupy_malloc_raising treats as a probe.
_PYTHON_API = ("PyGILState_Check", "Py_IncRef", "Py_DecRef", "PyObject_CallFunction", "PyObject_IsTrue")
_PROBE_SIZE = (1 << 64) - 1


def _import_cupy():
    try:
        import cupy
        import cupy.cuda.memory  # noqa: F401  (CFunctionAllocator, set_allocator)
    except ImportError as e:
        raise CudapoolError(
            f"cudapool.cupy needs CuPy, but `import cupy` failed ({e}); install it, e.g. "
            "`pip install cupy-cuda13x`"
        ) from e
    return cupy


def _capsule_pointer(capsule):
    """(name, address) of a PyCapsule, through the C API."""
    api = ctypes.pythonapi
    api.PyCapsule_GetName.restype = ctypes.c_char_p
    api.PyCapsule_GetName.argtypes = [ctypes.py_object]
    api.PyCapsule_GetPointer.restype = ctypes.c_void_p
    api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    name = api.PyCapsule_GetName(capsule)
    return (name or b"").decode("ascii", "replace"), api.PyCapsule_GetPointer(capsule, name)


def current_stream_function(cupy):
    """The address of CuPy's C function that returns the current stream
    (``intptr_t get_current_stream_ptr(void)``), or None when this CuPy does
    not export it with that signature."""
    module = getattr(getattr(cupy, "cuda", None), "stream", None)
    capi = getattr(module, "__pyx_capi__", None) or {}
    capsule = capi.get("get_current_stream_ptr")
    if capsule is None:
        return None
    try:
        name, address = _capsule_pointer(capsule)
    except (TypeError, ValueError):
        return None
    if not name.startswith(_STREAM_FN_SIGNATURE) or not address:
        return None
    return address


class _Installed:
    """What install() changed, to undo it."""

    def __init__(self, cupy, mode, allocator, previous, owner, handler):
        self.cupy = cupy
        self.mode = mode
        self.allocator = allocator  # the function given to set_allocator
        self.previous = previous  # CuPy's allocator before install()
        self.owner = owner  # keeps the C allocator and its functions alive
        self.handler = handler  # a failure handler is registered for it
        self.patched = {}  # (class, name) -> original function


def _failure_handler(cupy):
    """What every path does when a malloc fails, attempt by attempt (the
    protocol of cudapool_cupy_malloc_raising's handler): at attempt 0,
    arrays waiting in reference cycles may hold enough memory, so collect
    them and ask for one retry, as CuPy's own pool does; at attempt 1,
    raise (_raise_failure)."""

    def on_failure(size, device, attempt):
        if attempt == 0:
            gc.collect()
            return True
        _raise_failure(cupy, size, device)

    return on_failure


def _raise_failure(cupy, size, device):
    """A malloc returned NULL: raise CuPy's OutOfMemoryError (cudapool's
    message as its cause) or CudapoolError for anything else."""
    err = _lib._error(f"cudapool could not allocate {size} bytes on device {device}")
    if isinstance(err, _lib.OutOfMemoryError):
        try:
            allocated = _lib.memory_stats(device).get("allocated_bytes.all.current", 0)
        except CudapoolError:
            allocated = 0
        raise cupy.cuda.memory.OutOfMemoryError(size, allocated) from err
    raise err


class _Probe(Exception):
    """Raised by install()'s probe handler, and expected back from CuPy."""


def _set_failure_handler(handler):
    """Registers handler (None: none) for cudapool_cupy_malloc_raising."""
    api = (ctypes.c_void_p * len(_PYTHON_API))(
        *(ctypes.cast(getattr(ctypes.pythonapi, name), ctypes.c_void_p).value for name in _PYTHON_API)
    )
    fn = _own_function(
        "cudapool_cupy_set_failure_handler",
        ctypes.c_int,
        [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int],
    )
    # id() is the object's address in CPython, whose C API this is.
    if fn(None if handler is None else id(handler), api, len(api)) != 0:
        raise _lib._error("cudapool_cupy_set_failure_handler failed")


def _propagates(cupy, stream_fn):
    """Whether this CuPy raises the exception cudapool_cupy_malloc_raising
    leaves with -1: one CFunctionAllocatorMemory of the probe size, whose
    malloc calls a handler that raises at once (no device is touched)."""

    def probe(size, device, attempt):
        raise _Probe()

    malloc = _lib.address("cudapool_cupy_malloc_raising")
    free = _lib.address("cudapool_cupy_free")
    _set_failure_handler(probe)
    try:
        cupy.cuda.memory.CFunctionAllocatorMemory(_PROBE_SIZE, stream_fn, malloc, free, 0)
    except _Probe:
        return True
    except Exception:  # SystemError: the exception was left set (implicit noexcept)
        return False
    finally:
        _set_failure_handler(None)
    return False


def _raising_allocator(cupy, stream_fn):
    """The allocator without a Python frame (cudapool_cupy_malloc_raising
    with this module's failure handler), or None where this CuPy cannot."""
    lib = _lib.load()
    try:
        if not _propagates(cupy, stream_fn):
            return None
    except (AttributeError, TypeError, CudapoolError):
        return None  # no CFunctionAllocatorMemory of that signature, or no handler
    c_alloc = cupy.cuda.memory.CFunctionAllocator(
        stream_fn, _lib.address("cudapool_cupy_malloc_raising"), _lib.address("cudapool_cupy_free"), lib
    )
    on_failure = _failure_handler(cupy)
    _set_failure_handler(on_failure)
    return c_alloc.malloc, (c_alloc, on_failure)


def _c_allocator(cupy, stream_fn):
    """The CFunctionAllocator path: CuPy calls cudapool's C functions,
    without a Python frame where this CuPy propagates exceptions. Returns
    the allocator, what keeps it alive, and whether a failure handler is
    registered for it."""
    fast = _raising_allocator(cupy, stream_fn)
    if fast is not None:
        return (*fast, True)
    lib = _lib.load()
    c_alloc = cupy.cuda.memory.CFunctionAllocator(
        stream_fn, _lib.address("cudapool_cupy_malloc"), _lib.address("cudapool_cupy_free"), lib
    )
    c_malloc = c_alloc.malloc
    device_id = cupy.cuda.runtime.getDevice
    on_failure = _failure_handler(cupy)

    def malloc(size):
        for attempt in (0, 1):  # the second failure raises
            mem = c_malloc(size)
            if mem.ptr or not size:
                return mem
            on_failure(size, device_id(), attempt)

    return malloc, c_alloc, False


def _python_allocator(cupy):
    """The fallback: PythonFunctionAllocator, with the stream from Python."""
    c_malloc = _own_function(
        "cudapool_malloc_ctx", ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p, ctypes.c_ulonglong]
    )
    c_free = _own_function("cudapool_cupy_free", None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int])
    current = cupy.cuda.get_current_stream
    on_failure = _failure_handler(cupy)

    def malloc_fn(size, device):
        for attempt in (0, 1):  # the second failure raises
            p = c_malloc(size, device, current().ptr, 0)
            if p:
                return p
            on_failure(size, device, attempt)

    def free_fn(ptr, device):
        c_free(None, ptr, device)

    p_alloc = cupy.cuda.memory.PythonFunctionAllocator(malloc_fn, free_fn)
    return p_alloc.malloc, p_alloc, False


def install(mode=None, capture=True, free_cupy_pool=True):
    """Make cudapool CuPy's allocator (``cupy.cuda.set_allocator``) for
    every device. May be called at any time: memory CuPy allocated before
    stays with CuPy's pool until freed. Idempotent; returns the mode.

    mode: None (default) or "c": CuPy calls cudapool's C functions directly
    ("c" raises if this CuPy cannot); "python": a Python allocator function
    (slower; for comparison).
    capture: route the allocations of CuPy's graph captures to a private
    pool per capture (Stream.begin_capture/end_capture are wrapped), freed
    when the graph is destroyed; cudapool then relies on captures being
    announced (as PyTorch's are): one begun with
    cupy.cuda.runtime.streamBeginCapture directly is not seen.
    free_cupy_pool: return what CuPy's default memory pool caches to the
    driver, so that cudapool can use it.
    """
    global _state
    if mode not in (None, "c", "python"):
        raise ValueError(f"mode must be None, 'c' or 'python', not {mode!r}")
    with _lock:
        cupy = _import_cupy()
        if _state is not None:
            return _state.mode
        _lib.load()
        if mode != "python":
            stream_fn = current_stream_function(cupy)
            if stream_fn is None and mode == "c":
                raise CudapoolError(
                    "cudapool.cupy.install(mode='c'): this CuPy "
                    f"({getattr(cupy, '__version__', '?')}) does not export get_current_stream_ptr "
                    f"with the signature {_STREAM_FN_SIGNATURE!r} in cupy.cuda.stream.__pyx_capi__"
                )
            chosen = "c" if stream_fn is not None else "python"
        else:
            chosen = "python"
        if chosen == "c":
            allocator, owner, handler = _c_allocator(cupy, stream_fn)
        else:
            allocator, owner, handler = _python_allocator(cupy)
        previous = cupy.cuda.memory.get_allocator()
        state = _Installed(cupy, chosen, allocator, previous, owner, handler)
        try:
            if capture:
                _patch_capture(state)
                # Every CuPy capture is now announced (as PyTorch's are), so
                # malloc need not ask the driver whether its stream captures.
                _own_function("cudapool_expect_announced_captures", None, [])()
            cupy.cuda.set_allocator(allocator)
        except BaseException:
            for (cls, name), fn in state.patched.items():
                setattr(cls, name, fn)
            if handler:
                _set_failure_handler(None)
            raise
        _state = state
        if free_cupy_pool:
            try:
                cupy.get_default_memory_pool().free_all_blocks()
            except Exception:  # no pool or no device yet: nothing cached
                pass
        return chosen


def uninstall():
    """Give CuPy back the allocator it had before install() and unwrap its
    capture methods. Memory cudapool handed to CuPy stays valid and returns
    to cudapool when freed."""
    global _state
    with _lock:
        if _state is None:
            return
        st, _state = _state, None
        for (cls, name), fn in st.patched.items():
            setattr(cls, name, fn)
        if st.cupy.cuda.memory.get_allocator() is st.allocator:
            st.cupy.cuda.set_allocator(st.previous)
        if st.handler:
            _set_failure_handler(None)


def installed():
    """True while cudapool is CuPy's allocator (through install())."""
    return _state is not None


def mode():
    """"c" (CuPy calls cudapool's C functions), "python" (the fallback), or
    None when not installed."""
    return None if _state is None else _state.mode


# ---------------------------------------------------------------------------
# CUDA graph capture. A capture is announced to cudapool before CuPy begins
# it (as PyTorch does), with a filter that accepts the capture stream, so its
# allocations go to a private pool that no other work reuses while the graph
# may replay; routing ends after end_capture, and the pool is released when
# the graph object is destroyed. Without the announcement, and once PyTorch
# (which announces its own) has used cudapool, cudapool could not tell a
# CuPy capture from ordinary work.


def _own_function(name, restype, argtypes):
    """A ctypes function object of our own (lib[name] makes a new one each
    time), so that its types do not change the shared binding's."""
    fn = _lib.load()[name]
    fn.restype, fn.argtypes = restype, argtypes
    return fn


class _GraphPool:
    """Holds a capture's private pool; released when this object dies."""

    __slots__ = ("device", "pool", "finalizer", "__weakref__")

    def __init__(self, device, pool):
        self.device, self.pool = device, pool
        self.finalizer = weakref.finalize(self, _release, device, pool)
        self.finalizer.atexit = False  # the process is ending: nothing to give back

    def release(self):
        self.finalizer()


def _release(device, pool):
    try:
        _lib.release_pool(device, pool)
    except Exception as e:  # from a finalizer: report, never raise
        print(f"cudapool.cupy: releasing graph pool {pool}: {e}", file=sys.stderr)


def _keep_graph_pool(noop, holder):
    """A callback/argument pair shaped like the host functions a CuPy graph
    keeps alive (Graph.host_funcargs); never called."""


def _holder_of(item):
    if isinstance(item, tuple) and len(item) == 2 and item[0] is _keep_graph_pool:
        return item[1]
    return None


# Graphs whose pool could not be tied to their lifetime: id -> (graph,
# _GraphPool); release_graph() releases them.
_unbound = {}
_warned_unbound = False


def _bind_pool(graph, holder):
    """Tie holder's lifetime to graph's: CuPy's Graph has no __weakref__ or
    __dict__, but owns the list of host-function arguments its capture
    collected (Graph.host_funcargs), which dies with it."""
    global _warned_unbound
    funcargs = getattr(graph, "host_funcargs", None)
    if isinstance(funcargs, list):
        funcargs.append((_keep_graph_pool, holder))
        # Only if the graph hands out its own list (not a copy) does the
        # holder live as long as the graph; releasing the pool earlier would
        # let replays write into memory given to others.
        if any(_holder_of(item) is holder for item in getattr(graph, "host_funcargs", None) or ()):
            return
    # Kept with the graph, so that its id cannot be reused while here.
    _unbound[id(graph)] = (graph, holder)
    if not _warned_unbound:
        _warned_unbound = True
        print(
            "cudapool.cupy: this CuPy's Graph does not keep a host_funcargs list cudapool can use; each "
            "captured graph (and its private pool) is kept until cudapool.cupy.release_graph(graph)",
            file=sys.stderr,
        )


def release_graph(graph):
    """Release the private pool of a graph captured under install() now
    (it is otherwise released when the graph is destroyed). The graph must
    not be launched afterwards. Returns True if a pool was released."""
    entry = _unbound.get(id(graph))
    holder = None
    if entry is not None and entry[0] is graph:
        holder = _unbound.pop(id(graph))[1]
    else:
        for item in getattr(graph, "host_funcargs", None) or ():
            holder = _holder_of(item) or holder
    if holder is None or not holder.finalizer.alive:
        return False
    holder.release()
    return True


def _stream_device(cupy, stream):
    dev = getattr(stream, "device_id", -1)
    return cupy.cuda.runtime.getDevice() if dev is None or dev < 0 else dev


def _patch_capture(state):
    cupy = state.cupy
    cls = next((c for c in cupy.cuda.Stream.__mro__ if "begin_capture" in vars(c)), cupy.cuda.Stream)
    orig_begin, orig_end = cls.begin_capture, cls.end_capture
    # The filter is passed as a plain address: cudapool_filter_stream_is.
    c_begin = _own_function(
        "cudapool_begin_allocate_to_pool",
        None,
        [ctypes.c_int, ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_void_p],
    )
    filter_addr = _lib.address("cudapool_filter_stream_is")

    def begin_capture(self, mode=None):
        dev = _stream_device(cupy, self)
        pool = (_POOL_BASE + next(_pool_ids), 0)
        token = _lib._arm()  # begin returns nothing: see _lib._checked
        c_begin(dev, pool[0], pool[1], filter_addr, self.ptr)
        msg = _lib.last_error()
        if msg is None or token not in msg:
            raise CudapoolError(msg or "cudapool_begin_allocate_to_pool failed")
        try:
            orig_begin(self, mode)
        except BaseException:
            _lib.end_allocate_to_pool(dev, pool)
            _lib.release_pool(dev, pool)
            raise
        self._cudapool_capture = (dev, pool)

    def end_capture(self):
        info = self.__dict__.pop("_cudapool_capture", None)
        try:
            graph = orig_end(self)
        except BaseException:
            if info is not None:
                _lib.end_allocate_to_pool(*info)
                _lib.release_pool(*info)  # no graph: nothing will replay
            raise
        if info is not None:
            _lib.end_allocate_to_pool(*info)
            _bind_pool(graph, _GraphPool(*info))
        return graph

    begin_capture.__doc__ = orig_begin.__doc__
    end_capture.__doc__ = orig_end.__doc__
    begin_capture.__wrapped__ = orig_begin
    end_capture.__wrapped__ = orig_end
    state.patched[(cls, "begin_capture")] = orig_begin
    state.patched[(cls, "end_capture")] = orig_end
    cls.begin_capture = begin_capture
    cls.end_capture = end_capture
