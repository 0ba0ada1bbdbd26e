# SPDX-License-Identifier: Apache-2.0
"""Pause and resume by tag on the GPU, with expandable segments and
stitching on: the memory goes back to the driver (its free memory rises by
what the tag held, within 1%), comes back at the same addresses with the
contents kept, and CUDA graphs captured under a tag (torch.cuda.graph,
torch.compile(mode="reduce-overhead"), CuPy) replay with results equal to
eager after pause and resume, without being captured again; on one GPU and
on two."""

import gc

import pytest

import gpu_common

torch = gpu_common.require_cuda()
import cudapool  # noqa: E402
from torch import nn  # noqa: E402

MiB, GiB = gpu_common.MiB, gpu_common.GiB


@pytest.fixture(autouse=True)
def installed():
    gpu_common.require_installed()
    cudapool.configure("expandable_segments:True,stitch:True")
    yield
    cudapool.resume()
    gc.collect()
    torch.cuda.synchronize()


def free_memory(device=0):
    torch.cuda.synchronize(device)
    return torch.cuda.mem_get_info(device)[0]


def given_back(tag, fn):
    """Runs fn (a pause of tag) and returns (bytes the driver got back, bytes
    cudapool says it gave back)."""
    before = free_memory()
    fn()
    return free_memory() - before, cudapool.paused()[tag]


def mlp(d=512, hidden=2048):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d)).cuda()


def test_tensors_kept_and_memory_given_back():
    with cudapool.region("weights"):
        ts = [torch.randn(64 * MiB // 4, device="cuda") for _ in range(8)]  # 512 MiB
    copies = [t.clone() for t in ts]
    ptrs = [t.data_ptr() for t in ts]
    freed, paused = given_back("weights", lambda: cudapool.pause("weights", keep=True))
    assert paused >= 512 * MiB
    assert abs(freed - paused) <= 0.01 * paused, f"the driver got back {freed} bytes of {paused}"
    with pytest.raises(RuntimeError, match='tag "weights" is paused'):
        with cudapool.region("weights"):
            torch.empty(1024, device="cuda")
    cudapool.resume("weights")
    assert [t.data_ptr() for t in ts] == ptrs
    for t, c in zip(ts, copies):
        torch.testing.assert_close(t, c, rtol=0, atol=0)


def test_cuda_graph_replays_after_pause():
    with cudapool.region("weights"):
        model = mlp()
    x = torch.randn(256, 512, device="cuda")
    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                model(x)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with cudapool.region("graph"), torch.cuda.graph(g):
            y = model(x)
        segs = [s for s in cudapool.snapshot()["segments"] if s.get("tag") == "graph"]
        assert any(tuple(s["segment_pool_id"]) != (0, 0) for s in segs), "the graph's private pool is the tag's"
        # The graph's RNG seed and offset holders (512 B each) are made before the capture
        # begins, in the default pools: under the tag too, and nothing else there.
        assert sum(s["allocated_size"] for s in segs if tuple(s["segment_pool_id"]) == (0, 0)) <= 1024
        for _ in range(3):
            cudapool.pause("graph", keep=False)   # scratch and output: recomputed by the replay
            cudapool.pause("weights", keep=True)
            assert cudapool.paused_bytes(0) > 0
            cudapool.resume("weights")
            cudapool.resume("graph")
            new = torch.randn_like(x)
            x.copy_(new)
            g.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(y, model(new))


def test_compiled_graph_tree_replays_after_pause():
    with cudapool.region("weights"):
        model = mlp()

    @torch.compile(mode="reduce-overhead")
    def step(inp):
        return model(inp)

    x = torch.randn(128, 512, device="cuda")
    with torch.no_grad():
        with cudapool.region("cg"):
            for _ in range(3):  # warm-up, record, replay
                step(x)
        assert any(s.get("tag") == "cg" for s in cudapool.snapshot()["segments"])
        for _ in range(3):
            cudapool.pause("cg", keep=False)
            cudapool.pause("weights", keep=True)
            cudapool.resume("weights")
            cudapool.resume("cg")
            new = torch.randn_like(x)
            with cudapool.region("cg"):
                out = step(new).clone()
            torch.testing.assert_close(out, model(new))


def test_cupy_graph_replays_after_pause():
    cupy = pytest.importorskip("cupy")
    import cudapool.cupy as cpc

    cpc.install()
    try:
        x = cupy.arange(1 << 20, dtype=cupy.float32)
        s = cupy.cuda.Stream(non_blocking=True)
        with cudapool.region("cupy"), s:
            s.begin_capture()
            y = cupy.sin(x) * 2 + 1
            graph = s.end_capture()
        for _ in range(2):
            cudapool.pause("cupy", keep=False)
            cudapool.resume("cupy")
            x[:] = cupy.arange(1 << 20, dtype=cupy.float32) * 0.5
            graph.launch(s)
            s.synchronize()
            cupy.testing.assert_allclose(y, cupy.sin(x) * 2 + 1, rtol=1e-6)
        del graph, y
    finally:
        cpc.uninstall()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus():
    with cudapool.region("both"):
        a = torch.randn(32 * MiB, device="cuda:0")
        b = torch.randn(32 * MiB, device="cuda:1")
    ca, cb = a.clone(), b.clone()
    cudapool.pause("both", keep=True)
    assert cudapool.paused_bytes(0) >= 128 * MiB and cudapool.paused_bytes(1) >= 128 * MiB
    cudapool.resume("both")
    torch.testing.assert_close(a, ca, rtol=0, atol=0)
    torch.testing.assert_close(b, cb, rtol=0, atol=0)
