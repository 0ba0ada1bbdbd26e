# SPDX-License-Identifier: Apache-2.0
"""python -m cudapool [--no-patch] SCRIPT [ARGS...]
python -m cudapool [--no-patch] -m MODULE [ARGS...]

Runs an unchanged program with cudapool installed as PyTorch's CUDA
allocator, as `python SCRIPT ARGS...` would run it."""

import os
import runpy
import sys

USAGE = "usage: " + __doc__.split("\n\n")[0].replace("\n", "\n       ") + "\n"


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    patch = True
    module = None
    while argv and argv[0].startswith("-"):
        opt = argv.pop(0)
        if opt in ("-h", "--help"):
            sys.stdout.write(__doc__.strip() + "\n\nOptions:\n"
                             "  --no-patch  leave torch.cuda's statistics functions alone\n"
                             "  -m MODULE   run a module, as python -m does\n")
            return 0
        if opt == "--no-patch":
            patch = False
        elif opt == "-m" and argv:
            module = argv.pop(0)
            break
        elif opt == "--":
            break
        else:
            sys.stderr.write(f"cudapool: unknown option {opt!r}\n{USAGE}")
            return 2
    if module is None and not argv:
        sys.stderr.write(USAGE)
        return 2

    if module is None and not os.path.exists(argv[0]):
        sys.stderr.write(f"cudapool: can't open file {argv[0]!r}: no such file\n")
        return 2

    import cudapool

    try:
        cudapool.install(patch_torch=patch)
    except cudapool.CudapoolError as e:
        sys.stderr.write(f"cudapool: error: {e}\n")
        return 1

    if module is not None:
        sys.argv = [module] + argv
        sys.path.insert(0, os.getcwd())
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    script, args = argv[0], argv[1:]
    sys.argv = [script] + args
    # As `python script.py` does: the script's directory comes first on sys.path.
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
