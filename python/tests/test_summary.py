# SPDX-License-Identifier: Apache-2.0
"""memory_summary(): torch.cuda.memory_summary()'s table."""

import pytest

import cudapool
from cudapool._summary import _fmt_count, _fmt_size, format_summary

MiB = 1 << 20


@pytest.mark.nolib
def test_cells_scale_like_pytorch():
    assert _fmt_size(0, 0) == "     0 B  "
    assert _fmt_size(1536, 1536) == "  1536 B  "
    assert _fmt_size(2 * MiB, 2 * MiB) == "  2048 KiB"
    assert _fmt_size(3 << 30, 3 << 30) == "  3072 MiB"
    # the row's first value picks the unit for the whole row
    assert _fmt_size(5 * MiB, 3 << 30) == "     5 MiB"
    assert _fmt_count(12, 12) == "     12   "
    assert _fmt_count(1_500_000, 1_500_000) == "   1500 K "
    assert _fmt_count(2_000_000_000, 2_000_000_000) == "   2000 M "


def _zero_stats():
    return {k: 0 for k in cudapool.memory_stats()}


def test_layout():
    stats = _zero_stats()
    stats.update({
        "num_ooms": 3,
        "num_alloc_retries": 7,
        "allocated_bytes.all.current": 3 << 30,
        "allocated_bytes.large_pool.current": (3 << 30) - MiB,
        "allocated_bytes.small_pool.current": MiB,
        "allocation.all.peak": 1_500_000,
        "oversize_segments.current": 2,
    })
    text = format_summary(stats, 1)
    lines = text.split("\n")
    assert text.endswith("|\n") and lines[-1] == ""
    lines = lines[:-1]
    assert all(len(line) == 77 and line[0] == "|" and line[-1] == "|" for line in lines)
    assert lines[0] == "|" + "=" * 75 + "|"
    assert lines[1] == "|" + " " * 18 + "PyTorch CUDA memory summary, device ID 1" + " " * 17 + "|"
    assert lines[3] == "|" + " " * 12 + "CUDA OOMs: 3            |" + " " * 8 + "cudaMalloc retries: 7         |"
    assert lines[5] == "|        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  |"
    assert lines[7] == "| Allocated memory      |   3072 MiB |      0 B   |      0 B   |      0 B   |"
    assert lines[8] == "|       from large pool |   3071 MiB |      0 B   |      0 B   |      0 B   |"
    assert lines[9] == "|       from small pool |      1 MiB |      0 B   |      0 B   |      0 B   |"
    assert "| Allocations           |       0    |    1500 K  |       0    |       0    |" in lines
    assert "| Oversize GPU segments |       2    |       0    |       0    |       0    |" in lines
    assert len(lines) == 6 + 9 * 4 + 2 * 2 + 1
    names = [line[2:23].strip() for line in lines if line[1] == " " and line[2] != " "]
    assert names == ["Allocated memory", "Active memory", "Requested memory", "GPU reserved memory",
                         "Non-releasable memory", "Allocations", "Active allocs", "GPU reserved segments",
                         "Non-releasable allocs", "Oversize allocations", "Oversize GPU segments"]


def test_abbreviated_has_no_pool_rows():
    text = format_summary(_zero_stats(), 0, abbreviated=True)
    assert "from large pool" not in text and "from small pool" not in text
    assert len(text.split("\n")) - 1 == 6 + 9 * 2 + 2 * 2 + 1


def test_live_summary(ordinary, allocs):
    allocs.malloc(5 * MiB, device=1)
    text = cudapool.memory_summary(device=1)
    assert "device ID 1" in text
    assert "| Allocated memory      |   5120 KiB |   5120 KiB |   5120 KiB |      0 B   |" in text
    assert "| GPU reserved segments |       1    |       1    |       1    |       0    |" in text
    assert "device ID 0" in cudapool.memory_summary()
