"""Diagnostic: follow record_stream through cudapool under PyTorch."""
import ctypes
import sys
import time

sys.path.insert(0, "python")
import cudapool  # noqa: E402

cudapool.install()
import torch  # noqa: E402

cudapool.record_memory_history(1000)
lib = ctypes.CDLL(cudapool.library_path())
lib.cudapool_last_error.restype = ctypes.c_char_p
N = 1 << 20


def scenario(alloc_stream, label):
    side = torch.cuda.Stream()
    with torch.cuda.stream(alloc_stream):
        x = torch.ones(N, device="cuda")
        side.wait_stream(alloc_stream)
        with torch.cuda.stream(side):
            torch.cuda._sleep(1_000_000_000)
            ev = torch.cuda.Event()
            ev.record(side)
        x.record_stream(side)
        ptr = x.data_ptr()
        t0 = time.perf_counter()
        del x
        q1 = ev.query()
        z = torch.empty(N, device="cuda")
        q2 = ev.query()
        dt = (time.perf_counter() - t0) * 1e3
        print(f"{label}: alloc stream {hex(alloc_stream.cuda_stream)} side {hex(side.cuda_stream)}: "
              f"side done before/after z malloc {q1}/{q2}, z reused x: {z.data_ptr() == ptr}, {dt:.2f} ms")
        torch.cuda.synchronize()
        tr = [(e["action"], e["stream"]) for e in cudapool.snapshot()["device_traces"][0] if e["addr"] == ptr]
        print("   trace for x:", tr[-6:])
        del z


scenario(torch.cuda.current_stream(), "default stream")
scenario(torch.cuda.Stream(), "pool stream")
try:
    torch.cuda.set_per_process_memory_fraction(0.01)
    torch.empty(1 << 34, dtype=torch.uint8, device="cuda")
except Exception as e:  # noqa: BLE001
    print("OOM exception type:", type(e).__module__, type(e).__name__, isinstance(e, torch.OutOfMemoryError))
torch.cuda.set_per_process_memory_fraction(1.0)
print("after OOM, allocation works:", torch.empty(1000, device="cuda").sum().item() is not None)
