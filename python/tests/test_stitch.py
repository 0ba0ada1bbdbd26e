# SPDX-License-Identifier: Apache-2.0
"""Stitching through the library (on the simulator): free pages of holes
move to a request that no hole fits, reserved memory stays, the snapshot
counts the moves; on by default (expandable_segments:False turns it off
with expandable segments, stitch:False alone); bad values of the keys are
refused with a clear error."""

import pytest

import cudapool
from cudapool import _lib

MiB = 1 << 20


def remaps():
    s = cudapool.snapshot()["allocator_settings"]
    return s["stitch_remaps"][0], s["stitch_lent"][0]


@pytest.mark.parametrize("conf", ["", "expandable_segments:True", "stitch:True"], ids=["default", "expandable", "stitch"])
def test_holes_feed_a_larger_request(allocs, conf):
    cudapool.configure(",".join(c for c in (conf, "expandable_map_unit_mb:2") if c))
    settings = cudapool.snapshot()["allocator_settings"]
    assert settings["stitch"] is True and settings["expandable_segments"] is True
    h1 = allocs.malloc(10 * MiB)
    allocs.malloc(2 * MiB)
    h2 = allocs.malloc(10 * MiB)
    allocs.malloc(2 * MiB)
    allocs.free(h1)
    allocs.free(h2)
    reserved = cudapool.memory_reserved(0)
    assert reserved == 24 * MiB
    before = remaps()
    big = allocs.malloc(16 * MiB)
    assert cudapool.memory_reserved(0) == reserved, "no new memory: the holes' pages moved"
    after = remaps()
    assert after[0] - before[0] == 8
    assert _lib.base_allocation(big)[1] >= 16 * MiB


def test_without_stitching_the_request_maps_new_memory(allocs):
    cudapool.configure("expandable_segments:True,stitch:False,expandable_map_unit_mb:2")
    before = remaps()  # (the counts are the library's, since it started)
    h1 = allocs.malloc(10 * MiB)
    allocs.malloc(2 * MiB)
    allocs.free(h1)
    allocs.malloc(16 * MiB)
    assert cudapool.memory_reserved(0) == 12 * MiB + 16 * MiB
    assert remaps() == before


@pytest.mark.parametrize("conf,msg", [("stitch:maybe", "expected True or False"),
                                      ("expandable_map_unit_mb:3", "positive multiple of 2"),
                                      ("expandable_map_unit_mb:abc", "non-negative integer")])
def test_bad_values_are_refused(conf, msg):
    with pytest.raises(cudapool.CudapoolError, match=msg):
        cudapool.configure(conf)


def settings():
    s = cudapool.snapshot()["allocator_settings"]
    return s["expandable_segments"], s["stitch"]


def test_on_by_default_and_turned_off_by_either_key():
    assert settings() == (True, True), "the default: expandable segments with stitching"
    assert cudapool.snapshot()["allocator_settings"]["PYTORCH_CUDA_ALLOC_CONF"] == ""
    cudapool.configure("expandable_segments:False")
    assert settings() == (False, False), "expandable_segments:False: ordinary segments, stitching off with them"
    cudapool.configure("expandable_segments:True")
    assert settings() == (True, True), "stitching follows expandable_segments"
    cudapool.configure("stitch:False")
    assert settings() == (True, False), "stitch:False keeps expandable segments without stitching"
    cudapool.configure("expandable_segments:True,stitch:False")
    assert settings() == (True, False)
    cudapool.configure("stitch:True")
    assert settings() == (True, True), "stitch:True alone implies expandable segments"
    cudapool.configure("")
    assert settings() == (True, True), "back to the defaults"


@pytest.mark.parametrize("conf", ["stitch:True,expandable_segments:False", "expandable_segments:False,stitch:True"])
def test_contradictory_pair_is_refused(conf):
    cudapool.configure("expandable_segments:True")
    with pytest.raises(cudapool.CudapoolError, match="stitch:True and expandable_segments:False contradict each other"):
        cudapool.configure(conf)
    assert settings() == (True, True), "the configuration in force stays"
