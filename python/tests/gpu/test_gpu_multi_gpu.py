# SPDX-License-Identifier: Apache-2.0
"""Two GPUs with cudapool installed; FSDP2 with torch.compile under
torchrun, natively and with cudapool (gpu/fsdp2_compile.py)."""

import json
import os
import signal
import subprocess
import sys

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


FSDP_SCRIPT = os.path.join(gpu_common.GPU_DIR, "fsdp2_compile.py")
FSDP_TIMEOUT = int(os.environ.get("CUDAPOOL_FSDP_TIMEOUT", "480"))
FSDP_STEPS = 30


def torchrun_fsdp(mode, out):
    """gpu/fsdp2_compile.py on 2 GPUs; (returncode, output). A hang is a failure."""
    scrub = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CUDAPOOL_CONF", "CUDAPOOL_BACKEND",
             "CUDAPOOL_GPU_NO_INSTALL", "CUDAPOOL_AUTOINSTALL")
    env = {k: v for k, v in os.environ.items() if k not in scrub}
    env["PYTHONPATH"] = os.pathsep.join([gpu_common.PYTHON_DIR] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", FSDP_SCRIPT,
           "--mode", mode, "--steps", str(FSDP_STEPS), "--out", str(out)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=FSDP_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its ranks: the group this test started
        output, _ = proc.communicate()
        pytest.fail(f"FSDP2 {mode} run timed out after {FSDP_TIMEOUT}s:\n{(output or '')[-4000:]}", pytrace=False)
    return proc.returncode, output


def test_fsdp2_compile_training_matches_native(tmp_path):
    runs = {}
    for mode in ("native", "cudapool"):
        out = tmp_path / f"{mode}.json"
        rc, output = torchrun_fsdp(mode, out)
        assert rc == 0 and out.exists(), f"FSDP2 {mode} run failed (rc={rc}):\n{output[-4000:]}"
        runs[mode] = json.loads(out.read_text())
    native, cp = runs["native"], runs["cudapool"]
    for r in (native, cp):
        assert r["world_size"] == 2 and len(r["ranks"]) == 2
        assert all(f["ok"] and f["sharded"] for f in r["ranks"]), r["ranks"]
    assert [f["allocator"] for f in cp["ranks"]] == ["class", "class"], cp["ranks"]
    assert all(f["cudapool_allocations"] > 0 for f in cp["ranks"])
    assert [f["allocator"] for f in native["ranks"]] == ["native", "native"]
    a, b = native["losses"], cp["losses"]
    assert len(a) == len(b) == FSDP_STEPS
    bad = [(i, x, y) for i, (x, y) in enumerate(zip(a, b)) if abs(x - y) > 5e-4 * max(1.0, abs(x))]
    assert not bad, f"losses differ at (step, native, cudapool): {bad[:5]}"
