# SPDX-License-Identifier: Apache-2.0
"""CUDA IPC in PyTorch's handle format through the C ABI
(cudapool_ipc_share, cudapool_ipc_open_shared, cudapool_ipc_close) on the
simulator. A simulated process can import what it exported itself (its
pidfd_open of itself works as of another process), so one Python process
plays both sides; the Go tests use two simulated processes. The devices
export file descriptors (CUDAPOOL_SIM_SHAREABLE's default)."""

import errno
import struct
import subprocess
import sys

import pytest

import cudapool
from cudapool import _lib
from helpers import PYTHON_DIR

MiB = 1 << 20


def parse(handle):
    """(version, type, pid, segment size, entries) of an 'e' handle."""
    version, kind = handle[0], chr(handle[1])
    pid, _, seg, n = struct.unpack_from("<iiQQ", handle, 2)
    return version, kind, pid, seg, list(struct.unpack_from(f"<{n}i", handle, 26))


@pytest.mark.parametrize("conf, seg_size, pages",
                         [("expandable_segments:True", 2 * MiB, 3), ("expandable_segments:True,stitch:False", 20 * MiB, 1)],
                         ids=["stitching", "expandable"])
def test_expandable_memory_round_trip(allocs, conf, seg_size, pages):
    """Stitching (the default, named) maps 2 MiB pages, one descriptor each
    under the block; without stitching the large pool's 20 MiB chunks."""
    _lib.configure(conf)
    p = allocs.malloc(5 * MiB)
    data = bytes(range(256)) * 16
    _lib.sim_write(p, data)
    handle, off, dev = _lib.ipc_share(p)
    version, kind, pid, seg, fds = parse(handle)
    assert (version, kind, dev) == (2, "e", 0)
    assert seg == seg_size and len(fds) == pages and len(handle) == 2 + 24 + 4 * pages
    assert _lib.ipc_share(p) == (handle, off, dev), "the same bytes every time"
    base = _lib.ipc_open_shared(handle)
    assert base != p - off, "mapped at an address of its own"
    assert _lib.sim_read(base + off, len(data)) == data
    _lib.sim_write(base + off, b"written by the importer")
    assert _lib.sim_read(p, 23) == b"written by the importer"
    assert _lib.ipc_open_shared(handle) == base, "a second open maps once"
    _lib.ipc_close(base)
    _lib.ipc_close(base)
    with pytest.raises(cudapool.CudapoolError, match="cudapool_ipc_close: "):
        _lib.ipc_close(base)


def test_ordinary_memory_is_type_c(ordinary, allocs):
    p = allocs.malloc(4096)
    handle, off, _ = _lib.ipc_share(p)
    assert handle[:2] == b"\x02c" and len(handle) == 66
    base = _lib.ipc_open_shared(handle)
    _lib.ipc_close(base)


@pytest.mark.parametrize(
    "open_errno, getfd_errno, want",
    [
        (0, errno.EPERM, "ptrace permission to process"),
        (0, errno.ENOSYS, r"the kernel lacks pidfd_getfd \(Linux 5.6\+\)"),
        (errno.ENOSYS, 0, r"the kernel lacks pidfd_open \(Linux 5.3\+\)"),
    ],
)
def test_pidfd_errors_raise(stitching, allocs, open_errno, getfd_errno, want):
    """A kernel or permission without pidfd_getfd is an exception that says
    what is missing, raised at once (never a hang)."""
    p = allocs.malloc(3 * MiB)  # expandable segments: shared as descriptors
    handle, _, _ = _lib.ipc_share(p)
    _lib.sim_set_pidfd_errors(open_errno, getfd_errno)
    try:
        with pytest.raises(cudapool.CudapoolError, match="cudapool_ipc_open_shared: .*" + want):
            _lib.ipc_open_shared(handle)
    finally:
        _lib.sim_set_pidfd_errors(0, 0)
    _lib.ipc_close(_lib.ipc_open_shared(handle))


def test_bad_handles(allocs):
    for handle, want in [(b"\x03e" + bytes(28), "version 3"), (b"\x02x" + bytes(64), "type 'x'"), (b"\x02", "1 bytes")]:
        with pytest.raises(cudapool.CudapoolError, match=want):
            _lib.ipc_open_shared(handle)
    p = allocs.malloc(4096)
    with pytest.raises(cudapool.CudapoolError, match="not at its start"):
        _lib.ipc_share(p + 16)


def test_fabric_handles_where_the_system_has_them():
    """CUDAPOOL_SIM_SHAREABLE=fd,fabric: the simulated system supports
    fabric handles, so memory is exported as them (as PyTorch 2.11
    chooses); a fresh process, since the kind is chosen once."""
    code = (
        "from cudapool import _lib\n"
        "p = _lib.malloc(3 << 20)\n"
        "h, off, _ = _lib.ipc_share(p)\n"
        "assert len(h) == 2 + 24 + 2 * 64, len(h)  # stitching: two 2 MiB pages\n"
        "_lib.sim_write(p, b'fabric')\n"
        "b = _lib.ipc_open_shared(h)\n"
        "assert _lib.sim_read(b + off, 6) == b'fabric'\n"
        "_lib.ipc_close(b)\n"
        "print('ok')\n"
    )
    env = {"PYTHONPATH": PYTHON_DIR, "CUDAPOOL_BACKEND": "sim", "CUDAPOOL_SIM_SHAREABLE": "fd,fabric", "PATH": "",
           "CUDAPOOL_CONF": "expandable_segments:True"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
