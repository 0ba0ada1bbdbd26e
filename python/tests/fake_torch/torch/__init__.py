# SPDX-License-Identifier: Apache-2.0
"""A stand-in for PyTorch's pluggable-allocator surface, for testing
cudapool.install() on machines without torch. Only what cudapool touches
exists, with the names PyTorch 2.11 uses; calls are logged in `log`."""

from . import _C, cuda  # noqa: F401

__version__ = "0.0+fake"
log = []
