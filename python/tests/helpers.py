# SPDX-License-Identifier: Apache-2.0
"""Running Python in a fresh process, with or without a (fake) torch."""

import os
import subprocess
import sys
import textwrap

TESTS = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.dirname(TESTS)
FAKE_TORCH = os.path.join(TESTS, "fake_torch")
NO_TORCH = os.path.join(TESTS, "no_torch")


def run_python(args, torch=None, cwd=None, env=None, timeout=120):
    """Run `python ARGS` with cudapool importable. torch: "fake" (the
    stand-in in fake_torch/), "none" (import torch fails) or None (as is)."""
    path = [PYTHON_DIR]
    if torch == "fake":
        path.insert(0, FAKE_TORCH)
    elif torch == "none":
        path.insert(0, NO_TORCH)
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env["PYTHONPATH"] = os.pathsep.join(path)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def run_code(code, **kw):
    return run_python(["-c", textwrap.dedent(code)], **kw)
