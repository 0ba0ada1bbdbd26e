# SPDX-License-Identifier: Apache-2.0
"""The GPU tools' parts that run without a GPU: gpu/driver_costs.py's
arguments, its skip where there is no driver and its fixed-cost and deferred
tables on stand-in drivers, and gpu/soak.py's hang hook (SOAK_ON_HANG)."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import driver_costs  # noqa: E402
import soak  # noqa: E402


def test_driver_costs_arguments(capsys):
    for bad in (["--tables", "sizes,nope"], ["--tables", ","], ["--reps", "1"]):
        with pytest.raises(SystemExit) as e:
            driver_costs.main(bad)
        assert e.value.code == 2
    assert "nope" in capsys.readouterr().err


def test_driver_costs_skips_without_a_driver(monkeypatch, capsys):
    def no_driver(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(driver_costs.ctypes, "CDLL", no_driver)
    assert driver_costs.main([]) == 0
    assert capsys.readouterr().out.startswith("SKIP: no CUDA driver")


def test_driver_costs_names_a_missing_device(monkeypatch, capsys):
    class Fake:
        def __getattr__(self, name):
            def call(*args):
                if name == "cuDeviceGetCount":
                    args[0]._obj.value = 1
                return 0

            return call

    monkeypatch.setattr(driver_costs.ctypes, "CDLL", lambda name: Fake())
    assert driver_costs.main(["--device", "3"]) == 2
    assert "device 3 does not exist (1 devices)" in capsys.readouterr().err


def test_driver_costs_fixed_table_reserves_what_pools_reserve(capsys):
    # The fixed table reserves 1/8 and 9/8 of the device's memory, in whole
    # 2 MiB pages, frees every range it reserved, and prints one row per
    # figure.
    total = 141 * (1 << 30) + 123
    ranges, freed = [], []

    class Drv:
        def mem_get_info(self):
            return total // 2, total

        def reserve(self, size):
            va = (1 << 40) + len(ranges) * (1 << 38)
            ranges.append((va, size))
            return va

        def free_range(self, va, size):
            freed.append((va, size))

        def synchronize(self):
            pass

    driver_costs.table_fixed(Drv(), 3)
    page = 2 << 20
    eighth = -(-(total // 8) // page) * page
    assert sorted({size for _, size in ranges}) == [eighth, 9 * eighth]
    assert sorted(freed) == sorted(ranges) and len(ranges) == 6, "every range freed at its own address"
    out = capsys.readouterr().out
    for row in ("reserve 1/8", "free 9/8", "cuMemGetInfo", "cuCtxSynchronize, idle"):
        assert row in out


def test_on_hang_runs_the_command_with_the_pid(capfd):
    soak.on_hang(f"{sys.executable} -c 'import sys; print(\"pid\", sys.argv[1])'")
    assert f"pid {os.getpid()}" in capfd.readouterr().err


def test_on_hang_reports_a_command_that_cannot_run(capfd):
    soak.on_hang("")  # nothing to run
    assert capfd.readouterr().err == ""
    soak.on_hang("/nonexistent/debugger -p")
    assert "SOAK_ON_HANG '/nonexistent/debugger -p' failed" in capfd.readouterr().err


class _FakeCuda:
    """A stand-in libcuda for the deferred table: host memory is real (the
    table writes the flag and the pinned buffer through it), device memory is
    a dict of 32-bit words, and, as on an H200, copies, fills and pointer
    queries into addresses not mapped yet are refused while kernel launches
    are taken. Queued work runs at once (the fake has no stream order), the
    first cuMemMap waits until the table's last query is issued (so that
    what is queued meets unmapped addresses however slow the host), and it
    counts what is made and given back."""

    def __init__(self, refuse_wait=False):
        import threading
        self.refuse_wait = refuse_wait
        self.issued = threading.Event()
        self.words = {}  # device address -> 32-bit word
        self.mapped = set()  # mapped page addresses
        self.accessible = False
        self.host = []  # keeps host allocations alive
        self.live = {"reserve": 0, "create": 0, "host": 0, "stream": 0, "module": 0, "event": 0}
        self.next_va = 1 << 40

    def _out(self, ref, value):
        ref._obj.value = value

    def _ok(self, p):
        return (p - p % (2 << 20)) in self.mapped

    def __getattr__(self, name):
        def call(*args):
            return 0

        return call

    def cuDeviceGetCount(self, n):
        self._out(n, 1)
        return 0

    def cuMemAddressReserve(self, p, size, *rest):
        self._out(p, self.next_va)
        self.live["reserve"] += 1
        return 0

    def cuMemAddressFree(self, p, size):
        self.live["reserve"] -= 1
        return 0

    def cuMemCreate(self, h, *rest):
        self._out(h, 7)
        self.live["create"] += 1
        return 0

    def cuMemRelease(self, h):
        self.live["create"] -= 1
        return 0

    def cuMemMap(self, p, size, off, h, flags):
        assert self.issued.wait(10), "the table never issued its last query"
        self.mapped.add(p.value)
        return 0

    def cuMemUnmap(self, p, size):
        if p.value not in self.mapped:
            return 1
        self.mapped.discard(p.value)
        return 0

    def cuMemHostAlloc(self, p, size, flags):
        import ctypes
        buf = ctypes.create_string_buffer(size.value)
        self.host.append(buf)
        self._out(p, ctypes.addressof(buf))
        self.live["host"] += 1
        return 0

    def cuMemFreeHost(self, p):
        self.live["host"] -= 1
        return 0

    def cuStreamCreate(self, s, flags):
        self._out(s, 99)
        self.live["stream"] += 1
        return 0

    def cuStreamDestroy_v2(self, s):
        self.live["stream"] -= 1
        return 0

    def cuModuleLoadData(self, m, image):
        self._out(m, 5)
        self.live["module"] += 1
        return 0

    def cuModuleUnload(self, m):
        self.live["module"] -= 1
        return 0

    def cuEventCreate(self, e, flags):
        self._out(e, 6)
        self.live["event"] += 1
        return 0

    def cuEventDestroy_v2(self, e):
        self.live["event"] -= 1
        return 0

    def cuStreamWaitValue32_v2(self, s, addr, value, flags):
        return 801 if self.refuse_wait else 0  # CUDA_ERROR_NOT_SUPPORTED

    def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, shm, s, params, extra):
        import ctypes
        p = ctypes.cast(params[0], ctypes.POINTER(ctypes.c_ulonglong)).contents.value
        v = ctypes.cast(params[1], ctypes.POINTER(ctypes.c_uint32)).contents.value
        n = ctypes.cast(params[2], ctypes.POINTER(ctypes.c_uint32)).contents.value
        for i in range(n):
            self.words[p + 4 * i] = v
        return 0

    def cuMemsetD32Async(self, p, v, n, s):
        if not self._ok(p.value):
            return 1
        for i in range(n.value):
            self.words[p.value + 4 * i] = v.value
        return 0

    def cuMemcpyHtoDAsync_v2(self, p, src, n, s):
        return 0 if self._ok(p.value) else 1

    def cuMemcpyDtoDAsync_v2(self, dst, src, n, s):
        return 0 if self._ok(dst.value) and self._ok(src.value) else 1

    def cuPointerGetAttribute(self, out, attr, p):
        return 0 if self._ok(p.value) else 1

    def cuMemGetAddressRange_v2(self, base, size, p):
        self.issued.set()
        return 0 if self._ok(p.value) else 500

    def cuMemcpyDtoH_v2(self, dst, src, n):
        for i in range(n.value // 4):
            dst[i] = self.words.get(src.value + 4 * i, 0)
        return 0


@pytest.mark.parametrize("refuse_wait", [False, True])
def test_driver_costs_deferred_table(monkeypatch, capsys, refuse_wait):
    # The deferred table reports each call's verdict, checks what was taken,
    # and gives back everything it made, also when the wait is refused.
    fake = _FakeCuda(refuse_wait)
    monkeypatch.setattr(driver_costs.ctypes, "CDLL", lambda name: fake)
    assert driver_costs.main(["--tables", "deferred", "--reps", "2"]) == 0
    out = capsys.readouterr().out
    assert fake.live == {k: 0 for k in fake.live}, fake.live
    assert not fake.mapped
    if refuse_wait:
        assert "refused (CUresult 801): nothing to measure" in out
        assert "kernel launch" not in out
        return
    assert "the other thread mapped 4 pages" in out
    assert "kernel launch CUresult   0: taken, result right" in out
    for name in ("cuMemsetD32Async", "cuMemcpyHtoDAsync, pinned", "cuMemcpyDtoDAsync", "cuPointerGetAttribute"):
        assert f"{name} CUresult   1: refused" in out
    assert "cuMemGetAddressRange CUresult 500: refused" in out
    assert "us per call" in out
