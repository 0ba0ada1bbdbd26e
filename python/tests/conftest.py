# SPDX-License-Identifier: Apache-2.0
"""Unit tests run against the simulator: no GPU, no torch.

The library reads its environment on its first call, so the simulator is
chosen here, before anything loads it: two devices of 8 GiB each.

A Go c-shared library may see only the environment the process started
with (the Go runtime copies it, when the library is loaded, from the
process's initial environment block), so if pytest was not started with
these settings it is started again with them (pytest_configure below).

The GPU tests in gpu/ are left alone: when a run selects only them, none of
this applies (run_gpu_tests.sh also passes --confcutdir=tests/gpu).
"""

import os
import sys

import pytest

SIM_ENV = {
    "CUDAPOOL_BACKEND": "sim",
    "CUDAPOOL_SIM_DEVICES": "2",
    "CUDAPOOL_SIM_MEMORY": str(8 << 30),
}
CONF_VARS = ("CUDAPOOL_CONF", "PYTORCH_CUDA_ALLOC_CONF")

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
GPU_DIR = os.path.join(TESTS_DIR, "gpu")
PYTHON_DIR = os.path.dirname(TESTS_DIR)
if PYTHON_DIR not in sys.path:
    sys.path.insert(0, PYTHON_DIR)

import cudapool  # noqa: E402  (loads no library yet)
from cudapool import _lib  # noqa: E402

DEVICES = 2


def _under(path, root):
    path = os.path.abspath(path)
    return path == root or path.startswith(root + os.sep)


def _gpu_only(config):
    paths = [a.split("::")[0] for a in config.args]
    return bool(paths) and all(_under(os.path.join(str(config.invocation_params.dir), p), GPU_DIR) for p in paths)


def _startup_env():
    """The environment this process was started with, or None if unknown."""
    try:
        with open("/proc/self/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    env = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            env[k.decode(errors="replace")] = v.decode(errors="replace")
    return env


def _started_right(env):
    return all(env.get(k) == v for k, v in SIM_ENV.items()) and not set(CONF_VARS) & set(env)


def pytest_configure(config):
    config.addinivalue_line("markers", "nolib: the test does not need libcudapool.so")
    if _gpu_only(config):
        return
    os.environ.update(SIM_ENV)
    for var in CONF_VARS:  # the allocator's configuration: start from the defaults
        os.environ.pop(var, None)
    env = _startup_env()
    if env is None or _started_right(env) or os.environ.get("CUDAPOOL_TEST_RESTARTED"):
        return
    # Start pytest again in an environment the library will see.
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        capman.stop_global_capturing()
    sys.stdout.flush()
    sys.stderr.flush()
    os.chdir(config.invocation_params.dir)
    args = [sys.executable, "-m", "pytest", *config.invocation_params.args]
    os.execve(sys.executable, args, dict(os.environ, CUDAPOOL_TEST_RESTARTED="1"))


def library_or_skip():
    try:
        return _lib.find_library()
    except cudapool.CudapoolError as e:
        pytest.skip(f"libcudapool.so is not built yet (run `make`): {e}")


def _clean():
    """Return the allocator to a known state: nothing cached, stats reset,
    no history, default configuration."""
    _lib.configure("")
    cudapool.resume()  # no tag left paused
    cudapool.empty_cache()
    for d in range(DEVICES):
        cudapool.set_per_process_memory_fraction(1.0, d)
        cudapool.reset_accumulated_memory_stats(d)
        cudapool.reset_peak_memory_stats(d)


@pytest.fixture(autouse=True)
def allocator_state(request):
    """Every unit test but those marked nolib gets a loaded library in a
    clean state, and must leave nothing allocated behind."""
    if request.node.get_closest_marker("nolib") or _under(str(request.node.path), GPU_DIR):
        yield
        return
    library_or_skip()
    if os.environ.get("CUDAPOOL_BACKEND") != "sim" or _lib.sim_violations() < 0:
        pytest.fail("the unit tests must run on the simulator (CUDAPOOL_BACKEND=sim)")
    _clean()
    yield
    leaked = {d: cudapool.memory_allocated(d) for d in range(DEVICES)}
    _clean()
    assert leaked == {d: 0 for d in range(DEVICES)}, f"test left allocations behind: {leaked}"


class Allocations:
    """Tracks raw allocations so that a failing test still frees them."""

    def __init__(self):
        self.live = {}

    def malloc(self, size, device=0, stream=0):
        p = _lib.malloc(size, device, stream)
        self.live[p] = (size, device, stream)
        return p

    def free(self, p):
        size, device, stream = self.live.pop(p)
        _lib.free(p, size, device, stream)

    def free_all(self):
        for p in list(self.live):
            self.free(p)


@pytest.fixture
def ordinary():
    """Ordinary segments (one cuMemAlloc each), for the tests of their
    statistics: the default is expandable segments with stitching. The
    clean-up after the test restores the defaults."""
    _lib.configure("expandable_segments:False")


@pytest.fixture
def stitching():
    """Expandable segments with stitching (expandable_segments:True): the
    default, named by the tests of stitched memory so that they do not
    depend on what the default is. The clean-up after the test restores the
    defaults."""
    _lib.configure("expandable_segments:True")


@pytest.fixture
def allocs():
    a = Allocations()
    yield a
    a.free_all()
    _lib.sim_complete_all()
