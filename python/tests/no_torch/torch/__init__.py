# SPDX-License-Identifier: Apache-2.0
# Makes `import torch` fail, to test cudapool without PyTorch on machines
# that have it.
raise ImportError("No module named 'torch' (hidden by cudapool's tests)")
