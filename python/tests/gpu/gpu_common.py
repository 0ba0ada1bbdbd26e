# SPDX-License-Identifier: Apache-2.0
"""Shared by the GPU test modules."""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.dirname(os.path.dirname(HERE))
GPU_DIR = os.path.join(PYTHON_DIR, "gpu")
MiB = 1 << 20
GiB = 1 << 30

INSTALL_ERROR = None


def want_install():
    return os.environ.get("CUDAPOOL_GPU_NO_INSTALL") != "1"


def install_if_wanted():
    """Called by conftest at import, before any CUDA use."""
    global INSTALL_ERROR
    if not want_install() or os.environ.get("CUDAPOOL_BACKEND", "cuda").lower() == "sim":
        return
    try:
        import torch  # noqa: F401
    except ImportError:
        return
    import cudapool

    try:
        cudapool.install()
    except Exception as e:  # reported by require_installed
        INSTALL_ERROR = e


def require_cuda():
    """Skip the calling module unless torch with a CUDA device is here.
    Returns torch."""
    torch = pytest.importorskip("torch", reason="PyTorch is not installed (the GPU tests need torch and a CUDA device)")
    if os.environ.get("CUDAPOOL_BACKEND", "cuda").lower() == "sim":
        pytest.skip("CUDAPOOL_BACKEND=sim: the GPU tests need the real GPU", allow_module_level=True)
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available", allow_module_level=True)
    return torch


def require_installed():
    """Fail (not skip) if install() failed: on a GPU machine it must work."""
    import cudapool

    if INSTALL_ERROR is not None:
        pytest.fail(f"cudapool.install() failed: {INSTALL_ERROR}")
    if not cudapool.installed():
        pytest.skip("cudapool is not installed in this process (CUDAPOOL_GPU_NO_INSTALL=1?)")


def python(args, env=None, timeout=300):
    """Run a fresh Python with cudapool importable from this checkout."""
    full = dict(os.environ)
    full.update(env or {})
    full["PYTHONPATH"] = os.pathsep.join([PYTHON_DIR] + [p for p in full.get("PYTHONPATH", "").split(os.pathsep) if p])
    full.pop("CUDAPOOL_GPU_NO_INSTALL", None)
    return subprocess.run([sys.executable, *args], env=full, capture_output=True, text=True, timeout=timeout)


def segments_of_pool(pool_id, device=0):
    import cudapool

    return [s for s in cudapool.snapshot()["segments"]
            if tuple(s["segment_pool_id"]) == tuple(pool_id) and s["device"] == device]


def pool_of(ptr):
    """The segment_pool_id of the cudapool segment holding ptr, or None."""
    import cudapool

    for s in cudapool.snapshot()["segments"]:
        if s["address"] <= ptr < s["address"] + s["total_size"]:
            return tuple(s["segment_pool_id"])
    return None
