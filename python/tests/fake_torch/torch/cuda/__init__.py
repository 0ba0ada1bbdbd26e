# SPDX-License-Identifier: Apache-2.0
import torch

from . import memory
from .memory import (  # noqa: F401  (re-exported, as torch.cuda does)
    max_memory_allocated, max_memory_reserved, memory_allocated, memory_reserved, memory_snapshot,
    memory_stats, memory_stats_as_nested_dict, memory_summary, reset_accumulated_memory_stats,
    reset_peak_memory_stats)

_initialized = False


def is_initialized():
    return _initialized


def current_device():
    return 0


def init():
    global _initialized
    _initialized = True
    torch.log.append("cuda_init")
