# SPDX-License-Identifier: Apache-2.0
"""CUDA IPC of memory in expandable segments on the GPU, in PyTorch's own
handle format: CUDA tensors sent through torch.multiprocessing queues
(spawn) between a cudapool process (expandable_segments:True, with
stitching as by default, or with stitch:False) and a native PyTorch process with
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, in both directions;
between two cudapool processes with stitching, the sender stitching
(moving pages) while its tensor is shared; ten thousand distinct tensors
opened at once in one cudapool consumer (timed); and, where
kernel.yama.ptrace_scope is 1, the clear error a child gets when its parent
has not let it take its file descriptors (never a hang).

Each scenario is a script run in a fresh process (the parent), which spawns
the other side (the child); each process's allocator is chosen by
IPC_ROLE ("cudapool": cudapool.install(cpp_class=True), with CUDAPOOL_CONF;
"native": PyTorch's, with PYTORCH_CUDA_ALLOC_CONF). The parent prints one
line "IPC-RESULT {json}". A run that does not finish within
$CUDAPOOL_IPC_TIMEOUT seconds (default 600) is killed with its whole
process group and fails: a hang is a failure.

Importing memory shared as file descriptors takes them from the exporter
with pidfd_getfd, which needs ptrace permission to it. Under Yama's
ptrace_scope 1 (Ubuntu's default) only an ancestor may, so a child cannot
import its parent's memory unless the parent names it
(prctl(PR_SET_PTRACER, child)): the scripts do that explicitly where the
parent exports, as any program that shares expandable memory with a child
must (natively as well). With ptrace_scope 2 or 3, or a system that refuses
pidfd_getfd even of a process's own descriptors, the module skips.

run_gpu_tests.sh runs this module with CUDAPOOL_GPU_NO_INSTALL=1 (the pytest
process only starts the scenarios). By hand:
    cd python && CUDAPOOL_GPU_NO_INSTALL=1 python -m pytest --confcutdir=tests/gpu tests/gpu/test_gpu_ipc_expandable.py
CUDAPOOL_IPC_IMPORTS sets the number of tensors of the many-imports
scenario (default 10000).
"""

import ctypes
import json
import os
import resource
import signal
import subprocess
import sys

import pytest

import gpu_common

torch = gpu_common.require_cuda()

if os.environ.get("CUDAPOOL_TORCH_EXT") == "0":
    pytest.skip("CUDAPOOL_TORCH_EXT=0 turns off the C++ allocator class, which CUDA IPC needs", allow_module_level=True)

MARK = "IPC-RESULT "
TIMEOUT = int(os.environ.get("CUDAPOOL_IPC_TIMEOUT", "600"))
IMPORTS = int(os.environ.get("CUDAPOOL_IPC_IMPORTS", "10000"))
SCRUB = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CUDAPOOL_CONF", "CUDAPOOL_BACKEND",
         "CUDAPOOL_GPU_NO_INSTALL", "CUDAPOOL_AUTOINSTALL", "CUDAPOOL_TORCH_EXT")


def _ptrace_scope():
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 0  # no Yama: the classic ptrace rules (same user)


def _pidfd_getfd_of_self():
    """None if this process can take its own descriptor 0 with pidfd_getfd,
    else why not (a kernel before 5.6, a seccomp filter)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    pidfd = libc.syscall(434, os.getpid(), 0)  # pidfd_open
    if pidfd < 0:
        return f"pidfd_open: {os.strerror(ctypes.get_errno())}"
    try:
        fd = libc.syscall(438, ctypes.c_int(pidfd), 0, 0)  # pidfd_getfd
        if fd < 0:
            return f"pidfd_getfd: {os.strerror(ctypes.get_errno())}"
        os.close(fd)
        return None
    finally:
        os.close(pidfd)


def _has_cap_sys_ptrace():
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> 19 & 1)  # CAP_SYS_PTRACE
    except (OSError, ValueError):
        pass
    return False


SCOPE = _ptrace_scope()
if SCOPE >= 2:
    pytest.skip(f"kernel.yama.ptrace_scope is {SCOPE}: only CAP_SYS_PTRACE may take another process's file "
                "descriptors, which importing expandable memory needs (natively too)", allow_module_level=True)
_why = _pidfd_getfd_of_self()
if _why is not None:
    pytest.skip(f"this system refuses pidfd_getfd ({_why}), which importing expandable memory needs (natively too)",
                allow_module_level=True)

# ---------------------------------------------------------------------------
# The scenario script.

SCRIPT = r'''
import ctypes, errno, gc, json, os, time, queue as _queue

ROLE = os.environ["IPC_ROLE"]
if ROLE == "cudapool":
    import cudapool
    cudapool.install(cpp_class=True)
    if cudapool.mode() != "class":
        raise SystemExit("cudapool.mode() is %r, not 'class'" % (cudapool.mode(),))
import torch
import torch.multiprocessing as mp

MiB = 1 << 20
WAIT = 300
PR_SET_PTRACER = 0x59616D61


def expandable(t):
    """Whether t's memory is in an expandable segment, by the allocator's own snapshot."""
    p = t.untyped_storage().data_ptr()
    for s in torch.cuda.memory_snapshot():
        if s["address"] <= p < s["address"] + s["total_size"]:
            return bool(s.get("is_expandable"))
    return None


def stitch_remaps():
    if ROLE != "cudapool":
        return 0
    return sum(cudapool.snapshot().get("allocator_settings", {}).get("stitch_remaps", [0]))


def let_child_take_descriptors(pid):
    """Yama ptrace_scope 1: name the child as allowed to take this process's descriptors.
    A kernel without Yama answers EINVAL: there is nothing to allow then."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(pid), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        if err != errno.EINVAL:
            raise OSError(err, "prctl(PR_SET_PTRACER)")


def child_env(role, conf):
    os.environ["IPC_ROLE"] = role  # read by the spawned child's copy of this module
    os.environ.pop("CUDAPOOL_CONF", None)
    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if role == "cudapool":
        os.environ["CUDAPOOL_CONF"] = conf
    else:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = conf


# -- pair: both directions between the parent and the child ------------------

def pair_child(inq, outq):
    try:
        t = inq.get(timeout=WAIT)
        ok = bool(t.is_cuda and (t == 3.0).all().item())
        t.mul_(2)  # written into the parent's memory
        torch.cuda.synchronize()
        back = torch.arange(3 * MiB, device="cuda", dtype=torch.float32)  # 12 MiB of the child's memory
        outq.put({"ok": ok, "mode": ROLE, "back": back, "back_expandable": expandable(back)})
        inq.get(timeout=WAIT)  # keep `back` until the parent has read it
        del back, t
        torch.cuda.synchronize()
    except BaseException as e:
        outq.put({"ok": False, "mode": ROLE, "error": repr(e)})


def pair(child_role, child_conf, allow):
    ctx = mp.get_context("spawn")
    inq, outq = ctx.Queue(), ctx.Queue()
    child_env(child_role, child_conf)
    p = ctx.Process(target=pair_child, args=(inq, outq), daemon=True)
    p.start()
    if allow:
        let_child_take_descriptors(p.pid)
    t = torch.full((5 * MiB,), 3.0, device="cuda")  # 20 MiB
    res = {"parent_expandable": expandable(t)}
    torch.cuda.synchronize()
    inq.put(t)
    try:
        msg = outq.get(timeout=WAIT)
    except _queue.Empty:
        p.kill()
        return dict(res, timeout="the child did not answer")
    res.update(error=msg.get("error"), child_ok=msg["ok"], child_mode=msg["mode"],
               child_expandable=msg.get("back_expandable"))
    back = msg.get("back")
    res["back_ok"] = back is not None and bool(torch.equal(back.cpu(), torch.arange(3 * MiB, dtype=torch.float32)))
    del back, msg
    torch.cuda.synchronize()
    res["parent_sees_write"] = bool((t == 6.0).all().item())
    inq.put("done")
    p.join(timeout=60)
    res["child_exitcode"] = p.exitcode
    return res


# -- stitch: cudapool to cudapool, the sender stitching while it shares -------

def stitch_child(inq, outq):
    try:
        t = inq.get(timeout=WAIT)
        ok1 = bool((t == 5.0).all().item())
        t.add_(1)
        torch.cuda.synchronize()
        outq.put(("first", ok1))
        assert inq.get(timeout=WAIT) == "check"  # the parent has stitched meanwhile
        ok2 = bool((t == 6.0).all().item())
        t.add_(1)
        torch.cuda.synchronize()
        moved = inq.get(timeout=WAIT)  # a tensor on pages that moved
        ok3 = bool((moved == 9.0).all().item())
        mine = torch.full((7 * MiB,), 4.0, device="cuda")
        outq.put(("second", ok2, ok3, mine, expandable(mine)))
        inq.get(timeout=WAIT)
        del t, moved, mine
        torch.cuda.synchronize()
    except BaseException as e:
        outq.put(("error", repr(e)))


def stitch():
    ctx = mp.get_context("spawn")
    inq, outq = ctx.Queue(), ctx.Queue()
    child_env("cudapool", "stitch:True")
    p = ctx.Process(target=stitch_child, args=(inq, outq), daemon=True)
    p.start()
    let_child_take_descriptors(p.pid)
    t = torch.full((2 * MiB,), 5.0, device="cuda")  # 8 MiB, shared from here on
    res = {"parent_expandable": expandable(t)}
    torch.cuda.synchronize()
    inq.put(t)
    msg = outq.get(timeout=WAIT)
    if msg[0] == "error":
        p.kill()
        return dict(res, error=msg[1])
    res["first_ok"] = msg[1]
    # Holes around the shared tensor, freed, then misses on another stream
    # that take their idle pages.
    before = stitch_remaps()
    keep, holes = [], []
    for _ in range(24):
        holes.append(torch.empty(10 * MiB, dtype=torch.uint8, device="cuda"))
        keep.append(torch.empty(2 * MiB, dtype=torch.uint8, device="cuda"))
    del holes
    torch.cuda.synchronize()
    big = torch.full((60 * MiB,), 9.0, device="cuda")  # 240 MiB, on pages moved out of the holes
    torch.cuda.synchronize()
    res["remaps"] = stitch_remaps() - before
    res["parent_still_sees"] = bool((t == 6.0).all().item())
    inq.put("check")
    inq.put(big)
    msg = outq.get(timeout=WAIT)
    if msg[0] == "error":
        p.kill()
        return dict(res, error=msg[1])
    _, res["after_stitch_ok"], res["moved_pages_ok"], mine, res["child_expandable"] = msg
    res["back_ok"] = bool((mine == 4.0).all().item())
    del mine, msg
    torch.cuda.synchronize()
    res["parent_sees_write"] = bool((t == 7.0).all().item())
    inq.put("done")
    p.join(timeout=60)
    res["child_exitcode"] = p.exitcode
    return res


# -- many: ten thousand distinct tensors opened at once in one consumer --------

def many_child(inq, outq, n):
    try:
        t0 = time.perf_counter()
        ts = inq.get(timeout=WAIT)  # unpickling opens every handle
        t_open = time.perf_counter() - t0
        firsts = torch.stack([x[:1] for x in ts]).flatten().cpu()
        ok = len(ts) == n and bool(torch.equal(firsts, torch.arange(n, dtype=torch.float32)))
        ok = ok and all(bool((ts[i] == float(i)).all().item()) for i in range(0, n, max(1, n // 50)))
        ptrs = {x.untyped_storage().data_ptr() for x in ts}
        t0 = time.perf_counter()
        del ts
        gc.collect()
        torch.cuda.synchronize()
        t_close = time.perf_counter() - t0
        outq.put({"ok": ok, "distinct": len(ptrs), "open_s": t_open, "close_s": t_close})
    except BaseException as e:
        outq.put({"ok": False, "error": repr(e)})


def many(n):
    ctx = mp.get_context("spawn")
    inq, outq = ctx.Queue(), ctx.Queue()
    child_env("cudapool", "stitch:True")
    p = ctx.Process(target=many_child, args=(inq, outq, n), daemon=True)
    p.start()
    let_child_take_descriptors(p.pid)
    # 2 MiB each: with stitching the default large pool maps 2 MiB pages, so
    # each tensor lies on a physical allocation of its own and every handle
    # differs.
    ts = [torch.full((MiB // 2,), float(i), device="cuda") for i in range(n)]
    torch.cuda.synchronize()
    handles = {cudapool._lib.ipc_share(x.data_ptr())[0] for x in ts}
    t0 = time.perf_counter()
    inq.put(ts)
    try:
        msg = outq.get(timeout=WAIT)
    except _queue.Empty:
        p.kill()
        return {"timeout": "the consumer did not answer"}
    msg["send_and_check_s"] = time.perf_counter() - t0
    msg["distinct_handles"] = len(handles)
    p.join(timeout=60)
    msg["child_exitcode"] = p.exitcode
    del ts
    torch.cuda.synchronize()
    return msg


# -- noperm: without the parent's permission, a clear error ------------------

def noperm_child(inq, outq):
    try:
        inq.get(timeout=WAIT)
        outq.put({"error": None})
    except BaseException as e:
        outq.put({"error": "%s: %s" % (type(e).__name__, e)})


def noperm():
    ctx = mp.get_context("spawn")
    inq, outq = ctx.Queue(), ctx.Queue()
    child_env("cudapool", "stitch:True")
    p = ctx.Process(target=noperm_child, args=(inq, outq), daemon=True)
    p.start()
    t = torch.full((MiB,), 1.0, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    inq.put(t)
    try:
        msg = outq.get(timeout=WAIT)
    except _queue.Empty:
        p.kill()
        return {"timeout": "the child did not answer: a hang"}
    msg["seconds"] = time.perf_counter() - t0
    p.join(timeout=60)
    return msg


if __name__ == "__main__":
    scenario = os.environ["IPC_SCENARIO"]
    # This process's allocator reads its configuration now, before
    # child_env changes the environment for the child.
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    if scenario == "pair":
        result = pair(os.environ["IPC_CHILD_ROLE"], os.environ["IPC_CHILD_CONF"], allow=True)
    elif scenario == "stitch":
        result = stitch()
    elif scenario == "many":
        result = many(int(os.environ["IPC_IMPORTS"]))
    else:
        result = noperm()
    result["_mode"] = cudapool.mode() if ROLE == "cudapool" else "native"
    print("IPC-RESULT " + json.dumps(result, sort_keys=True), flush=True)
'''


def _tail(text, n=4000):
    return (text or "")[-n:]


def run(tmp_path, name, role, conf, **extra):
    """Run the scenario script as the parent with allocator role and
    configuration conf; returns its result."""
    script = tmp_path / f"ipc_{name}.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in SCRUB}
    env["PYTHONPATH"] = os.pathsep.join([gpu_common.PYTHON_DIR] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PYTHONUNBUFFERED"] = "1"
    env["IPC_SCENARIO"], env["IPC_ROLE"] = name.split("_")[0], role
    env["CUDAPOOL_CONF" if role == "cudapool" else "PYTORCH_CUDA_ALLOC_CONF"] = conf
    env.update({k: str(v) for k, v in extra.items()})
    proc = subprocess.Popen([sys.executable, str(script)], cwd=str(tmp_path), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the group we started: the spawned child too
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        pytest.fail(f"{name}: timed out after {TIMEOUT}s (a hang is a failure)\n--- stdout\n{_tail(out)}\n--- stderr\n{_tail(err)}",
                    pytrace=False)
    lines = [line for line in out.splitlines() if line.startswith(MARK)]
    if proc.returncode != 0 or len(lines) != 1:
        pytest.fail(f"{name}: exit code {proc.returncode}\n--- stdout\n{_tail(out)}\n--- stderr\n{_tail(err)}", pytrace=False)
    res = json.loads(lines[0][len(MARK):])
    print(f"{name}: {res}")
    return res


def check_pair(r, parent, child):
    assert r.get("timeout") is None, r
    assert r["error"] is None, f"the child failed: {r['error']}"
    assert r["parent_expandable"] is True, f"the {parent} parent's tensor is not in an expandable segment"
    assert r["child_expandable"] is True, f"the {child} child's tensor is not in an expandable segment"
    assert r["child_ok"], "the child read wrong values"
    assert r["parent_sees_write"], "the child's write did not reach the parent's tensor"
    assert r["back_ok"], "the parent read wrong values from the child's tensor"
    assert r["child_exitcode"] == 0
    assert r["child_mode"] == child


# native -> cudapool and cudapool -> native, each pair both ways: the
# parent's tensor goes to the child, the child's back to the parent.
def test_native_parent_cudapool_child(tmp_path):
    r = run(tmp_path, "pair_native", "native", "expandable_segments:True",
            IPC_CHILD_ROLE="cudapool", IPC_CHILD_CONF="expandable_segments:True")  # with stitching
    assert r["_mode"] == "native"
    check_pair(r, "native", "cudapool")


def test_cudapool_parent_native_child(tmp_path):
    # Without stitching: the large pool's 20 MiB chunks, grown whole.
    r = run(tmp_path, "pair_cudapool", "cudapool", "expandable_segments:True,stitch:False",
            IPC_CHILD_ROLE="native", IPC_CHILD_CONF="expandable_segments:True")
    assert r["_mode"] == "class"
    check_pair(r, "cudapool", "native")


def test_cudapool_stitching_parent_native_child(tmp_path):
    """Stitching (expandable_segments:True) maps the default pools page by
    page: 2 MiB pages, which native PyTorch imports as well."""
    r = run(tmp_path, "pair_cudapoolstitch", "cudapool", "expandable_segments:True",
            IPC_CHILD_ROLE="native", IPC_CHILD_CONF="expandable_segments:True")
    check_pair(r, "cudapool", "native")


def test_cudapool_to_cudapool_while_stitching(tmp_path):
    r = run(tmp_path, "stitch", "cudapool", "stitch:True")
    assert r.get("error") is None, f"the child failed: {r['error']}"
    assert r["parent_expandable"] and r["child_expandable"]
    assert r["first_ok"], "the child read wrong values"
    assert r["remaps"] > 0, "the parent did not stitch while its tensor was shared"
    assert r["parent_still_sees"] and r["after_stitch_ok"], "the shared tensor changed while the parent stitched"
    assert r["moved_pages_ok"], "a tensor on moved pages arrived wrong"
    assert r["back_ok"] and r["parent_sees_write"]
    assert r["child_exitcode"] == 0


def test_ten_thousand_imports_in_one_consumer(tmp_path):
    """Each tensor on its own physical allocation: ten thousand distinct
    handles, all open at once in one cudapool consumer, whose imports
    reserve only the bytes they cover (2 MiB each). PyTorch's own import
    reserves 9/8 of the device per import: on an 80 GB GPU its address
    space runs out after about 1,450. Each exported allocation holds a
    descriptor of the sender until it is released."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    n = IMPORTS
    if hard != resource.RLIM_INFINITY and hard < n + 2000:
        pytest.skip(f"RLIMIT_NOFILE's hard limit is {hard}: the sender cannot hold {n} exported descriptors")
    free, _ = torch.cuda.mem_get_info()
    if free < n * 2 * gpu_common.MiB + 2 * gpu_common.GiB:
        pytest.skip(f"{free >> 30} GiB free on the GPU: {n} tensors of 2 MiB do not fit")
    r = run(tmp_path, "many", "cudapool", "stitch:True", IPC_IMPORTS=n)
    assert r.get("error") is None, r.get("error")
    assert r.get("timeout") is None, r
    assert r["ok"], "the consumer read wrong values"
    assert r["distinct_handles"] == n, f"{r['distinct_handles']} distinct handles for {n} tensors"
    assert r["distinct"] == n
    assert r["child_exitcode"] == 0
    print(f"{n} imports: opened in {r['open_s']:.2f} s (with the queue's transfer), closed in {r['close_s']:.2f} s")


@pytest.mark.skipif(SCOPE != 1 or _has_cap_sys_ptrace(),
                    reason="kernel.yama.ptrace_scope is not 1, or this process has CAP_SYS_PTRACE: a child may take its parent's descriptors")
def test_child_without_permission_gets_a_clear_error(tmp_path):
    """Under ptrace_scope 1 a child may not take its parent's descriptors
    unless the parent names it: cudapool's import fails at once with an
    error that says so, raised in the child as a Python exception."""
    r = run(tmp_path, "noperm", "cudapool", "stitch:True")
    assert r.get("timeout") is None, r["timeout"]
    err = r["error"]
    assert err is not None, "the import worked without the parent's permission"
    assert "ptrace permission to process" in err and "kernel.yama.ptrace_scope" in err, err
    assert r["seconds"] < 60
