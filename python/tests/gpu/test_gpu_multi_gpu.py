"""Two GPUs with cudapool installed."""

import pytest

import gpu_common

torch = gpu_common.require_cuda()
import cudapool  # noqa: E402

if torch.cuda.device_count() < 2:
    pytest.skip(f"needs 2 GPUs, found {torch.cuda.device_count()}", allow_module_level=True)

MiB = gpu_common.MiB


@pytest.fixture(autouse=True)
def installed():
    gpu_common.require_installed()


def test_devices_have_their_own_pools_and_stats():
    before0 = cudapool.memory_stats(0)["allocation.all.allocated"]
    before1 = cudapool.memory_allocated(1)
    a = torch.randn(1 << 20, device="cuda:1")
    assert cudapool.memory_allocated(torch.device("cuda:1")) - before1 == 4 * MiB
    assert torch.cuda.memory_allocated(1) == cudapool.memory_allocated(1)
    b = a.to("cuda:0")
    torch.testing.assert_close(b.cpu(), a.cpu())
    assert cudapool.memory_stats(0)["allocation.all.allocated"] > before0
    seg = next(s for s in cudapool.snapshot()["segments"]
               if s["address"] <= a.data_ptr() < s["address"] + s["total_size"])
    assert seg["device"] == 1


def test_graph_on_the_second_device():
    with torch.cuda.device(1):
        lin = torch.nn.Linear(128, 128).cuda()
        x = torch.randn(32, 128, device="cuda")
        with torch.no_grad():
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                lin(x).relu()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                y = lin(x).relu()
            new = torch.randn_like(x)
            x.copy_(new)
            g.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(y, lin(new).relu())
        assert gpu_common.pool_of(y.data_ptr()) == tuple(g.pool())
