# SPDX-License-Identifier: Apache-2.0
"""Parity with PyTorch's own allocator for what needs cudapool's C++
allocator class: torch.compile(mode="reduce-overhead") (CUDA graph trees,
graph-pool checkpoints), cuDNN benchmark mode (cacheInfo), CUDA IPC, torch._C
statistics, memory history with stacks, OOM observers, MemPool, and settings
changed at run time.

Every scenario is a small script run twice, each time in a fresh Python
process: once natively (cudapool never imported) and once with
cudapool.install(cpp_class=True) at its start. The script prints one line
"PARITY-RESULT {json}"; the test checks the native result (so that the
scenario really exercises what it claims), then that cudapool's matches it.

A hang is a failure: each run has a timeout ($CUDAPOOL_PARITY_TIMEOUT
seconds, default 420) after which its whole process group is killed. The two
runs of a scenario go in parallel (different processes on the same GPU);
CUDAPOOL_PARITY_SERIAL=1 runs them one after the other.

Both runs get the same PYTORCH_CUDA_ALLOC_CONF, so that the two allocators
run in matching configurations (their defaults differ: cudapool's are
expandable segments with stitching): the one this module runs with, else
expandable_segments:False (native's default; cudapool's ordinary segments).
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True runs the other pair:
native's expandable segments against cudapool's default, with stitching.

run_gpu_tests.sh runs this module with CUDAPOOL_GPU_NO_INSTALL=1 (the pytest
process itself needs no allocator). One scenario:
    cd python && python -m pytest --confcutdir=tests/gpu tests/gpu/test_gpu_parity.py -k ipc
"""

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

import gpu_common

torch = gpu_common.require_cuda()

if os.environ.get("CUDAPOOL_TORCH_EXT") == "0":
    pytest.skip("CUDAPOOL_TORCH_EXT=0 turns off the C++ allocator class that these tests compare",
                allow_module_level=True)

MiB = gpu_common.MiB
MARK = "PARITY-RESULT "
TIMEOUT = int(os.environ.get("CUDAPOOL_PARITY_TIMEOUT", "420"))
PARALLEL = os.environ.get("CUDAPOOL_PARITY_SERIAL") != "1"
# The configuration both runs share (see the module's comment).
PAIR_CONF = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or "expandable_segments:False"
# Variables that would change either run's allocator: each scenario sets its own.
SCRUB = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CUDAPOOL_CONF", "CUDAPOOL_BACKEND",
         "CUDAPOOL_GPU_NO_INSTALL", "CUDAPOOL_AUTOINSTALL", "CUDAPOOL_TORCH_EXT")

# ---------------------------------------------------------------------------
# The scenario scripts: PRELUDE + scenario (defines main() -> dict) + EPILOGUE.
# The prelude runs at module level, so a spawned child (torch.multiprocessing)
# installs cudapool too before it touches CUDA.

PRELUDE = r'''
import json, os, sys
MODE = os.environ["CUDAPOOL_PARITY_MODE"]
if MODE == "cudapool":
    import cudapool
    cudapool.install(cpp_class=True)
    if cudapool.mode() != "class":
        raise SystemExit("cudapool.mode() is %r, not 'class'" % (cudapool.mode(),))
import torch
MiB = 1 << 20


def allocator_mode():
    return cudapool.mode() if MODE == "cudapool" else "native"
'''

EPILOGUE = r'''

if __name__ == "__main__":
    if MODE == "native" and "cudapool" in sys.modules:
        raise SystemExit("the native run imported cudapool")
    result = main()
    torch.cuda.synchronize()
    result["_mode"] = allocator_mode()
    if MODE == "cudapool":
        # cudapool's own counters: the memory really went through it (a
        # scenario may have reset the accumulated ones; cached segments stay)
        st = cudapool.memory_stats(0)
        result["_cudapool_allocations"] = max(st["allocation.all.allocated"], st["reserved_bytes.all.current"])
    print("PARITY-RESULT " + json.dumps(result, sort_keys=True), flush=True)
'''

# Counts the torch._C calls CUDA graph trees make into the allocator
# (cudagraph_trees.py looks them up on torch._C at each call), and the
# number of graphs recorded in the tree.
COMPILE_HELPERS = r'''
import copy
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from torch._inductor import cudagraph_trees

calls = {"get_checkpoint": 0, "set_checkpoint": 0, "check_pool": 0, "check_pool_false": 0}


def _count(name, key, false_key=None):
    orig = getattr(torch._C, name)

    def counted(*args, **kwargs):
        r = orig(*args, **kwargs)
        calls[key] += 1
        if false_key is not None and not r:
            calls[false_key] += 1
        return r

    setattr(torch._C, name, counted)


_count("_cuda_getCheckpointState", "get_checkpoint")
_count("_cuda_setCheckpointPoolState", "set_checkpoint")
_count("_cuda_checkPoolLiveAllocations", "check_pool", "check_pool_false")


def recorded_graphs():
    mgr = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    if mgr is None:
        return 0
    n, stack = 0, list(mgr.get_roots())
    while stack:
        node = stack.pop()
        n += 1
        for kids in node.children.values():
            stack.extend(kids)
    return n


def tree_facts():
    return {
        "graphs": recorded_graphs(),
        "skips": int(counters["inductor"]["cudagraph_skips"]),
        "cudagraph_trees": bool(inductor_config.triton.cudagraph_trees),
        "calls": dict(calls),
    }
'''

SCENARIOS = {}

# a. reduce-overhead inference: a conv body and two heads, two input shapes.
# head2 first runs after the tree has replayed (step 3), so the tree must
# checkpoint the pool (setCheckpointPoolState) to warm it up and record it.
SCENARIOS["compile_inference"] = COMPILE_HELPERS + r'''

def main():
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(256, 64), nn.ReLU()).cuda().eval()
    head1 = nn.Linear(64, 10).cuda().eval()
    head2 = nn.Linear(64, 5).cuda().eval()
    cbody, chead1, chead2 = (torch.compile(m, mode="reduce-overhead", dynamic=False) for m in (body, head1, head2))
    gen = torch.Generator(device="cuda").manual_seed(1)
    tol = dict(rtol=1e-3, atol=1e-4)
    checks, sums = 0, []
    with torch.no_grad():
        for shape in ((8, 3, 32, 32), (4, 3, 24, 24)):
            for step in range(6):
                torch.compiler.cudagraph_mark_step_begin()
                x = torch.randn(shape, device="cuda", generator=gen)
                feat = cbody(x)
                o1 = chead1(feat).clone()
                ref_feat = body(x)
                torch.testing.assert_close(feat, ref_feat, **tol)
                torch.testing.assert_close(o1, head1(ref_feat), **tol)
                sums.append(float(o1.double().sum()))
                if step >= 3:
                    o2 = chead2(feat).clone()
                    torch.testing.assert_close(o2, head2(ref_feat), **tol)
                    sums.append(float(o2.double().sum()))
                checks += 1
    torch.cuda.synchronize()
    out = tree_facts()
    out.update(checks=checks, sums=sums)
    return out
'''

# b. reduce-overhead training, with both cudagraph assertion modes on (the
# fast path calls checkPoolLiveAllocations and snapshots the pool).
SCENARIOS["compile_training"] = COMPILE_HELPERS + r'''

def main():
    inductor_config.triton.fast_path_cudagraph_asserts = True
    inductor_config.triton.slow_path_cudagraph_asserts = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 1)).cuda()
    ref = copy.deepcopy(model)
    cmodel = torch.compile(model, mode="reduce-overhead", dynamic=False)
    gen = torch.Generator(device="cuda").manual_seed(2)
    lr, losses, steps = 0.05, [], 0
    for bs in (16, 40):
        for step in range(5):
            torch.compiler.cudagraph_mark_step_begin()
            x = torch.randn(bs, 32, device="cuda", generator=gen)
            y = torch.randn(bs, 1, device="cuda", generator=gen)
            loss = F.mse_loss(cmodel(x), y)
            loss.backward()
            ref_loss = F.mse_loss(ref(x), y)
            ref_loss.backward()
            torch.testing.assert_close(loss, ref_loss, rtol=1e-3, atol=1e-5)
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                assert p.grad is not None, "no gradient for " + name
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5,
                                           msg=lambda m, name=name: "grad of %s (batch %d): %s" % (name, bs, m))
            losses.append(float(loss.item()))
            with torch.no_grad():
                for p, q in zip(model.parameters(), ref.parameters()):
                    p.sub_(lr * p.grad)
                    q.sub_(lr * q.grad)
                    p.grad = None
                    q.grad = None
            steps += 1
    torch.cuda.synchronize()
    out = tree_facts()
    out.update(steps=steps, losses=losses)
    return out
'''

# c. cuDNN benchmark mode (PyTorch asks the allocator's cacheInfo for the
# largest cached block before benchmarking algorithms). Checked against a
# float64 CPU reference.
SCENARIOS["cudnn_benchmark"] = r'''
import copy
from torch import nn


def rel_err(a, b):
    a = a.detach().double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def main():
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    big = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")  # a large cached free block
    del big
    net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 5, padding=2)).cuda()
    ref = copy.deepcopy(net).double().cpu()
    worst, runs = 0.0, 0
    for shape in ((4, 3, 48, 48), (2, 3, 40, 56)):
        for _ in range(3):
            x = torch.randn(shape, device="cuda", requires_grad=True)
            net.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            out = net(x)
            out.square().mean().backward()
            xr = x.detach().double().cpu().requires_grad_()
            outr = ref(xr)
            outr.square().mean().backward()
            errs = [rel_err(out, outr.detach()), rel_err(x.grad, xr.grad)]
            errs += [rel_err(p.grad, q.grad) for p, q in zip(net.parameters(), ref.parameters())]
            worst = max(worst, max(errs))
            runs += 1
    torch.cuda.synchronize()
    return {"runs": runs, "worst_rel_err": worst, "cudnn": torch.backends.cudnn.version() is not None,
            "benchmark": bool(torch.backends.cudnn.benchmark)}
'''

# d. CUDA IPC through a torch.multiprocessing spawn queue, both ways: the
# parent's tensor is read and written by the child; the child's tensor is
# read by the parent. Every wait has a timeout.
SCENARIOS["ipc"] = r'''
import queue as _queue
import torch.multiprocessing as mp

N = 1 << 20


def child(inq, outq, ackq):
    try:
        t = inq.get(timeout=150)
        ok = bool(t.is_cuda and (t == 3.0).all().item())
        t.mul_(2)  # written into the parent's memory
        torch.cuda.synchronize()
        back = torch.arange(1000, device="cuda", dtype=torch.float32)  # the child's memory, for the parent
        outq.put({"ok": ok, "mode": allocator_mode(), "back": back})
        ackq.get(timeout=150)  # keep `back` alive until the parent has read it
        del back, t
        torch.cuda.synchronize()
    except BaseException as e:  # reported to the parent instead of hanging it
        outq.put({"ok": False, "mode": allocator_mode(), "error": repr(e)})


def main():
    ctx = mp.get_context("spawn")
    inq, outq, ackq = ctx.Queue(), ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(inq, outq, ackq), daemon=True)
    p.start()
    # Expandable memory is imported by taking this process's descriptors
    # (pidfd_getfd): under Yama's ptrace_scope 1 a child may only if its
    # parent names it, natively as well.
    import ctypes
    ctypes.CDLL(None).prctl(0x59616D61, ctypes.c_ulong(p.pid), 0, 0, 0)  # PR_SET_PTRACER
    t = torch.full((N,), 3.0, device="cuda")
    torch.cuda.synchronize()
    inq.put(t)
    res = {"timeout": None, "error": None}
    try:
        msg = outq.get(timeout=180)
    except _queue.Empty:
        res["timeout"] = "the child did not answer within 180 s"
        p.kill()
        p.join(10)
        return res
    res["error"] = msg.get("error")
    res["child_ok"] = msg["ok"]
    res["child_mode"] = msg["mode"]
    back = msg.get("back")
    res["back_ok"] = back is not None and bool(torch.equal(back.cpu(), torch.arange(1000, dtype=torch.float32)))
    del back, msg
    torch.cuda.synchronize()
    res["parent_sees_write"] = bool((t == 6.0).all().item())
    ackq.put("done")
    p.join(timeout=60)
    if p.is_alive():
        res["timeout"] = "the child did not exit within 60 s"
        p.kill()
        p.join(10)
    res["child_exitcode"] = p.exitcode
    return res
'''

# e. Statistics through torch._C, torch.cuda and torch.accelerator.
SCENARIOS["stats"] = r'''
KEY = "allocated_bytes.all.current"


def flatten(d, prefix=""):
    out = {}
    for k, v in d.items():
        key = prefix + "." + k if prefix else k
        if isinstance(v, dict):
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


def all_stats():
    return flatten(torch._C._cuda_memoryStats(0)), dict(torch.cuda.memory_stats()), dict(torch.accelerator.memory_stats())


def main():
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    n = 3 * MiB + 400
    c0, t0, a0 = all_stats()
    x = torch.empty(n, dtype=torch.uint8, device="cuda")
    c1, t1, a1 = all_stats()
    res = {
        "keys_c": sorted(c1), "keys_cuda": sorted(t1), "keys_acc": sorted(a1),
        "d_alloc_c": c1[KEY] - c0[KEY],
        "d_alloc_cuda": t1[KEY] - t0[KEY],
        "d_alloc_acc": a1.get(KEY, 0) - a0.get(KEY, 0),
        "d_requested": t1["requested_bytes.all.current"] - t0["requested_bytes.all.current"],
        "d_large_allocations": t1["allocation.large_pool.current"] - t0["allocation.large_pool.current"],
        "memory_allocated_agrees": torch.cuda.memory_allocated() == t1[KEY] == c1[KEY],
        "acc_memory_allocated_agrees": torch.accelerator.memory_allocated() == a1.get(KEY),
    }
    del x
    torch.cuda.reset_peak_memory_stats()
    s = torch.cuda.memory_stats()
    res["peak_is_current_after_reset"] = s["allocated_bytes.all.peak"] == s[KEY]
    y = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
    del y
    s = torch.cuda.memory_stats()
    res["peak_above_current"] = s["allocated_bytes.all.peak"] - s[KEY]
    torch.accelerator.reset_peak_memory_stats()
    a = torch.accelerator.memory_stats()
    res["acc_peak_is_current_after_reset"] = a.get("allocated_bytes.all.peak") == a.get(KEY)
    torch.cuda.reset_accumulated_memory_stats()
    s = torch.cuda.memory_stats()
    acc_keys = ("allocation.all.allocated", "allocation.all.freed", "allocated_bytes.all.allocated",
                "allocated_bytes.all.freed", "segment.all.allocated", "num_alloc_retries", "num_ooms")
    res["accumulated_after_reset"] = {k: s[k] for k in acc_keys}
    res["current_kept_by_reset"] = s[KEY] == t0[KEY]
    z = torch.empty(2 * MiB, dtype=torch.uint8, device="cuda")
    s = torch.cuda.memory_stats()
    res["allocations_after_reset"] = s["allocation.all.allocated"]
    torch.accelerator.reset_accumulated_memory_stats()
    a = torch.accelerator.memory_stats()
    res["acc_allocations_after_acc_reset"] = a.get("allocation.all.allocated")
    summary = torch.cuda.memory_summary()
    res["summary_title"] = "PyTorch CUDA memory summary" in summary
    res["summary_rows"] = sorted({line.split("|")[1].strip() for line in summary.splitlines()
                                  if line.startswith("|") and line.count("|") >= 3 and "memory" in line.lower()})
    res["summary_lines"] = len(summary.splitlines())
    del z
    return res
'''

# f. Memory history: stacks on blocks and trace entries, free stacks,
# skip_actions, user metadata, off and on again, max_entries, dump and render.
SCENARIOS["history"] = r'''
import pickle
from torch.cuda import _memory_viz as viz

SIZES = {k: 3 * MiB + 1024 * (i + 1) for i, k in enumerate(("all", "alloc", "skip", "meta", "off", "on"))}
ALLOC_FN, FREE_FN = "alloc_in_parity_named_fn", "free_in_parity_named_fn"


def alloc_in_parity_named_fn(nbytes):
    return torch.empty(nbytes, dtype=torch.uint8, device="cuda")


def free_in_parity_named_fn(holder):
    holder.pop()


def names(frames):
    return {f.get("name") for f in frames or []}


def entries(snap, action, size, addr=None):
    return [e for e in snap["device_traces"][0]
            if e["action"] == action and e.get("size") == size and (addr is None or e.get("addr") == addr)]


def find_block(snap, ptr):
    for seg in snap["segments"]:
        for b in seg["blocks"]:
            if b["address"] == ptr:
                return b
    return None


def record(**kw):
    torch.cuda.memory._record_memory_history(max_entries=kw.pop("max_entries", 10000), stacks="python", **kw)


def off():
    torch.cuda.memory._record_memory_history(None)


def main():
    torch.zeros(1, device="cuda")
    res = {}
    # context="all" (the default): alloc and free stacks
    record()
    h = [alloc_in_parity_named_fn(SIZES["all"])]
    ptr = h[0].data_ptr()
    snap = torch.cuda.memory._snapshot()
    block = find_block(snap, ptr)
    res["block_found"] = block is not None
    res["block_frames_name_alloc_fn"] = block is not None and ALLOC_FN in names(block.get("frames"))
    res["frame_keys"] = sorted(block["frames"][0]) if block and block.get("frames") else []
    allocs = entries(snap, "alloc", SIZES["all"], ptr)
    res["alloc_entries"] = len(allocs)
    res["alloc_entry_frames_name_alloc_fn"] = any(ALLOC_FN in names(e.get("frames")) for e in allocs)
    free_in_parity_named_fn(h)
    snap = torch.cuda.memory._snapshot()
    frees = entries(snap, "free_requested", SIZES["all"], ptr)
    res["free_entries"] = len(frees)
    res["free_entry_frames_name_free_fn"] = any(FREE_FN in names(e.get("frames")) for e in frees)
    res["free_completed_entries"] = len(entries(snap, "free_completed", SIZES["all"], ptr))
    # context="alloc": no free stacks
    off()
    record(context="alloc")
    h = [alloc_in_parity_named_fn(SIZES["alloc"])]
    free_in_parity_named_fn(h)
    snap = torch.cuda.memory._snapshot()
    frees = entries(snap, "free_requested", SIZES["alloc"])
    res["ctx_alloc_free_entries"] = len(frees)
    res["ctx_alloc_free_frames_name_free_fn"] = any(FREE_FN in names(e.get("frames")) for e in frees)
    res["ctx_alloc_alloc_frames_name_alloc_fn"] = any(
        ALLOC_FN in names(e.get("frames")) for e in entries(snap, "alloc", SIZES["alloc"]))
    # skip_actions
    off()
    record(skip_actions=["free_requested"])
    h = [alloc_in_parity_named_fn(SIZES["skip"])]
    free_in_parity_named_fn(h)
    snap = torch.cuda.memory._snapshot()
    res["skip"] = [len(entries(snap, a, SIZES["skip"])) for a in ("alloc", "free_requested", "free_completed")]
    # user metadata
    torch.cuda.memory._set_memory_metadata("parity-md")
    res["metadata_get"] = torch.cuda.memory._get_memory_metadata()
    h = [alloc_in_parity_named_fn(SIZES["meta"])]
    torch.cuda.memory._set_memory_metadata("")
    snap = torch.cuda.memory._snapshot()
    res["metadata_on_alloc"] = [e.get("user_metadata") for e in entries(snap, "alloc", SIZES["meta"])]
    free_in_parity_named_fn(h)
    # off, then on again
    off()
    h = [alloc_in_parity_named_fn(SIZES["off"])]
    free_in_parity_named_fn(h)
    record()
    keep = alloc_in_parity_named_fn(SIZES["on"])
    snap = torch.cuda.memory._snapshot()
    res["entries_while_off"] = len(entries(snap, "alloc", SIZES["off"]))
    on_again = entries(snap, "alloc", SIZES["on"], keep.data_ptr())
    res["entries_on_again"] = len(on_again)
    res["on_again_frames_name_alloc_fn"] = any(ALLOC_FN in names(e.get("frames")) for e in on_again)
    # dump, load, render with torch.cuda._memory_viz (no flamegraph.pl: raw lines)
    path = os.path.abspath("parity_snapshot_%s.pickle" % MODE)  # both modes may run at once
    torch.cuda.memory._dump_snapshot(path)
    with open(path, "rb") as f:
        loaded = pickle.load(f)
    res["dump_has_segments"] = bool(loaded["segments"]) and bool(loaded["device_traces"][0])
    res["viz_segments_names_alloc_fn"] = ALLOC_FN in viz.segments(loaded, format_flamegraph=lambda lines: lines)
    res["viz_memory_names_alloc_fn"] = ALLOC_FN in viz.memory(loaded, format_flamegraph=lambda lines: lines)
    res["viz_segsum"] = "total_reserved" in viz.segsum(loaded)
    res["viz_trace"] = "alloc" in viz.trace(loaded)
    html = [viz.trace_plot(loaded), viz.trace_plot(loaded, filter_freed=True), viz.segment_plot(loaded)]
    res["viz_html"] = all("<html>" in x and len(x) > 1000 for x in html)
    # max_entries bounds the trace
    off()
    record(max_entries=5, clear_history=True)
    for i in range(8):
        h = [alloc_in_parity_named_fn(1 * MiB + 512 * (i + 1))]
        free_in_parity_named_fn(h)
    res["entries_with_max_5"] = len(torch.cuda.memory._snapshot()["device_traces"][0])
    off()
    del keep
    return res
'''

# g. OOM observer, the OOM message, and an absurd request.
SCENARIOS["oom_observer"] = r'''
def main():
    calls = []

    def observer(device, alloc, device_allocated, device_free):
        calls.append([int(device), int(alloc), int(device_allocated), int(device_free)])

    torch._C._cuda_attach_out_of_memory_observer(observer)
    torch.zeros(1, device="cuda")
    total = torch.cuda.get_device_properties(0).total_memory
    res = {"total": total}
    torch.cuda.set_per_process_memory_fraction(0.05)
    n = (int(total * 0.10) // (2 * MiB)) * 2 * MiB
    res["request"] = n
    try:
        torch.empty(n, dtype=torch.uint8, device="cuda")
        res["fraction_oom"] = None
    except torch.OutOfMemoryError as e:
        res["fraction_oom"] = str(e).splitlines()[0][:200]
    res["observer_calls_after_fraction_oom"] = [c[:3] for c in calls]
    res["observer_device_free_sane"] = all(0 <= c[3] <= total for c in calls)
    torch.cuda.set_per_process_memory_fraction(1.0)
    try:
        torch.empty(int(8e18), dtype=torch.uint8, device="cuda")
        res["exa_oom"] = None
    except torch.OutOfMemoryError as e:
        res["exa_oom"] = str(e)[:300]
    except RuntimeError as e:  # not an OutOfMemoryError: a failure
        res["exa_oom"] = "RuntimeError: " + str(e)[:300]
    res["observer_calls_total"] = len(calls)
    res["num_ooms"] = torch.cuda.memory_stats()["num_ooms"]
    ok = torch.ones(1 << 20, device="cuda")
    res["works_after"] = float(ok.sum().item()) == float(1 << 20)
    return res
'''

# h. MemPool: routing, snapshots, use counts, nesting, no_split, threads,
# and (cudapool only) a pool whose segments come from cudapool.allocator().
SCENARIOS["mempool"] = r'''
import concurrent.futures
import gc
import inspect


def seg_of(segs, ptr):
    for s in segs:
        if s["address"] <= ptr < s["address"] + s["total_size"]:
            return s
    return None


def layout(pool):
    """(segment count, sorted block sizes) of a pool."""
    segs = pool.snapshot()
    return [len(segs), sorted(b["size"] for s in segs for b in s["blocks"])]


def main():
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    res = {}
    pool = torch.cuda.MemPool()
    pid = tuple(pool.id)
    res["id_is_user_pool"] = pid[0] == 0 and pid[1] > 0
    counts = [pool.use_count()]
    with torch.cuda.use_mem_pool(pool):
        a = torch.randn(1 << 20, device="cuda")  # 4 MiB
        counts.append(pool.use_count())
    counts.append(pool.use_count())
    res["use_counts"] = counts
    b = torch.randn(1 << 20, device="cuda")  # outside the pool
    segs = pool.snapshot()
    res["pool_snapshot_only_pool"] = bool(segs) and all(tuple(s["segment_pool_id"]) == pid for s in segs)
    res["pool_id_type"] = type(segs[0]["segment_pool_id"]).__name__ if segs else None
    sa = seg_of(segs, a.data_ptr())
    res["a_in_pool"] = sa is not None and any(
        blk["state"] == "active_allocated" for blk in sa["blocks"])
    res["b_not_in_pool"] = seg_of(segs, b.data_ptr()) is None
    res["memory_snapshot_by_id"] = [s["address"] for s in torch.cuda.memory_snapshot(pid)] == [s["address"] for s in segs]
    default = torch.cuda.memory_snapshot()
    sb = seg_of(default, b.data_ptr())
    res["b_in_default_pool"] = sb is not None and tuple(sb["segment_pool_id"]) == (0, 0)
    # nested pools
    p1, p2 = torch.cuda.MemPool(), torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(p1):
        x1 = torch.randn(1 << 18, device="cuda")
        with torch.cuda.use_mem_pool(p2):
            x2 = torch.randn(1 << 18, device="cuda")
        x3 = torch.randn(1 << 18, device="cuda")
    s1, s2 = p1.snapshot(), p2.snapshot()
    res["nested"] = [seg_of(s1, x1.data_ptr()) is not None, seg_of(s2, x2.data_ptr()) is not None,
                     seg_of(s1, x3.data_ptr()) is not None, seg_of(s1, x2.data_ptr()) is None]
    # no_split
    res["has_no_split"] = "no_split" in inspect.signature(torch.cuda.MemPool.__init__).parameters
    if res["has_no_split"]:
        plain, nosplit = torch.cuda.MemPool(), torch.cuda.MemPool(no_split=True)
        keep = []
        for p in (plain, nosplit):
            with torch.cuda.use_mem_pool(p):
                keep += [torch.empty(4 * MiB, dtype=torch.uint8, device="cuda") for _ in range(2)]
        res["layout_plain"], res["layout_no_split"] = layout(plain), layout(nosplit)
        del keep, plain, nosplit

    # pools made and used in several threads
    def worker(i):
        p = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(p):
            t = torch.full((1 << 18,), float(i), device="cuda")
        inside = seg_of(p.snapshot(), t.data_ptr()) is not None
        ok = inside and float(t.sum().item()) == float(i) * (1 << 18)
        del t
        return [ok, list(p.id)]

    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        got = list(ex.map(worker, range(4)))
    res["threads_ok"] = [g[0] for g in got]
    res["thread_ids_distinct"] = len({tuple(g[1]) for g in got}) == 4
    # a pool whose segments come from cudapool's per-pool allocator
    if MODE == "cudapool":
        ap = torch.cuda.MemPool(allocator=cudapool.allocator().allocator())
        with torch.cuda.use_mem_pool(ap):
            u = torch.full((1 << 20,), 2.0, device="cuda")
        res["allocator_pool_value_ok"] = float(u.sum().item()) == float(1 << 21)
        res["allocator_pool_holds_u"] = seg_of(ap.snapshot(), u.data_ptr()) is not None
        del u, ap
    del a, b, x1, x2, x3, pool, p1, p2
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    res["allocated_back_to_base"] = torch.cuda.memory_allocated() - base
    return res
'''

# i. Settings changed at run time, and the memory fraction.
SCENARIOS["settings"] = r'''
import warnings


def block_of(ptr):
    for seg in torch.cuda.memory_snapshot():
        for b in seg["blocks"]:
            if b["address"] == ptr:
                return b
    return None


def main():
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    res = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # _set_allocator_settings is deprecated (FutureWarning)
        torch.cuda.memory._set_allocator_settings("roundup_power2_divisions:4")
    s0 = torch.cuda.memory_stats()
    x = torch.empty(84 * MiB, dtype=torch.uint8, device="cuda")
    s1 = torch.cuda.memory_stats()
    res["d_allocated"] = s1["allocated_bytes.all.current"] - s0["allocated_bytes.all.current"]
    res["d_requested"] = s1["requested_bytes.all.current"] - s0["requested_bytes.all.current"]
    res["d_reserved_at_least_allocated"] = (
        s1["reserved_bytes.all.current"] - s0["reserved_bytes.all.current"] >= res["d_allocated"])
    b = block_of(x.data_ptr())
    res["block"] = [b["size"], b["requested_size"]] if b else None
    del x
    torch.cuda.set_per_process_memory_fraction(0.3)
    res["fraction_after_set"] = torch.cuda.get_per_process_memory_fraction()
    torch.cuda.set_per_process_memory_fraction(1.0)
    res["fraction_after_reset"] = torch.cuda.get_per_process_memory_fraction()
    return res
'''

# i (continued). PYTORCH_CUDA_ALLOC_CONF=per_process_memory_fraction:0.5
SCENARIOS["conf_fraction"] = r'''
def main():
    torch.zeros(1, device="cuda")
    total = torch.cuda.get_device_properties(0).total_memory
    res = {"fraction": torch.cuda.get_per_process_memory_fraction()}
    n = (int(total * 0.6) // (2 * MiB)) * 2 * MiB
    try:
        t = torch.empty(n, dtype=torch.uint8, device="cuda")
        del t
        res["over_half_raises"] = False
    except torch.OutOfMemoryError:
        res["over_half_raises"] = True
    small = torch.empty(int(total * 0.1), dtype=torch.uint8, device="cuda")
    res["under_half_works"] = small.numel() == int(total * 0.1)
    del small
    return res
'''


# ---------------------------------------------------------------------------
# Running a scenario


def _tail(text, n=4000):
    if text is None:
        return ""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return text[-n:]


def _env(mode, extra):
    env = {k: v for k, v in os.environ.items() if k not in SCRUB}
    paths = [gpu_common.PYTHON_DIR, gpu_common.GPU_DIR]
    paths += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in paths]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["CUDAPOOL_PARITY_MODE"] = mode
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    env["PYTORCH_CUDA_ALLOC_CONF"] = PAIR_CONF
    for k, v in (extra or {}).items():
        env[k] = PAIR_CONF + "," + v if k == "PYTORCH_CUDA_ALLOC_CONF" else v
    return env


def _run_mode(script, mode, extra_env):
    """One run: (result dict, None) or (None, why it failed)."""
    proc = subprocess.Popen([sys.executable, str(script)], cwd=str(script.parent), env=_env(mode, extra_env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the group we started: spawned children and compile workers too
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        return None, f"[{mode}] timed out after {TIMEOUT}s (a hang is a failure)\n--- stdout\n{_tail(out)}\n--- stderr\n{_tail(err)}"
    lines = [line for line in out.splitlines() if line.startswith(MARK)]
    if proc.returncode != 0 or len(lines) != 1:
        return None, f"[{mode}] exit code {proc.returncode}\n--- stdout\n{_tail(out)}\n--- stderr\n{_tail(err)}"
    return json.loads(lines[0][len(MARK):]), None


def run_both(name, tmp_path, extra_env=None):
    """Run scenario `name` natively and with cudapool; returns (native, cudapool)."""
    script = tmp_path / f"parity_{name}.py"
    script.write_text(PRELUDE + textwrap.dedent(SCENARIOS[name]) + EPILOGUE)
    modes = ("native", "cudapool")
    if PARALLEL:
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            done = list(ex.map(lambda m: _run_mode(script, m, extra_env), modes))
    else:
        done = [_run_mode(script, m, extra_env) for m in modes]
    errors = [why for _, why in done if why]
    if errors:
        pytest.fail(f"scenario {name}:\n" + "\n\n".join(errors), pytrace=False)
    native, cp = (r for r, _ in done)
    assert native["_mode"] == "native"
    assert cp["_mode"] == "class", f"cudapool ran in mode {cp['_mode']!r}"
    assert cp["_cudapool_allocations"] > 0, "no allocation went through cudapool"
    return native, cp


def same(native, cp, keys):
    """The listed facts are equal in both runs."""
    diff = {k: (native.get(k), cp.get(k)) for k in keys if native.get(k) != cp.get(k)}
    assert not diff, "differs from native (key: (native, cudapool)): " + repr(diff)


def close_lists(a, b, rel, what):
    assert len(a) == len(b), f"{what}: {len(a)} values natively, {len(b)} with cudapool"
    bad = [(i, x, y) for i, (x, y) in enumerate(zip(a, b)) if abs(x - y) > rel * max(1.0, abs(x))]
    assert not bad, f"{what} differ (index, native, cudapool): {bad[:5]}"


# ---------------------------------------------------------------------------
# The tests


def check_tree(r, who):
    assert r["cudagraph_trees"] is True, f"{who}: CUDA graph trees are off"
    assert r["skips"] == 0, f"{who}: inductor skipped CUDA graphs {r['skips']} time(s)"
    assert r["graphs"] > 0, f"{who}: no CUDA graph was recorded in the tree"
    assert r["calls"]["get_checkpoint"] > 0, f"{who}: the tree took no pool checkpoint"
    assert r["calls"]["check_pool"] > 0, f"{who}: checkPoolLiveAllocations was never called"


def compare_trees(native, cp):
    check_tree(native, "native")
    check_tree(cp, "cudapool")
    # the tree's decisions follow tensor liveness and addresses: an allocator
    # whose checkpoints restore the pool differently re-records graphs
    assert cp["graphs"] == native["graphs"], f"graphs recorded: native {native['graphs']}, cudapool {cp['graphs']}"
    for k in ("get_checkpoint", "set_checkpoint", "check_pool"):
        assert cp["calls"][k] == native["calls"][k], f"{k} calls: native {native['calls']}, cudapool {cp['calls']}"
    assert cp["calls"]["check_pool_false"] <= native["calls"]["check_pool_false"], (
        f"checkPoolLiveAllocations disagreed with the live tensors: native {native['calls']}, cudapool {cp['calls']}")


def test_compile_reduce_overhead_inference(tmp_path):
    native, cp = run_both("compile_inference", tmp_path)
    compare_trees(native, cp)
    assert native["calls"]["set_checkpoint"] > 0, "the scenario did not make the tree restore a checkpoint"
    assert native["checks"] == cp["checks"] == 12
    close_lists(native["sums"], cp["sums"], 1e-3, "output sums")


def test_compile_reduce_overhead_training(tmp_path):
    native, cp = run_both("compile_training", tmp_path)
    compare_trees(native, cp)
    assert native["graphs"] >= 4, "expected forward and backward graphs for two batch sizes"
    assert native["steps"] == cp["steps"] == 10
    close_lists(native["losses"], cp["losses"], 1e-4, "losses")


def test_cudnn_benchmark_conv(tmp_path):
    native, cp = run_both("cudnn_benchmark", tmp_path)
    for who, r in (("native", native), ("cudapool", cp)):
        assert r["cudnn"] and r["benchmark"], f"{who}: cuDNN benchmark mode was not on"
        assert r["runs"] == 6
        assert r["worst_rel_err"] < 1e-3, f"{who}: conv results differ from the float64 reference by {r['worst_rel_err']}"


def test_cuda_ipc_spawn_queue(tmp_path):
    native, cp = run_both("ipc", tmp_path)
    for who, r in (("native", native), ("cudapool", cp)):
        assert r["timeout"] is None, f"{who}: {r['timeout']}"
        assert r["error"] is None, f"{who}: the child failed: {r['error']}"
        assert r["child_ok"], f"{who}: the child read wrong values"
        assert r["parent_sees_write"], f"{who}: the child's write did not reach the parent's tensor"
        assert r["back_ok"], f"{who}: the parent read wrong values from the child's tensor"
        assert r["child_exitcode"] == 0, f"{who}: the child exited with {r['child_exitcode']}"
    assert cp["child_mode"] == "class", "the spawned child did not run with cudapool installed"
    assert native["child_mode"] == "native"


def test_memory_stats_through_torch_c_and_accelerator(tmp_path):
    native, cp = run_both("stats", tmp_path)
    n = 3 * MiB + 400
    assert native["d_alloc_c"] == native["d_alloc_cuda"] == 3 * MiB + 512
    assert native["d_requested"] == n and native["d_large_allocations"] == 1
    assert native["d_alloc_acc"] > 0, "natively torch.accelerator's allocated bytes did not grow"
    assert native["peak_above_current"] == 8 * MiB
    assert set(native["accumulated_after_reset"].values()) == {0}
    assert native["summary_title"]
    assert len(cp["keys_cuda"]) == len(native["keys_cuda"]) == 122
    same(native, cp, [k for k in native if not k.startswith("_")])


def test_memory_history_with_python_stacks(tmp_path):
    native, cp = run_both("history", tmp_path)
    assert native["block_frames_name_alloc_fn"] and native["alloc_entry_frames_name_alloc_fn"]
    assert native["free_entry_frames_name_free_fn"], "natively context='all' records free stacks"
    assert native["skip"][0] >= 1 and native["skip"][1] == 0
    assert native["metadata_get"] == "parity-md" and native["metadata_on_alloc"] == ["parity-md"]
    assert native["entries_while_off"] == 0 and native["entries_on_again"] == 1
    assert native["viz_segments_names_alloc_fn"] and native["viz_html"]
    assert native["entries_with_max_5"] <= 5
    same(native, cp, [k for k in native if not k.startswith("_")])


def test_oom_observer_and_messages(tmp_path):
    native, cp = run_both("oom_observer", tmp_path)
    for who, r in (("native", native), ("cudapool", cp)):
        assert r["fraction_oom"] and r["fraction_oom"].startswith("CUDA out of memory. Tried to allocate"), (
            f"{who}: {r['fraction_oom']!r}")
        calls = r["observer_calls_after_fraction_oom"]
        assert len(calls) == 1 and calls[0][0] == 0, f"{who}: observer calls {calls}"
        assert r["observer_device_free_sane"]
        assert r["exa_oom"] and "Tried to allocate more than 1EB memory" in r["exa_oom"], f"{who}: {r['exa_oom']!r}"
        assert not r["exa_oom"].startswith("RuntimeError:"), f"{who}: not a torch.OutOfMemoryError"
        assert r["works_after"]
    # device and size passed to the observer, and its third argument (the
    # allowed maximum natively) within one 2 MiB rounding step
    nc, cc = native["observer_calls_after_fraction_oom"][0], cp["observer_calls_after_fraction_oom"][0]
    assert cc[:2] == nc[:2], f"observer (device, size): native {nc[:2]}, cudapool {cc[:2]}"
    assert abs(cc[2] - nc[2]) <= 2 * MiB, f"observer third argument: native {nc[2]}, cudapool {cc[2]}"
    same(native, cp, ["observer_calls_total", "num_ooms"])


def test_mempool(tmp_path):
    native, cp = run_both("mempool", tmp_path)
    for who, r in (("native", native), ("cudapool", cp)):
        assert r["id_is_user_pool"], who
        assert r["a_in_pool"] and r["b_not_in_pool"] and r["b_in_default_pool"], who
        assert r["pool_snapshot_only_pool"] and r["memory_snapshot_by_id"], who
        assert r["nested"] == [True] * 4, f"{who}: nested pools {r['nested']}"
        assert r["threads_ok"] == [True] * 4 and r["thread_ids_distinct"], f"{who}: threads {r['threads_ok']}"
        assert r["allocated_back_to_base"] == 0, f"{who}: {r['allocated_back_to_base']} bytes left allocated"
    assert cp["allocator_pool_value_ok"] and cp["allocator_pool_holds_u"], "MemPool(allocator=cudapool.allocator())"
    keys = ["use_counts", "pool_id_type", "has_no_split", "layout_plain", "layout_no_split"]
    same(native, cp, keys)
    if native["has_no_split"]:
        assert native["layout_plain"] != native["layout_no_split"], "no_split made no difference natively"


def test_allocator_settings_at_run_time(tmp_path):
    native, cp = run_both("settings", tmp_path)
    assert native["d_allocated"] == 96 * MiB and native["d_requested"] == 84 * MiB
    assert native["block"] == [96 * MiB, 84 * MiB]
    assert native["fraction_after_set"] == pytest.approx(0.3)
    same(native, cp, ["d_allocated", "d_requested", "d_reserved_at_least_allocated", "block",
                      "fraction_after_set", "fraction_after_reset"])


def test_per_process_memory_fraction_from_env(tmp_path):
    native, cp = run_both("conf_fraction", tmp_path, {"PYTORCH_CUDA_ALLOC_CONF": "per_process_memory_fraction:0.5"})
    if native["fraction"] != pytest.approx(0.5) and not native["over_half_raises"]:
        pytest.skip(f"torch {torch.__version__} does not apply per_process_memory_fraction from "
                    "PYTORCH_CUDA_ALLOC_CONF natively: nothing to compare")
    assert native["under_half_works"]
    assert cp["fraction"] == pytest.approx(native["fraction"]), f"native {native['fraction']}, cudapool {cp['fraction']}"
    same(native, cp, ["over_half_raises", "under_half_works"])
