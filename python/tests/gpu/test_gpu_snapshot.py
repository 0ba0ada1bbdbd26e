# SPDX-License-Identifier: Apache-2.0
"""torch.cuda.memory._snapshot() (routed to cudapool) renders through
torch.cuda._memory_viz."""

import gc
import pickle

import pytest

import gpu_common

torch = gpu_common.require_cuda()
import cudapool  # noqa: E402
from torch.cuda import _memory_viz as viz  # noqa: E402


@pytest.fixture(scope="module")
def snap():
    gpu_common.require_installed()
    torch.cuda.memory._record_memory_history(max_entries=10_000)  # routed to cudapool
    x = torch.randn(1 << 20, device="cuda")
    y = x * 2
    z = torch.randn(100, device="cuda")
    del x
    torch.cuda.synchronize()
    s = torch.cuda.memory._snapshot()
    yield s
    del y, z
    gc.collect()
    cudapool.record_memory_history(0)


def test_snapshot_has_pytorchs_shape(snap):
    assert {"segments", "device_traces"} <= set(snap)
    assert any(b["state"] == "active_allocated" for s in snap["segments"] for b in s["blocks"])
    actions = {e["action"] for e in snap["device_traces"][0]}
    assert {"alloc", "free_requested", "free_completed"} <= actions
    assert_settings(snap)


def assert_settings(snap):
    settings = snap["allocator_settings"]
    if cudapool.mode() == "class":
        # PyTorch builds the dict from the C++ class's snapshot, with its own
        # keys (its settings string is PyTorch's, which record_history, a
        # cudapool key, is not part of)
        assert {"PYTORCH_CUDA_ALLOC_CONF", "expandable_segments", "roundup_power2_divisions"} <= set(settings)
        assert settings["max_split_size"] == -1
    else:
        assert settings["record_history"] == 10_000


def test_text_views(snap):
    summary = viz.segsum(snap)
    assert "segments:" in summary and "total_reserved" in summary
    trace = viz.trace(snap)
    assert "Device 0" in trace
    flame = viz.segments(snap, format_flamegraph=lambda lines: lines)
    assert "active_allocated" in flame
    assert "active_allocated" in viz.memory(snap, format_flamegraph=lambda lines: lines)


@pytest.mark.parametrize("name", ["trace_plot", "segment_plot"])
def test_html_views(snap, name):
    fn = getattr(viz, name, None)
    if fn is None:
        pytest.skip(f"torch.cuda._memory_viz.{name} does not exist in torch {torch.__version__}")
    html = fn(snap)
    assert isinstance(html, str) and "<html>" in html and len(html) > 1000


def test_dump_snapshot_writes_our_snapshot(snap, tmp_path):
    path = tmp_path / "snap.pickle"
    torch.cuda.memory._dump_snapshot(str(path))
    with open(path, "rb") as f:
        loaded = pickle.load(f)
    assert_settings(loaded)
