# SPDX-License-Identifier: Apache-2.0
"""GPU tests (PyTorch + CUDA). Each module must run in a fresh process
(python/gpu/run_gpu_tests.sh does), because cudapool.install() has to come
before CUDA is initialized: this conftest installs cudapool when it is
imported, before any test module touches CUDA, unless
CUDAPOOL_GPU_NO_INSTALL=1 (the MemPool module runs that way).

Without torch or CUDA every module skips itself (see gpu_common)."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.dirname(os.path.dirname(HERE))
for d in (PYTHON_DIR, os.path.join(PYTHON_DIR, "gpu")):
    if d not in sys.path:
        sys.path.insert(0, d)

import gpu_common  # noqa: E402

gpu_common.install_if_wanted()
