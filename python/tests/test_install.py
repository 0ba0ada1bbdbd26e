# SPDX-License-Identifier: Apache-2.0
"""install() and allocator() against a stand-in torch (tests/fake_torch)
that mimics PyTorch 2.11's pluggable-allocator surface; each case runs in a
fresh process, as install() must come before CUDA initialization."""

import pytest

from helpers import run_code


def check(code, **kw):
    out = run_code(code, torch="fake", **kw)
    assert out.returncode == 0, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    return out


def test_install_sets_every_hook():
    check("""
        import ctypes, torch, cudapool
        from cudapool import _lib
        alloc = cudapool.install()
        assert cudapool.installed()
        hooks = alloc._allocator
        assert hooks.alloc_fn == _lib.address("cudapool_torch_malloc")
        assert hooks.free_fn == _lib.address("cudapool_torch_free")
        expected = {
            "set_init_fn": "cudapool_init",
            "set_reset_fn": "cudapool_empty_cache",
            "set_memory_fraction_fn": "cudapool_set_memory_fraction",
            "set_base_alloc_fn": "cudapool_base_allocation",
            "set_record_stream_fn": "cudapool_record_stream",
            "set_begin_allocate_to_pool": "cudapool_torch_begin_allocate_to_pool",
            "set_end_allocate_to_pool_fn": "cudapool_torch_end_allocate_to_pool",
            "set_release_pool": "cudapool_torch_release_pool",
        }
        assert hooks.hooks == {k: _lib.address(v) for k, v in expected.items()}, hooks.hooks
        assert len(set(hooks.hooks.values())) == 8
        # torch's dlopen and ours are the same library instance
        assert alloc.handle == _lib.load()._handle
        assert torch.cuda.memory._current is alloc
        # the hooks are set before the allocator becomes current
        assert torch.log[-1] == "change_current_allocator", torch.log
        assert cudapool.install() is alloc  # idempotent
        assert torch.log.count("change_current_allocator") == 1
        """)


def test_install_after_cuda_init_is_refused():
    out = run_code("""
        import torch, cudapool
        torch.cuda.init()
        try:
            cudapool.install()
        except cudapool.CudapoolError as e:
            print(e)
        else:
            raise SystemExit("install() did not refuse")
        assert not cudapool.installed()
        assert "change_current_allocator" not in torch.log
        """, torch="fake")
    assert out.returncode == 0, out.stderr
    assert "before CUDA is initialized" in out.stdout
    assert "python -m cudapool" in out.stdout


def test_install_without_torch_says_torch_is_required():
    out = run_code("""
        import cudapool
        try:
            cudapool.install()
        except cudapool.CudapoolError as e:
            print(e)
        try:
            cudapool.allocator()
        except cudapool.CudapoolError as e:
            print(e)
        print(cudapool.memory_stats()["num_ooms"])  # stats need no torch
        """, torch="none")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "cudapool.install() requires PyTorch" in lines[0]
    assert "cudapool.allocator() requires PyTorch" in lines[1]
    assert lines[2] == "0"


def test_torch_statistics_are_routed_to_cudapool():
    check("""
        import torch, cudapool
        from cudapool import _lib
        cudapool.install()
        for mod in (torch.cuda, torch.cuda.memory):
            assert mod.memory_stats is cudapool.memory_stats
            assert mod.memory_summary is cudapool.memory_summary
            assert mod.reset_peak_memory_stats is cudapool.reset_peak_memory_stats
        assert torch.cuda.memory._snapshot is cudapool.snapshot
        p = _lib.malloc(5 << 20)
        assert torch.cuda.memory_allocated() == 5 << 20
        assert torch.cuda.memory.memory_allocated(0) == 5 << 20
        assert torch.cuda.max_memory_reserved() == 20 << 20
        assert len(torch.cuda.memory_stats()) == 122
        assert "PyTorch CUDA memory summary" in torch.cuda.memory_summary()
        torch.cuda.memory._record_memory_history(max_entries=50)
        assert torch.cuda.memory._snapshot()["allocator_settings"]["record_history"] == 50
        torch.cuda.memory._record_memory_history(True, trace_alloc_max_entries=7)
        assert cudapool.snapshot()["allocator_settings"]["record_history"] == 7
        torch.cuda.memory._record_memory_history(None)
        assert cudapool.snapshot()["allocator_settings"]["record_history"] == 0
        assert torch.cuda.memory_snapshot()[0]["segment_type"] == "large"
        _lib.free(p, 5 << 20)
        torch.cuda.reset_peak_memory_stats()
        assert torch.cuda.max_memory_allocated() == 0
        """)


def test_patch_torch_false_leaves_torch_alone():
    check("""
        import torch, cudapool
        original = torch.cuda.memory_stats
        cudapool.install(patch_torch=False)
        assert torch.cuda.memory_stats is original
        assert torch.cuda.memory._snapshot is not cudapool.snapshot
        cudapool.install()  # patching later is allowed
        assert torch.cuda.memory_stats is cudapool.memory_stats
        """)


def test_allocator_is_for_mem_pools_and_needs_no_install():
    check("""
        import torch, cudapool
        from cudapool import _lib
        a = cudapool.allocator()
        assert a.allocator().alloc_fn == _lib.address("cudapool_malloc")  # NULL on failure
        assert a.allocator().free_fn == _lib.address("cudapool_free")
        assert cudapool.allocator() is a
        assert not cudapool.installed()
        assert "change_current_allocator" not in torch.log
        """)


@pytest.mark.parametrize("symbol", ["cudapool_torch_malloc", "cudapool_torch_begin_allocate_to_pool",
                                    "cudapool_torch_end_allocate_to_pool", "cudapool_torch_release_pool"])
def test_torch_entry_points_are_exported(symbol):
    from cudapool import _lib

    assert _lib.address(symbol)
