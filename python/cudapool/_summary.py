# SPDX-License-Identifier: Apache-2.0
"""memory_summary(): the table torch.cuda.memory_summary() prints, from a
flat stats dict. Written for cudapool; the layout matches PyTorch's so that
people and tools reading one can read the other."""

_WIDTH = 75


def _fmt_size(n, pref):
    """Byte count in a 10-character cell, scaled by the row's first value."""
    units = ("B  ", "KiB", "MiB", "GiB", "TiB", "PiB")
    unit = units[0]
    for nxt in units[1:]:
        if pref < 768 * 1024:
            break
        unit = nxt
        n //= 1024
        pref /= 1024
    return f"{n:6d} {unit}"


def _fmt_count(n, pref):
    """Count in a 10-character cell, scaled by the row's first value."""
    units = (" ", "K", "M")
    unit = units[0]
    for nxt in units[1:]:
        if pref < 750 * 1000:
            break
        unit = nxt
        n //= 1000
        pref /= 1000
    return f"{n:7d} {unit} "


_POOLED = (
    ("allocated_bytes", "Allocated memory", _fmt_size),
    ("active_bytes", "Active memory", _fmt_size),
    ("requested_bytes", "Requested memory", _fmt_size),
    ("reserved_bytes", "GPU reserved memory", _fmt_size),
    ("inactive_split_bytes", "Non-releasable memory", _fmt_size),
    ("allocation", "Allocations", _fmt_count),
    ("active", "Active allocs", _fmt_count),
    ("segment", "GPU reserved segments", _fmt_count),
    ("inactive_split", "Non-releasable allocs", _fmt_count),
)
_SINGLE = (
    ("oversize_allocations", "Oversize allocations", _fmt_count),
    ("oversize_segments", "Oversize GPU segments", _fmt_count),
)
_METRICS = ("current", "peak", "allocated", "freed")


def _row(name, values, prefs, fmt):
    cells = " | ".join(fmt(v, p) for v, p in zip(values, prefs))
    return f" {name:<21} | {cells} "


def format_summary(stats, device, abbreviated=False):
    """Render stats (flat, torch.cuda.memory_stats() keys) for device."""
    rule, double = "-" * _WIDTH, "=" * _WIDTH
    lines = [
        double,
        " " * 17 + f" PyTorch CUDA memory summary, device ID {device:<17d} ",
        rule,
        " " * 12 + f"CUDA OOMs: {stats['num_ooms']:<12d} | "
        + " " * 7 + f"cudaMalloc retries: {stats['num_alloc_retries']:<8d}  ",
        double,
        "        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  ",
    ]
    for key, name, fmt in _POOLED:
        lines.append(rule)
        rows = [("all", name)]
        if not abbreviated:
            rows += [("large_pool", "      from large pool"), ("small_pool", "      from small pool")]
        prefs = None
        for pool, label in rows:
            values = [stats[f"{key}.{pool}.{m}"] for m in _METRICS]
            if prefs is None:
                prefs = values
            lines.append(_row(label, values, prefs, fmt))
    for key, name, fmt in _SINGLE:
        lines.append(rule)
        values = [stats[f"{key}.{m}"] for m in _METRICS]
        lines.append(_row(name, values, values, fmt))
    lines.append(double)
    return "|" + "|\n|".join(lines) + "|\n"
