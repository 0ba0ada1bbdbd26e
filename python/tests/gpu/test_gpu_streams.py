# SPDX-License-Identifier: Apache-2.0
"""record_stream across a side stream, and allocation from many threads."""

import concurrent.futures
import gc
import random

import pytest

import gpu_common

torch = gpu_common.require_cuda()
import cudapool  # noqa: E402

N = 1 << 22  # 16 MiB of float32
SLEEP_CYCLES = 1_000_000_000  # ~0.5 s of GPU time


@pytest.fixture(autouse=True)
def installed():
    gpu_common.require_installed()
    yield
    gc.collect()
    torch.cuda.synchronize()


def test_record_stream_prevents_early_reuse():
    # Load every kernel first: CUDA's lazy module loading synchronizes the
    # context on a kernel's first launch, which would end the sleep early.
    warm = torch.ones(N, device="cuda") * 1
    torch.cuda._sleep(1)
    del warm
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    x = torch.ones(N, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)  # the side stream reads x late
        out = x * 1
        busy = torch.cuda.Event()
        busy.record(side)
    x.record_stream(side)
    ptr = x.data_ptr()
    del x
    z = torch.empty(N, device="cuda")  # default stream, runs at once
    still_busy = not busy.query()
    z.fill_(7.0)
    reused = z.data_ptr() == ptr
    torch.cuda.synchronize()
    assert still_busy, "inconclusive: the side stream finished before the allocation"
    assert not reused, "x's memory was handed out while the side stream still used it"
    assert bool((out == 1).all()), "the side stream read overwritten data"


def test_without_record_stream_the_block_is_reused_at_once():
    """The control: the caching allocator reuses a freed block on its stream."""
    x = torch.ones(N, device="cuda")
    ptr = x.data_ptr()
    del x
    z = torch.empty(N, device="cuda")
    assert z.data_ptr() == ptr


def test_threads_allocate_concurrently():
    torch.cuda.synchronize()
    base = cudapool.memory_allocated()

    def work(i):
        rng = random.Random(i)
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            live = []
            for _ in range(150):
                n = rng.choice([1, 100, 4096, 300_000, 3_000_000])
                t = torch.full((n,), float(i), device="cuda")
                live.append((t, n))
                if len(live) > 8:
                    t, n = live.pop(rng.randrange(len(live)))
                    assert t.sum().item() == float(i) * n
            s.synchronize()
        return i

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert sorted(pool.map(work, range(8))) == list(range(8))
    gc.collect()
    torch.cuda.synchronize()
    assert cudapool.memory_allocated() == base
