# SPDX-License-Identifier: Apache-2.0
"""Data integrity across stitching (stitch:True, docs/fragmentation.md): kernels write a
known pattern into every live block, pages move between ranges while the
GPU is still running queued work (loaned pages of the allocating stream) and
after a side stream's work has finished (pages unmapped and mapped again),
and every live block's pattern is read back. The work runs in a fresh
process with CUDAPOOL_CONF=stitch:True (the configuration is read when
cudapool starts)."""

import json

import gpu_common

torch = gpu_common.require_cuda()

CHILD = r'''
import json, random, sys
import cudapool
cudapool.install()
import torch

MiB = 1 << 20
SLEEP = 200_000_000  # ~0.1 s of GPU time: the GPU runs behind the host
rng = random.Random(12)
dev = torch.device("cuda")
side = torch.cuda.Stream()

def pattern(n, seed, stream=None):
    # Position-dependent: a page mapped at the wrong place, or shared with
    # another live block, shows.
    idx = torch.arange(n // 4, device=dev, dtype=torch.int32)
    return idx * 7 + seed

live = {}  # seed -> (tensor, stream)
seeds = iter(range(1, 1 << 30))

def alloc(nbytes, stream):
    seed = next(seeds)
    with torch.cuda.stream(stream):
        t = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        t.view(torch.int32).copy_(pattern(nbytes, seed))
    live[seed] = (t, stream)
    return seed

def free(seed):
    t, stream = live.pop(seed)
    del t

def stitch_counts():
    s = cudapool.snapshot()["allocator_settings"]
    return s["stitch_remaps"][0], s["stitch_lent"][0]

checked = corrupt = 0
def verify():
    global checked, corrupt
    torch.cuda.synchronize()
    for seed, (t, stream) in live.items():
        checked += 1
        if not torch.equal(t.view(torch.int32), pattern(t.numel(), seed)):
            corrupt += 1
            print(f"corrupt block seed {seed} size {t.numel()}", file=sys.stderr)

main = torch.cuda.current_stream()
torch.cuda._sleep(1)  # load the kernels first (lazy loading synchronizes)
alloc(1 * MiB, main)
torch.cuda.synchronize()
phases = []
for rnd in range(6):
    # Grow: blocks of varied sizes on both streams, with small guards
    # between them so that freeing leaves holes no big request fits.
    for _ in range(24):
        s = main if rng.random() < 0.7 else side
        alloc(rng.choice([3, 5, 6, 10, 12]) * MiB + rng.randrange(0, MiB, 512), s)
        alloc(rng.randrange(512, 2 * MiB, 512), s)
    verify()
    # Free about half the big blocks: in even rounds of both streams, while
    # the GPU is busy on the main stream and writes to the freed main-stream
    # blocks are still queued (their pages can only be loaned, and a page
    # written late by the old owner would show in the new owner's pattern);
    # in odd rounds of the side stream only, whose work has finished (its
    # pages are unmapped and mapped again).
    side.synchronize()
    torch.cuda._sleep(SLEEP)
    for seed in [k for k, (t, s) in live.items() if t.numel() >= 3 * MiB and rng.random() < 0.5
                 and (rnd % 2 == 0 or s is side)]:
        t, s = live[seed]
        if s is main:
            t.fill_(0xEE)  # queued behind the sleep
        del t
        free(seed)
    before = stitch_counts()
    # Requests larger than any hole: above the high-water mark, pages move.
    for _ in range(4):
        alloc(rng.choice([24, 32, 40]) * MiB, main)
    after = stitch_counts()
    phases.append([after[0] - before[0], after[1] - before[1]])
    verify()
    # Now and then empty_cache: it unmaps the loaned pages' old mappings.
    if rnd % 3 == 2:
        for seed in [k for k in live if rng.random() < 0.3]:
            free(seed)
        torch.cuda.empty_cache()
        verify()
remaps, loaned = stitch_counts()
verify()
print(json.dumps({"remaps": remaps, "loaned": loaned, "phases": phases, "checked": checked, "corrupt": corrupt,
                  "conf": cudapool.snapshot()["allocator_settings"]["PYTORCH_CUDA_ALLOC_CONF"]}))
'''


def test_patterns_survive_stitching(tmp_path):
    proc = gpu_common.python(["-c", CHILD], env={"CUDAPOOL_CONF": "stitch:True,expandable_map_unit_mb:2"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    print(res)
    assert "stitch:True" in res["conf"]
    assert res["checked"] > 100
    assert res["corrupt"] == 0, proc.stderr[-4000:]
    assert res["remaps"] > 0, "no page moved: the test did not exercise stitching"
    assert res["loaned"] > 0, "no page was loaned: the GPU was never behind when pages moved"
    assert res["remaps"] > res["loaned"], "no page was unmapped and moved (the side stream's holes)"
