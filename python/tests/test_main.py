# SPDX-License-Identifier: Apache-2.0
"""python -m cudapool SCRIPT [ARGS...]"""

import textwrap

from helpers import run_python

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch, cudapool
    print(json.dumps({
        "argv": sys.argv,
        "name": __name__,
        "file": os.path.basename(__file__),
        "path0": sys.path[0],
        "installed": cudapool.installed(),
        "current": torch.cuda.memory._current is not None,
        "patched": torch.cuda.memory_stats is cudapool.memory_stats,
    }))
    if __name__ == "__main__":
        sys.exit(int(os.environ.get("EXIT_CODE", "0")))
""")


def write_script(tmp_path, name="train.py"):
    d = tmp_path / "scripts"
    d.mkdir(exist_ok=True)
    path = d / name
    path.write_text(SCRIPT)
    return path


def test_runs_a_script_as_main_with_cudapool_installed(tmp_path):
    import json

    script = write_script(tmp_path)
    out = run_python(["-m", "cudapool", str(script), "--lr", "0.1", "x"], torch="fake", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got == {"argv": [str(script), "--lr", "0.1", "x"], "name": "__main__", "file": "train.py",
                   "path0": str(script.parent), "installed": True, "current": True, "patched": True}


def test_exit_code_and_no_patch(tmp_path):
    import json

    script = write_script(tmp_path)
    out = run_python(["-m", "cudapool", "--no-patch", str(script)], torch="fake", env={"EXIT_CODE": "3"})
    assert out.returncode == 3, out.stderr
    got = json.loads(out.stdout)
    assert got["installed"] and not got["patched"]


def test_runs_a_module(tmp_path):
    import json

    write_script(tmp_path, "mymod.py")
    out = run_python(["-m", "cudapool", "-m", "mymod", "a"], torch="fake", cwd=tmp_path / "scripts")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["name"] == "__main__" and got["argv"][1:] == ["a"] and got["installed"]


def test_without_torch_fails_clearly(tmp_path):
    script = write_script(tmp_path)
    out = run_python(["-m", "cudapool", str(script)], torch="none")
    assert out.returncode == 1
    assert "requires PyTorch" in out.stderr
    assert out.stdout == ""  # the script did not run


def test_usage_errors(tmp_path):
    out = run_python(["-m", "cudapool"], torch="fake")
    assert out.returncode == 2 and out.stderr.startswith("usage: python -m cudapool")
    out = run_python(["-m", "cudapool", str(tmp_path / "missing.py")], torch="fake")
    assert out.returncode == 2 and "missing.py" in out.stderr
    out = run_python(["-m", "cudapool", "--bogus", "x.py"], torch="fake")
    assert out.returncode == 2 and "--bogus" in out.stderr
    out = run_python(["-m", "cudapool", "--help"], torch="fake")
    assert out.returncode == 0 and "--no-patch" in out.stdout
