"""Diagnose graph_capture_record_stream_reuse on a GPU.

1. Asks the CUDA driver directly (ctypes) what cudapool's real driver asks
   during a capture: cuStreamGetCaptureInfo (v2 ABI, resolved at API version
   12000) for a stream's terminal nodes, and cuGraphNodeGetDependencies (v1
   ABI) for their dependencies, across a fork and a join.
2. Runs PyTorch's test_graph_capture_reclaim_2_streams scenario with
   cudapool installed and prints the pointers.

    PYTHONPATH=python CUDAPOOL_LIBRARY=lib/libcudapool.so python3 gpu/diag_capture_reuse.py
"""
import ctypes
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
import cudapool  # noqa: E402

cudapool.install()
import torch  # noqa: E402

c_void_p, c_int, c_size_t, c_uint64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_uint64
cu = ctypes.CDLL("libcuda.so.1")
gpa = cu.cuGetProcAddress_v2
gpa.argtypes = [ctypes.c_char_p, ctypes.POINTER(c_void_p), c_int, c_uint64, ctypes.POINTER(c_int)]


def proc(name, version):
    p, st = c_void_p(), c_int()
    r = gpa(name.encode(), ctypes.byref(p), version, 0, ctypes.byref(st))
    print(f"cuGetProcAddress_v2({name}, {version}) -> rc={r} status={st.value} fn={p.value and hex(p.value)}")
    return p.value


info_fn = ctypes.CFUNCTYPE(c_int, c_void_p, ctypes.POINTER(c_int), ctypes.POINTER(c_uint64), ctypes.POINTER(c_void_p),
                           ctypes.POINTER(ctypes.POINTER(c_void_p)), ctypes.POINTER(c_size_t), c_void_p)(proc("cuStreamGetCaptureInfo", 12000))
deps_fn = ctypes.CFUNCTYPE(c_int, c_void_p, ctypes.POINTER(c_void_p), ctypes.POINTER(c_size_t))(proc("cuGraphNodeGetDependencies", 12000))


def terminals(s):
    st, cid, g, deps, n = c_int(), c_uint64(), c_void_p(), ctypes.POINTER(c_void_p)(), c_size_t()
    r = info_fn(c_void_p(s.cuda_stream), ctypes.byref(st), ctypes.byref(cid), ctypes.byref(g), ctypes.byref(deps), ctypes.byref(n), None)
    return r, st.value, cid.value, [deps[i] for i in range(n.value)]


def node_deps(node):
    n = c_size_t()
    r = deps_fn(c_void_p(node), None, ctypes.byref(n))
    arr = (c_void_p * max(n.value, 1))()
    if r == 0 and n.value:
        r = deps_fn(c_void_p(node), arr, ctypes.byref(n))
    return r, [arr[i] for i in range(n.value)]


s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
g = torch.cuda.CUDAGraph(keep_graph=True)
torch.cuda.synchronize()
with torch.cuda.stream(s1):
    g.capture_begin()
    x = torch.ones(8, device="cuda")
    print("s1 after ones:", terminals(s1))
    s2.wait_stream(s1)
    print("s2 after fork:", terminals(s2))
    with torch.cuda.stream(s2):
        y = x + 2
    r, st, cid, t2 = terminals(s2)
    print("s2 after add:", (r, st, cid, t2), "deps of its terminal:", node_deps(t2[0]) if t2 else None)
    s1.wait_stream(s2)
    x.fill_(1.0)
    r, st, cid, t1 = terminals(s1)
    print("s1 after join+fill:", (r, st, cid, t1), "deps:", node_deps(t1[0]) if t1 else None)
    g.capture_end()
torch.cuda.synchronize()

print("cudapool settings before:", cudapool._settings())
torch.cuda.memory._set_allocator_settings("graph_capture_record_stream_reuse:True")
print("cudapool settings after:", cudapool._settings())
torch.cuda.empty_cache()
g = torch.cuda.CUDAGraph(keep_graph=True)
torch.cuda.synchronize()
with torch.cuda.stream(s1):
    g.capture_begin()
    sink1 = torch.empty(8, device="cuda")
    data1 = torch.empty(8, device="cuda")
    p1 = data1.data_ptr()
    s2.wait_stream(s1)
    with torch.cuda.stream(s2):
        buf2 = torch.empty_like(data1)
        torch.add(data1, 2.0, out=buf2)
        data1.record_stream(s2)
    del data1
    data2 = torch.empty(8, device="cuda")
    s1.wait_stream(s2)
    sink1.fill_(1.0)
    data3 = torch.empty(8, device="cuda")
    g.capture_end()
torch.cuda.synchronize()
print(f"data1 {p1:#x} data2 {data2.data_ptr():#x} data3 {data3.data_ptr():#x}: "
      f"{'REUSED after join (ok)' if data3.data_ptr() == p1 else 'not reused'}; before join {'reused (BAD)' if data2.data_ptr() == p1 else 'not reused (ok)'}")
