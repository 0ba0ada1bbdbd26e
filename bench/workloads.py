# SPDX-License-Identifier: Apache-2.0
"""Python twin of bench/workloads.h's size generator (no torch needed), and the
training benchmarks' warm-up lengths (warmup_lens).

torch_bench.py's mixed torch.empty workload uses the same sizes and slots as
the C programs' mixed workload: 256 live blocks, sizes 512 B - 144 MiB (an
exponent e in 9..27 drawn uniformly, then uniform in [2^e, 2^(e+1)); for
e = 27 in [128 MiB, 144 MiB)), from splitmix64 seeded with MIXED_SEED.
"""

HOT_SIZE = 4096
LIVE = 256
SEQ = 65536
MIXED_SEED = 0x5EED0001
MIN_EXP = 9
MAX_EXP = 27
TOP_SPAN = 16 << 20

_M64 = (1 << 64) - 1


def _splitmix64(state):
    """Returns (new_state, value), as wl_next in workloads.h."""
    state = (state + 0x9E3779B97F4A7C15) & _M64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return state, z ^ (z >> 31)


def mixed_sequence(n=SEQ):
    """The first n (size, slot) pairs of the mixed workload, as two lists."""
    st = MIXED_SEED
    sizes, slots = [], []
    nexp = MAX_EXP - MIN_EXP + 1
    for _ in range(n):
        st, r = _splitmix64(st)
        e = MIN_EXP + r % nexp
        lo = 1 << e
        span = TOP_SPAN if e == MAX_EXP else lo
        st, r = _splitmix64(st)
        sizes.append(lo + r % span)
        st, r = _splitmix64(st)
        slots.append(r % LIVE)
    return sizes, slots


def warmup_lens(lens, warmup):
    """The warm-up steps' lengths for timed steps lens[warmup:]: the first
    warmup of lens, then every timed length not among them, in order of first
    use. A length's first step costs every allocator 118-216 ms outside the
    allocator (plans and kernels for the new shapes; no driver allocation),
    over half of what 60 timed steps took when only
    5 warm-up steps ran; the timed steps then measured that, not training."""
    warm = list(lens[:warmup])
    seen = set(warm)
    for n in lens[warmup:]:
        if n not in seen:
            seen.add(n)
            warm.append(n)
    return warm
