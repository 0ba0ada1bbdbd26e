# SPDX-License-Identifier: Apache-2.0
"""CUDA graphs with cudapool as the allocator: capture with allocations and
frees inside, replay, outputs freed while the graph lives, pools shared
between graphs, memory returned when the graph dies, make_graphed_callables."""

import copy
import gc

import pytest

import gpu_common

torch = gpu_common.require_cuda()
import cudapool  # noqa: E402
from torch import nn  # noqa: E402

MiB = gpu_common.MiB


@pytest.fixture(autouse=True)
def installed():
    gpu_common.require_installed()
    yield
    gc.collect()
    torch.cuda.synchronize()


def warmup(fn, *args):
    """Run fn a few times on a side stream, as PyTorch recommends before capture."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(*args)
    torch.cuda.current_stream().wait_stream(s)


def assert_replays(x, y, eager, *graphs):
    """Replays graphs (in order) three times on new inputs copied into x and
    checks y against eager(new) each time."""
    for _ in range(3):
        new = torch.randn_like(x)
        x.copy_(new)
        for g in graphs:
            g.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(y, eager(new))


def mlp(d_in=256, hidden=1024, d_out=256):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, d_out)).cuda()


def test_capture_and_replay():
    model, x = mlp(), torch.randn(64, 256, device="cuda")
    with torch.no_grad():
        warmup(model, x)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = model(x)  # the hidden activation is allocated and freed inside the capture
        assert gpu_common.pool_of(y.data_ptr()) == tuple(g.pool())
        assert_replays(x, y, model, g)


def test_capture_reusing_freed_activations():
    """A chain whose activations are freed and reallocated at the same size
    inside the capture: cudapool's front cache serves those mallocs from the
    capture's pool (allocator/routing.go). Each replay must compute what the
    eager chain does, and every intermediate must have stayed in the pool."""
    torch.manual_seed(0)
    ws = [torch.randn(512, 512, device="cuda") / 16 for _ in range(12)]
    x = torch.randn(256, 512, device="cuda")

    def chain(v):
        for w in ws:
            v = torch.relu(v @ w) + 0.5  # v's previous value and the matmul's output are freed here
        return v

    with torch.no_grad():
        warmup(chain, x)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = chain(x)
        assert gpu_common.pool_of(y.data_ptr()) == tuple(g.pool())
        # A tensor allocated on the capture's stream after it: the default pool.
        other = torch.empty(256, 512, device="cuda")
        assert gpu_common.pool_of(other.data_ptr()) != tuple(g.pool())
        assert_replays(x, y, chain, g)


def test_output_freed_while_the_graph_lives_is_not_handed_out():
    model, x = mlp(d_out=4096), torch.randn(64, 256, device="cuda")
    with torch.no_grad():
        warmup(model, x)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = model(x)
        ptr, pool = y.data_ptr(), tuple(g.pool())
        del y  # the replays still write there
        fillers = [torch.full((64, 4096), 7.0, device="cuda") for _ in range(16)]
        assert all(gpu_common.pool_of(f.data_ptr()) == (0, 0) for f in fillers)
        assert all(f.data_ptr() != ptr for f in fillers)
        assert gpu_common.segments_of_pool(pool), "the pool's memory must stay while the graph lives"
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        assert all(bool((f == 7.0).all()) for f in fillers)


def test_two_graphs_share_a_pool():
    m1, m2, x = mlp(), mlp(), torch.randn(64, 256, device="cuda")
    with torch.no_grad():
        warmup(lambda a: m2(m1(a)), x)
        g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(g1):
            y1 = m1(x)
        with torch.cuda.graph(g2, pool=g1.pool()):
            y2 = m2(y1)
        assert gpu_common.pool_of(y2.data_ptr()) == tuple(g1.pool())
        assert_replays(x, y2, lambda a: m2(m1(a)), g1, g2)


def test_memory_returns_after_the_graph_dies():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    a = torch.randn(16 * MiB, device="cuda")  # 64 MiB static input
    base = cudapool.memory_reserved()
    g = torch.cuda.CUDAGraph()
    warmup(lambda t: ((t * 2) + 1).sum(), a)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    with torch.cuda.graph(g):
        out = ((a * 2) + 1).sum()  # two 64 MiB temporaries in the graph's pool
    pool = tuple(g.pool())
    assert sum(s["total_size"] for s in gpu_common.segments_of_pool(pool)) >= 128 * MiB
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, ((a * 2) + 1).sum())
    del g, out
    gc.collect()
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    torch.cuda.empty_cache()
    assert gpu_common.segments_of_pool(pool) == []
    assert cudapool.memory_reserved() <= base
    assert torch.cuda.mem_get_info()[0] - free_before >= 128 * MiB


def test_make_graphed_callables_forward_and_backward():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).cuda()
    ref = copy.deepcopy(model)
    sample = torch.randn(32, 64, device="cuda", requires_grad=True)
    graphed = torch.cuda.make_graphed_callables(model, (sample,))
    for _ in range(3):
        inp = torch.randn(32, 64, device="cuda", requires_grad=True)
        inp_ref = inp.detach().clone().requires_grad_()
        for p in list(model.parameters()) + list(ref.parameters()):
            p.grad = None
        out = graphed(inp)
        (out * out).sum().backward()
        out_ref = ref(inp_ref)
        (out_ref * out_ref).sum().backward()
        torch.testing.assert_close(out, out_ref)
        torch.testing.assert_close(inp.grad, inp_ref.grad)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
