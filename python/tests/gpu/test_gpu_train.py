# SPDX-License-Identifier: Apache-2.0
"""A small transformer trains to the same losses with cudapool as with
PyTorch's own allocator (same seed, deterministic settings)."""

import json
import os

import pytest

import gpu_common

torch = gpu_common.require_cuda()
import cudapool  # noqa: E402
import tinymodel  # noqa: E402

STEPS = 40
SCRIPT = os.path.join(gpu_common.GPU_DIR, "tinymodel.py")


def same_losses(a, b):
    assert len(a) == len(b) == STEPS
    bad = [(i, x, y) for i, (x, y) in enumerate(zip(a, b)) if abs(x - y) > 1e-4 * max(1.0, abs(y))]
    assert not bad, f"losses differ at (step, cudapool, native): {bad[:5]}"


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    out = tmp_path_factory.mktemp("native") / "losses.json"
    proc = gpu_common.python([SCRIPT, "--steps", str(STEPS), "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["cudapool"] is False
    return result


def test_training_matches_the_native_allocator(native):
    gpu_common.require_installed()
    cudapool.reset_peak_memory_stats()
    losses = tinymodel.train(STEPS)
    same_losses(losses, native["losses"])
    assert losses[-1] < 0.8 * losses[0], "the model did not learn"
    stats = cudapool.memory_stats()
    assert stats["allocation.all.allocated"] > 1000
    assert stats["num_ooms"] == 0
    assert stats["reserved_bytes.all.peak"] >= stats["allocated_bytes.all.peak"] > 0
    # torch's own functions report cudapool's numbers (patched by install())
    assert torch.cuda.max_memory_allocated() == stats["allocated_bytes.all.peak"]
    # both allocators round the same way, so the peaks should be close
    assert stats["allocated_bytes.all.peak"] <= 1.25 * native["peak_allocated"] + 4 * gpu_common.MiB


def test_python_m_cudapool_runs_the_unchanged_script(native, tmp_path):
    out = tmp_path / "losses.json"
    proc = gpu_common.python(["-m", "cudapool", SCRIPT, "--steps", str(STEPS), "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["cudapool"] is True
    same_losses(result["losses"], native["losses"])
