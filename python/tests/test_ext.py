# SPDX-License-Identifier: Apache-2.0
"""The C++ allocator class's build and the fallback when it cannot be built
(no torch here: a stand-in torch without headers, or a fake unpacked torch
tree). Compiling against real torch headers is checked by
.ci/torch_ext_compile.sh and on the GPU machine."""

import os

import pytest

from cudapool import _ext
from helpers import run_code


def _touch(path, text=""):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def test_cuda_headers_from_toolkit_home(tmp_path):
    home = tmp_path / "cuda"
    _touch(str(home / "include" / "cuda_runtime_api.h"))
    assert _ext.cuda_include_dirs(env={"CUDA_HOME": str(home)}, search_path=[]) == [str(home / "include")]


def test_cuda_headers_from_nvidia_pip_packages(tmp_path):
    if os.path.isfile("/usr/local/cuda/include/cuda_runtime_api.h"):
        pytest.skip("this machine has a CUDA toolkit in /usr/local/cuda, which is preferred")
    site = tmp_path / "site"
    env = {"CUDA_HOME": str(tmp_path / "none")}
    _touch(str(site / "nvidia" / "cu13" / "include" / "cuda_runtime_api.h"))
    # The runtime alone is not enough: cuda_runtime.h needs crt/host_config.h.
    assert _ext.cuda_include_dirs(env=env, search_path=[str(site)]) == []
    _touch(str(site / "nvidia" / "cu13" / "include" / "crt" / "host_config.h"))
    assert _ext.cuda_include_dirs(env=env, search_path=[str(site)]) == [str(site / "nvidia" / "cu13" / "include")]


def test_build_without_cuda_headers_says_what_to_install(tmp_path):
    torch_dir = tmp_path / "torch"
    _touch(str(torch_dir / "version.py"), "__version__ = '9.9.9'\n")
    with pytest.raises(_ext.ExtensionUnavailable, match="nvidia-cuda-runtime nvidia-cuda-crt"):
        _ext.build(torch_dir=str(torch_dir), cuda_include=[], abi=1, out=str(tmp_path / "x.so"))


def test_build_failure_reports_the_compiler_error(tmp_path):
    torch_dir = tmp_path / "torch"
    _touch(str(torch_dir / "version.py"), "__version__ = '9.9.9'\n")
    inc = tmp_path / "cuda"
    _touch(str(inc / "cuda_runtime_api.h"))
    with pytest.raises(_ext.ExtensionUnavailable) as e:
        _ext.build(torch_dir=str(torch_dir), cuda_include=[str(inc)], abi=1, out=str(tmp_path / "x.so"))
    msg = str(e.value)
    assert "against torch 9.9.9 failed" in msg and "error" in msg
    assert not os.path.exists(tmp_path / "x.so")  # no half-written library is left


def test_install_falls_back_with_the_reason_once():
    out = run_code("""
        import torch, cudapool
        alloc = cudapool.install()
        cudapool.install()
        assert cudapool.mode() == "pluggable", cudapool.mode()
        assert torch.cuda.memory._current is alloc
        print("ok")
    """, torch="fake")
    assert out.returncode == 0, out.stderr
    note = [l for l in out.stderr.splitlines() if "CUDAPluggableAllocator path" in l]
    assert len(note) == 1, out.stderr
    assert "ships no C++ headers" in note[0] and "reduce-overhead" in note[0]


def test_install_requiring_the_class_fails_clearly():
    out = run_code("""
        import cudapool
        try:
            cudapool.install(cpp_class=True)
        except cudapool.CudapoolError as e:
            print("ERR", e)
        assert cudapool.mode() is None
    """, torch="fake")
    assert out.returncode == 0, out.stderr
    assert "ERR cudapool.install(cpp_class=True): the C++ allocator class is unavailable" in out.stdout


def test_env_disables_the_class():
    out = run_code("""
        import cudapool
        cudapool.install()
        print(cudapool.mode())
    """, torch="fake", env={"CUDAPOOL_TORCH_EXT": "0"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "pluggable"
    assert "disabled by CUDAPOOL_TORCH_EXT=0" in out.stderr


def _fake_compiler(tmp_path):
    """A stand-in C++ compiler: logs its arguments, one line per call, and
    writes an empty output file."""
    log = tmp_path / "cxx.log"
    cxx = tmp_path / "cxx"
    cxx.write_text('#!/bin/sh\necho "$@" >> "%s"\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && : > "$2"; shift; done\n'
                   "exit 0\n" % log)
    cxx.chmod(0o755)
    return str(cxx), log


def test_build_caches_by_source_and_what_it_includes(tmp_path, monkeypatch):
    # Another translation unit (the benchmark's build, which includes the
    # class's source) is cached under its own name and keyed by the files it
    # includes: it never collides with the shipped class's build.
    monkeypatch.setenv("CUDAPOOL_CACHE", str(tmp_path / "cache"))
    cxx, log = _fake_compiler(tmp_path)
    torch_dir = tmp_path / "torch"
    _touch(str(torch_dir / "version.py"), "__version__ = '9.9.9'\n")
    inc = tmp_path / "cuda"
    _touch(str(inc / "cuda_runtime_api.h"))
    lib = tmp_path / "lib" / "libcudapool.so"
    _touch(str(lib))
    other = tmp_path / "other.cpp"
    other.write_text('#include "torch_allocator.cpp"\n')
    dep = tmp_path / "dep.inc"
    dep.write_text("a\n")
    kw = dict(torch_dir=str(torch_dir), cuda_include=[str(inc)], abi=1, library=str(lib), cxx=cxx)

    shipped = _ext.build(**kw)
    variant = _ext.build(source=str(other), name="variant", include=[str(tmp_path / "csrc")], depends=[str(dep)], **kw)
    assert os.path.basename(shipped).startswith("cudapool_torch_") and os.path.isfile(shipped)
    assert os.path.basename(variant).startswith("variant_") and os.path.isfile(variant)
    assert os.path.dirname(shipped) == os.path.dirname(variant) == _ext.cache_dir()
    calls = log.read_text().splitlines()
    assert len(calls) == 2
    assert _ext.source_path() in calls[0].split() and str(other) not in calls[0]
    assert str(other) in calls[1].split() and _ext.source_path() not in calls[1].split()
    assert "-I " + str(tmp_path / "csrc") in calls[1]

    # Cached: no compilation; a changed included file is a new build.
    assert _ext.build(**kw) == shipped
    assert _ext.build(source=str(other), name="variant", depends=[str(dep)], include=[str(tmp_path / "csrc")], **kw) == variant
    assert len(log.read_text().splitlines()) == 2
    dep.write_text("b\n")
    again = _ext.build(source=str(other), name="variant", depends=[str(dep)], include=[str(tmp_path / "csrc")], **kw)
    assert again != variant and len(log.read_text().splitlines()) == 3


def test_shipped_class_has_no_benchmark_code():
    # The benchmark's switches live in its own build
    # (bench/torch_allocator_bench.cpp); the class every user loads has none.
    with open(_ext.source_path()) as f:
        src = f.read().lower()
    for word in ("passthrough", "timing", "rdtsc", "samples"):
        assert word not in src, word
