"""What a call into cudapool's Go side costs after the thread has been away (issue 11).

    PYTHONPATH=python CUDAPOOL_LIBRARY=lib/libcudapool.so python3 gpu/diag_cold_call.py [N]

A capture's enter phase (empty_cache, beginAllocateToPool) costs cudapool about
40 us more per hook than native's, while the same Go work takes 1-2 us in a
loop on the development box. This times one near-empty call into Go
(cudapool_get_memory_fraction, through ctypes) and, as the plain-C baseline,
libc's getpid (also through ctypes), and torch.cuda.empty_cache() (nothing
cached: the hook's fixed cost), each:
  hot      in a tight loop;
  sleep    after time.sleep(IDLE_S) (the thread idle, no GPU work);
  sync     after a short kernel and torch.cuda.synchronize();
N samples of each (default 200), median and 90th percentile in us.
The library is installed as PyTorch's allocator (as in the benchmarks), so
its runtime is in the state it has there. No output files.
"""
import ctypes
import os
import statistics
import sys
import time

IDLE_S = float(os.environ.get("IDLE_S", "0.005"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
import cudapool  # noqa: E402

cudapool.install()
import torch  # noqa: E402

lib = ctypes.CDLL(os.environ.get("CUDAPOOL_LIBRARY", "lib/libcudapool.so"))
lib.cudapool_get_memory_fraction.restype = ctypes.c_double
lib.cudapool_get_memory_fraction.argtypes = [ctypes.c_int]
libc = ctypes.CDLL(None)
calls = {"go": lambda: lib.cudapool_get_memory_fraction(0), "c": lambda: libc.getpid(),
         "empty_cache": lambda: torch.cuda.empty_cache()}
n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
x = torch.ones(1 << 20, device="cuda")
torch.cuda.synchronize()
pc = time.perf_counter_ns


def before(mode):
    if mode == "sleep":
        time.sleep(IDLE_S)
    elif mode == "sync":
        x.mul_(1.0)
        torch.cuda.synchronize()


rows = []
for name, fn in calls.items():
    for mode in ("hot", "sleep", "sync"):
        ts = []
        for _ in range(n):
            before(mode)
            if mode == "hot":
                fn()
            t = pc()
            fn()
            ts.append((pc() - t) / 1e3)
        ts.sort()
        rows.append((name, mode, statistics.median(ts), ts[int(0.9 * (len(ts) - 1))]))
print(f"{'call':12}{'before':>8}{'median us':>12}{'p90 us':>10}")
for name, mode, med, p90 in rows:
    print(f"{name:12}{mode:>8}{med:12.2f}{p90:10.2f}")
