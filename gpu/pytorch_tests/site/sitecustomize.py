# SPDX-License-Identifier: Apache-2.0
"""Makes cudapool PyTorch's CUDA allocator in every Python process that
starts with this directory on PYTHONPATH and CUDAPOOL_AUTOINSTALL=1, so
that the subprocesses PyTorch's tests start get it too (run.sh sets both).

Python imports the first ``sitecustomize`` on sys.path at start-up (module
``site``); PYTHONPATH entries come first, so this file shadows any other
sitecustomize (Debian/Ubuntu ship one), which it then runs itself.

    CUDAPOOL_AUTOINSTALL=1          install: cudapool.install(cpp_class=True)
    CUDAPOOL_AUTOINSTALL_LOG=FILE   append one line per process: "ok PID MODE ARGV"
                                    or "FAILED PID ERROR ARGV" (run.sh's report counts them)
    CUDAPOOL_AUTOINSTALL_STRICT=1   a failed install ends the process (exit status 86)
                                    instead of letting it go on with PyTorch's allocator

A failure is printed to stderr and re-raised; Python's ``site`` then prints
"Error in sitecustomize" and the process goes on with PyTorch's own
allocator, unless CUDAPOOL_AUTOINSTALL_STRICT=1.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _log(line):
    path = os.environ.get("CUDAPOOL_AUTOINSTALL_LOG")
    if not path:
        return
    try:  # sys.argv is not set yet while site runs
        with open("/proc/self/cmdline", "rb") as f:
            argv = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        argv = " ".join(getattr(sys, "argv", None) or ["?"])
    argv = argv[:300].replace("\n", " ")
    try:
        with open(path, "a") as f:  # one short write per line: concurrent processes do not interleave
            f.write(f"{line} {argv}\n")
    except OSError:
        pass


def _run_shadowed():
    """Run the sitecustomize this file hides, if there is one."""
    try:
        import importlib.machinery
        import importlib.util

        rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
        if spec is None or spec.origin is None or spec.loader is None:
            return
        if os.path.abspath(spec.origin) == os.path.abspath(__file__):
            return
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as e:  # as site would: report it, go on
        sys.stderr.write(f"cudapool sitecustomize: the shadowed sitecustomize failed: {e!r}\n")


def _autoinstall():
    if os.environ.get("CUDAPOOL_AUTOINSTALL") != "1":
        return
    try:
        import cudapool

        cudapool.install(cpp_class=True)
    except BaseException as e:
        msg = f"{type(e).__name__}: {e}".replace("\n", " ")
        sys.stderr.write(f"cudapool sitecustomize: cudapool.install(cpp_class=True) failed in process {os.getpid()}: {msg}\n")
        _log(f"FAILED {os.getpid()} [{msg[:300]}]")
        if os.environ.get("CUDAPOOL_AUTOINSTALL_STRICT") == "1":
            sys.stderr.flush()
            os._exit(86)
        raise
    _log(f"ok {os.getpid()} {cudapool.mode()}")


_run_shadowed()
_autoinstall()
