# SPDX-License-Identifier: Apache-2.0
"""The README's examples, run so that they cannot rot.

Every ```c and ```python block of README.md is preceded by a marker:
<!-- example: sim --> (runs on the simulator: C is compiled with gcc
against lib/libcudapool.so and run, Python runs in a fresh interpreter
with CUDAPOOL_BACKEND=sim) or <!-- example: gpu --> (needs PyTorch with
CUDA, and whatever else it imports: run only where they are, skipped with
the reason otherwise). An unmarked block fails the test, so a new example
cannot escape it.
"""

import os
import re
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.nolib  # each example runs in a process of its own

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")
LIB_DIR = os.path.join(ROOT, "lib")
PYTHON_DIR = os.path.join(ROOT, "python")

FENCE = re.compile(r"^```(\w*)\s*$")
MARKER = re.compile(r"^<!--\s*example:\s*(\w+)\s*-->\s*$")


def examples(text):
    """[(language, mode or None, code, line)] of the README's ```c and
    ```python blocks; mode is the marker's, None for an unmarked block."""
    out = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or not m.group(1):
            i += 1
            continue
        lang, start = m.group(1), i
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        if lang in ("c", "python"):
            k = start - 1
            while k >= 0 and not lines[k].strip():
                k -= 1
            mm = MARKER.match(lines[k]) if k >= 0 else None
            out.append((lang, mm.group(1) if mm else None, "\n".join(lines[start + 1:j]) + "\n", start + 1))
        i = j + 1
    return out


with open(README, encoding="utf-8") as _f:
    EXAMPLES = examples(_f.read())


def _env(sim):
    env = {k: v for k, v in os.environ.items()
           if k not in ("CUDAPOOL_CONF", "PYTORCH_CUDA_ALLOC_CONF", "CUDAPOOL_BACKEND", "CUDAPOOL_LIBRARY")
           and not k.startswith("CUDAPOOL_SIM_")}
    env["PYTHONPATH"] = PYTHON_DIR + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if sim:
        env["CUDAPOOL_BACKEND"] = "sim"
    return env


def _library():
    lib = os.path.join(LIB_DIR, "libcudapool.so")
    if not os.path.isfile(lib):
        pytest.skip("lib/libcudapool.so is not built (run `make lib`)")
    return lib


def test_every_example_is_marked_and_some_run_on_the_simulator():
    assert EXAMPLES, "README.md has no ```c or ```python block"
    unmarked = [line for _, mode, _, line in EXAMPLES if mode not in ("sim", "gpu")]
    assert not unmarked, (f"README.md lines {unmarked}: precede each example with "
                          "<!-- example: sim --> or <!-- example: gpu -->")
    langs = {lang for lang, mode, _, _ in EXAMPLES if mode == "sim"}
    assert langs == {"c", "python"}, f"the simulator runs C and Python examples; found {sorted(langs)}"


def test_examples_parser():
    text = ("intro\n<!-- example: sim -->\n```c\nint main(void) { return 0; }\n```\n"
            "```sh\nmake\n```\n<!-- example: gpu -->\n\n```python\nimport torch\n```\n```python\nx = 1\n```\n")
    got = examples(text)
    assert [(lang, mode, line) for lang, mode, _, line in got] == [("c", "sim", 3), ("python", "gpu", 11),
                                                                   ("python", None, 14)]
    assert got[0][2] == "int main(void) { return 0; }\n"


def _ids():
    return [f"{lang}-{mode}-line{line}" for lang, mode, _, line in EXAMPLES]


@pytest.mark.parametrize("lang,mode,code,line", EXAMPLES, ids=_ids())
def test_readme_example(lang, mode, code, line, tmp_path):
    if mode not in ("sim", "gpu"):
        pytest.skip("unmarked (test_every_example_is_marked_and_some_run_on_the_simulator fails for it)")
    _library()
    if lang == "c":
        if mode != "sim":
            pytest.skip("C examples on the GPU are not run here")
        cc = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
        if cc is None:
            pytest.skip("no C compiler (gcc or cc)")
        src, exe = tmp_path / "example.c", tmp_path / "example"
        src.write_text(code)
        build = subprocess.run([cc, "-std=c11", "-Wall", "-Wextra", "-Werror", "-I", os.path.join(ROOT, "include"),
                                "-o", str(exe), str(src), "-L", LIB_DIR, "-lcudapool", f"-Wl,-rpath,{LIB_DIR}"],
                               capture_output=True, text=True)
        assert build.returncode == 0, f"README.md line {line}: the C example does not compile:\n{build.stderr}"
        cmd = [str(exe)]
    else:
        if mode == "gpu":
            _need_gpu(code)
        src = tmp_path / "example.py"
        src.write_text(code)
        cmd = [sys.executable, str(src)]
    run = subprocess.run(cmd, env=_env(mode == "sim"), cwd=str(tmp_path), capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, (f"README.md line {line}: the {lang} example failed (exit {run.returncode}):\n"
                                 f"{run.stdout}\n{run.stderr}")


def _need_gpu(code):
    """Skips unless PyTorch sees a CUDA device and every module the example
    imports or installs cudapool into is importable (checked in a fresh interpreter, as the example
    will run)."""
    mods = set(re.findall(r"^\s*import\s+(\w+)", code, re.M)) - {"cudapool"}
    mods |= {m for m in ("cupy", "numba") if f"{m}=True" in code}  # cudapool.install(cupy=True, numba=True)
    mods = sorted(mods)
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)"
    if mods:
        probe = f"import {', '.join(mods)}; " + probe
    r = subprocess.run([sys.executable, "-c", probe], env=_env(False), capture_output=True, text=True, timeout=300)
    if r.returncode == 3:
        pytest.skip("needs a GPU: torch.cuda.is_available() is False")
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        pytest.skip(f"needs {', '.join(mods) or 'torch'} with CUDA: {last}")
