# SPDX-License-Identifier: Apache-2.0
"""Bad input through the Python API: devices, types and NULs are checked
before the library sees them (TypeError, ValueError), configuration keys
are checked by the library, and a bad configuration in the environment
fails one call, clearly, without breaking the later ones."""

import pytest

import cudapool
from cudapool import _lib
from helpers import run_code

MiB = 1 << 20


# ---- devices ---------------------------------------------------------------

DEVICE_FUNCTIONS = [
    cudapool.memory_stats,
    cudapool.memory_stats_as_nested_dict,
    cudapool.memory_allocated,
    cudapool.max_memory_allocated,
    cudapool.memory_reserved,
    cudapool.max_memory_reserved,
    cudapool.reset_peak_memory_stats,
    cudapool.reset_accumulated_memory_stats,
    cudapool.memory_summary,
    cudapool.front_counters,
    cudapool.snapshot,
    lambda device: cudapool.set_per_process_memory_fraction(1.0, device),
]


@pytest.mark.parametrize("fn", DEVICE_FUNCTIONS)
@pytest.mark.parametrize("device", [2**32, 2**32 + 1, 2**31, 2**63, -1, -(2**32), 2, 7, "cuda:2", "cuda:4294967296"])
def test_device_out_of_range_is_a_value_error(fn, device):
    """2**32 must not wrap around to device 0; a device the library does
    not have is a ValueError too (the simulator has 2)."""
    with pytest.raises(ValueError) as info:
        fn(device)
    assert isinstance(info.value, cudapool.InvalidDeviceError)
    assert isinstance(info.value, cudapool.CudapoolError)


@pytest.mark.parametrize("fn", DEVICE_FUNCTIONS)
@pytest.mark.parametrize("device", [1.0, "1", b"cuda:0", [0], object(), True, False])
def test_device_of_a_wrong_type(fn, device):
    with pytest.raises((TypeError, ValueError)) as info:
        fn(device)
    if not isinstance(device, str):
        assert isinstance(info.value, TypeError), info.value


@pytest.mark.parametrize("device", ["cuda:1\0", "cuda:\0", "cuda:１", "cpu"])
def test_device_strings_checked(device):
    with pytest.raises(ValueError):
        cudapool.memory_allocated(device)


def test_valid_devices_still_work(allocs):
    p = allocs.malloc(4096, device=1)
    assert cudapool.memory_allocated(1) == 4096
    assert cudapool.memory_allocated("cuda:1") == 4096
    assert cudapool.memory_allocated(0) == 0
    assert isinstance(cudapool.snapshot(device=1), dict)
    assert cudapool.front_counters(1)["hits"] >= 0
    allocs.free(p)
    numpy = pytest.importorskip("numpy")
    assert cudapool.memory_allocated(numpy.int64(1)) == 0


def test_snapshot_of_a_device_that_does_not_exist():
    with pytest.raises(ValueError, match="cudapool has 2 devices"):
        cudapool.snapshot(device=7)
    with pytest.raises(ValueError):
        cudapool.snapshot(device="cuda:2")


# ---- configuration strings -------------------------------------------------


@pytest.mark.parametrize("conf", [None, 1, b"max_split_size_mb:64", ["max_split_size_mb:64"]])
def test_configure_takes_a_str(conf):
    with pytest.raises(TypeError, match="must be a str"):
        cudapool.configure(conf)


def test_configure_refuses_a_nul_instead_of_cutting_the_string():
    cudapool.configure("max_split_size_mb:64")
    with pytest.raises(ValueError, match="NUL"):
        cudapool.configure("max_split_size_mb:128\0,bogus:1")
    assert cudapool.memory_stats()["max_split_size"] == 64 * MiB, "nothing applied"


def test_unknown_and_wrongly_cased_keys_are_errors():
    cudapool.configure("max_split_size_mb:64")
    with pytest.raises(cudapool.CudapoolError) as info:
        cudapool.configure("Expandable_Segments:True")
    msg = str(info.value)
    assert msg.startswith('cudapool_configure: unknown key "Expandable_Segments"')
    assert 'did you mean "expandable_segments"?' in msg
    assert "max_split_size_mb" in msg and "record_history" in msg, "the known keys are listed"
    with pytest.raises(cudapool.CudapoolError, match='unknown key "bogus"'):
        cudapool.configure("max_split_size_mb:128,bogus:1")
    assert cudapool.memory_stats()["max_split_size"] == 64 * MiB, "the settings in force stay"
    cudapool.configure("pinned_use_cuda_host_register:True,pinned_num_register_threads:8")  # PyTorch's: accepted


def test_a_long_bad_configuration_is_shown_cut():
    with pytest.raises(cudapool.CudapoolError) as info:
        cudapool.configure("max_split_size_mb:x" + "y" * 120_000)
    msg = str(info.value)
    assert len(msg) < 1000
    assert "... (120001 bytes)" in msg


def test_record_memory_history_types():
    with pytest.raises(TypeError):
        cudapool.record_memory_history("100")
    with pytest.raises(TypeError):
        cudapool.record_memory_history(1.5)
    with pytest.raises(ValueError):
        cudapool.record_memory_history(-1)
    cudapool.record_memory_history(10)
    cudapool.record_memory_history(None)


# ---- errors name the function called ----------------------------------------


def test_errors_name_the_c_function():
    with pytest.raises(cudapool.CudapoolError, match=r"^cudapool_free: "):
        _lib.free(0x7F0000001000, 4096, 0)
    with pytest.raises(cudapool.CudapoolError, match=r"^cudapool_memory_stats_json: device 2 does not exist"):
        _lib.memory_stats(2)


# ---- the environment's configuration ----------------------------------------

BAD_ENV = """
import cudapool
from cudapool import _lib
try:
    cudapool.memory_allocated(0)
    print("first: ok")
except cudapool.CudapoolError as e:
    print("first:", str(e)[:400])
print("second:", cudapool.memory_allocated(0))
print("max_split_size:", cudapool.memory_stats()["max_split_size"])
cudapool.configure("max_split_size_mb:64")
print("configured:", cudapool.memory_stats()["max_split_size"])
"""


@pytest.mark.parametrize(
    "var,value,want",
    [
        ("CUDAPOOL_CONF", "Expandable_Segments:True", 'unknown key "Expandable_Segments"'),
        ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:1", "max_split_size_mb=1 is too small"),
        ("CUDAPOOL_CONF", "max_split_size_mb:x" + "y" * 120_000, "... (120001 bytes)"),
    ],
)
def test_a_bad_environment_configuration_fails_once(var, value, want):
    env = {"CUDAPOOL_BACKEND": "sim", "CUDAPOOL_SIM_DEVICES": "1", var: value}  # (the tests run without CUDAPOOL_CONF)
    r = run_code(BAD_ENV, env=env)
    assert r.returncode == 0, r.stderr
    lines = dict(line.split(": ", 1) for line in r.stdout.splitlines())
    assert lines["first"].startswith(f"cudapool_memory_stats_json: {var}: "), r.stdout
    assert want in lines["first"]
    assert lines["second"] == "0", "later calls work"
    assert lines["max_split_size"] == "-1", "with the default configuration"
    assert lines["configured"] == str(64 * MiB)
    assert r.stderr.count(want) == 1, f"printed once on stderr: {r.stderr[:2000]}"
    assert len(r.stderr) < 2000
