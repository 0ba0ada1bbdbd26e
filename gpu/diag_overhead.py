"""Where does cudapool's extra torch.empty time go? (diagnostic)

mode ctypes: malloc/free pairs through ctypes, cudapool vs the floor
allocator (bench/floor_alloc.c): same calling overhead, so the difference
is cudapool's own cost when called from a Python thread.
mode torch: torch.empty(4 KiB) pairs with cudapool installed.
"""
import ctypes
import os
import sys
import time

mode = sys.argv[1]
N = 200_000


def best(fn, reps=5):
    return min(fn() for _ in range(reps))


if mode == "ctypes":
    import torch

    torch.cuda.init()  # primary context current, as under PyTorch
    cp = ctypes.CDLL(os.environ["CUDAPOOL_LIBRARY"])
    fl = ctypes.CDLL(os.environ["FLOOR_LIB"])
    for lib, m, f in ((cp, "cudapool_malloc", "cudapool_free"), (fl, "floor_malloc", "floor_free")):
        getattr(lib, m).restype = ctypes.c_void_p
        getattr(lib, m).argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        getattr(lib, f).argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    for name, lib, m, f in (("cudapool", cp, "cudapool_malloc", "cudapool_free"), ("floor", fl, "floor_malloc", "floor_free")):
        mal, fre = getattr(lib, m), getattr(lib, f)

        def run():
            t0 = time.perf_counter_ns()
            for _ in range(N):
                p = mal(4096, 0, None)
                fre(p, 4096, 0, None)
            return (time.perf_counter_ns() - t0) / N

        print(f"ctypes {name:9s} {best(run):7.0f} ns/pair")
else:
    sys.path.insert(0, "python")
    import cudapool

    cudapool.install()
    import torch

    dev = torch.device("cuda", 0)
    torch.empty(1, device=dev)

    def run():
        t0 = time.perf_counter_ns()
        for _ in range(N):
            torch.empty(4096, dtype=torch.uint8, device=dev)
        return (time.perf_counter_ns() - t0) / N

    print(f"torch.empty cudapool [{os.environ.get('GOMAXPROCS', '-')}/{os.environ.get('GODEBUG', '-')}] {best(run):7.0f} ns/pair")
