# SPDX-License-Identifier: Apache-2.0
"""The package's version and the library ABI it needs. VERSION at the
repository root is the one version string: this file, capi/version.go and
include/cudapool.h copy it (capi/version_test.go checks that they agree).
Kept free of imports: setuptools reads __version__ from here without
importing the package."""

__version__ = "0.1.0"

#: The C ABI version (CUDAPOOL_ABI_VERSION) the package's bindings are written for.
ABI_VERSION = 1
