# SPDX-License-Identifier: Apache-2.0
"""The GPU tools' parts that run without a GPU: gpu/driver_costs.py's
arguments, its skip where there is no driver and its fixed-cost table on a
stand-in driver, and gpu/soak.py's hang hook (SOAK_ON_HANG)."""
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
