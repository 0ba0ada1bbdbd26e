# SPDX-License-Identifier: Apache-2.0
"""Quick end-to-end check of cudapool's C++ allocator class on a GPU: one
process, each step printed as ok/FAIL with a short reason, a table at the
end. Run: PYTHONPATH=python CUDAPOOL_LIBRARY=lib/libcudapool.so python3 gpu/smoke_class.py
(the full tests are python/tests/gpu/test_gpu_parity.py)."""

import os
import sys
import time
import traceback

import cudapool

t0 = time.time()
cudapool.install(cpp_class=True)
import torch  # noqa: E402

results = []


def step(name):
    def wrap(fn):
        print(f"...   {name}", flush=True)  # a hang shows where it happened
        try:
            fn()
            results.append((name, "ok", ""))
        except Exception as e:  # report and go on
            traceback.print_exc()
            results.append((name, "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"))
        print(f"{results[-1][1]:5} {name}", flush=True)
        return fn

    return wrap


print("mode", cudapool.mode(), "install+build", round(time.time() - t0, 1), "s", "torch", torch.__version__)


@step("allocate, torch._C stats, accelerator stats")
def _():
    x = torch.empty(1 << 20, device="cuda")
    s = torch.cuda.memory_stats()
    assert s["allocated_bytes.all.current"] >= 4 << 20, s["allocated_bytes.all.current"]
    c = torch._C._cuda_memoryStats(0)
    assert c["allocated_bytes"]["all"]["current"] == s["allocated_bytes.all.current"]
    a = torch.accelerator.memory_stats()
    assert a.get("allocated_bytes.all.current") == s["allocated_bytes.all.current"], list(a)[:3]
    torch.cuda.reset_accumulated_memory_stats()
    torch.cuda.reset_peak_memory_stats()
    assert "Allocated memory" in torch.cuda.memory_summary()
    del x


@step("record_stream, empty_cache, fraction")
def _():
    s = torch.cuda.Stream()
    x = torch.ones(1 << 20, device="cuda")
    x.record_stream(s)
    del x
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(0.5)
    assert abs(torch.cuda.get_per_process_memory_fraction() - 0.5) < 1e-3
    torch.cuda.set_per_process_memory_fraction(1.0)


@step("cudnn benchmark conv (cacheInfo)")
def _():
    torch.backends.cudnn.benchmark = True
    m = torch.nn.Conv2d(16, 32, 3).cuda()
    x = torch.randn(8, 16, 64, 64, device="cuda", requires_grad=True)
    m(x).sum().backward()
    torch.cuda.synchronize()


@step("torch.cuda.graph + replay")
def _():
    x = torch.randn(1024, device="cuda")
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = x * 2
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        y = x * 2 + 1
    x.fill_(3)
    g.replay()
    torch.cuda.synchronize()
    assert torch.all(y == 7)


@step("reduce-overhead inference (graph trees)")
def _():
    m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8)).cuda()
    f = torch.compile(m, mode="reduce-overhead")
    for bs in (4, 8, 4):
        for _ in range(3):
            x = torch.randn(bs, 64, device="cuda")
            torch.testing.assert_close(f(x), m(x))


@step("reduce-overhead training")
def _():
    import torch._inductor.config as cfg

    cfg.triton.slow_path_cudagraph_asserts = True
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).cuda()
    f = torch.compile(m, mode="reduce-overhead")
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    for i in range(6):
        x = torch.randn(16 if i % 2 else 8, 32, device="cuda")
        loss = f(x).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()


@step("memory history with stacks + memory_viz")
def _():
    torch.cuda.memory._record_memory_history(max_entries=10000)

    def named_alloc_site():
        return torch.empty(3 << 20, device="cuda")

    t = named_alloc_site()
    del t
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(None)
    names = {f["name"] for e in snap["device_traces"][0] if e["action"] == "alloc" for f in e.get("frames", [])}
    assert "named_alloc_site" in names, sorted(names)[:10]
    from torch.cuda import _memory_viz

    html = _memory_viz.trace_plot(snap)  # segments() would download flamegraph.pl
    assert "<html>" in html and len(html) > 1000


@step("MemPool + use_mem_pool")
def _():
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        t = torch.empty(1 << 20, device="cuda")
    assert pool.use_count() == 1, pool.use_count()
    segs = pool.snapshot()
    assert segs and all(tuple(s["segment_pool_id"]) == tuple(pool.id) for s in segs), segs[:1]
    del t, pool
    torch.cuda.empty_cache()


@step("OOM observer and 1EB message")
def _():
    seen = []
    torch._C._cuda_attach_out_of_memory_observer(lambda *a: seen.append(a))
    torch.cuda.set_per_process_memory_fraction(0.01)
    try:
        torch.empty(8 << 30, dtype=torch.uint8, device="cuda")
        raise AssertionError("no OOM")
    except torch.OutOfMemoryError as e:
        assert "Tried to allocate" in str(e)
    torch.cuda.set_per_process_memory_fraction(1.0)
    assert seen and seen[0][0] == 0, seen
    try:
        torch.empty(int(8e18), dtype=torch.uint8, device="cuda")
        raise AssertionError("no error")
    except torch.OutOfMemoryError as e:
        assert "Tried to allocate more than 1EB memory" in str(e), str(e)


@step("set_allocator_settings roundup")
def _():
    torch.cuda.memory._set_allocator_settings("roundup_power2_divisions:4")
    before = torch.cuda.memory_stats()["allocated_bytes.all.current"]
    t = torch.empty(84 << 20, dtype=torch.uint8, device="cuda")
    got = torch.cuda.memory_stats()["allocated_bytes.all.current"] - before
    torch.cuda.memory._set_allocator_settings("")
    assert got == 96 << 20, got
    del t


@step("checkpoint api direct")
def _():
    pool = torch.cuda.graph_pool_handle()
    g = torch.cuda.CUDAGraph()
    x = torch.zeros(4, device="cuda")
    with torch.cuda.graph(g, pool=pool):
        y = x + 1
    st = torch._C._cuda_getCheckpointState(0, pool)
    assert torch._C._cuda_checkPoolLiveAllocations(0, pool, {y.untyped_storage().data_ptr()})
    del st, y, g


for name, status, why in results:
    print(f"{status:5} {name}  {why}")
print(f"smoke: {sum(r[1] == 'ok' for r in results)} passed, {sum(r[1] != 'ok' for r in results)} failed")
sys.exit(0 if all(r[1] == "ok" for r in results) else 1)
