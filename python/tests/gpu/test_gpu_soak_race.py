# SPDX-License-Identifier: Apache-2.0
"""The capture-time record_stream race (docs/reliability.md), on the GPU: with cudapool
a tensor freed with a record_stream use during another thread's
thread-local capture is never reused while the reading kernel runs.
gpu/race_record_stream.py does the work in fresh processes (cudapool must be
installed before CUDA starts); this checks its result. Native PyTorch is run
too and its bad reads are reported, not judged (its allocator loses this
race: that is the point).

Skips without torch or a GPU."""

import json
import os

import gpu_common

torch = gpu_common.require_cuda()

SCRIPT = os.path.join(os.path.dirname(gpu_common.PYTHON_DIR), "gpu", "race_record_stream.py")
REPEATS = int(os.environ.get("RACE_REPEATS", "30"))


def run(allocator):
    p = gpu_common.python([SCRIPT, "--allocator", allocator, "--repeats", str(REPEATS), "--json"],
                          timeout=REPEATS * 5 + 120)
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    assert lines, f"{allocator}: no result (rc={p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    return json.loads(lines[-1]), p


def test_cudapool_never_reuses_a_block_still_read():
    r, p = run("cudapool")
    assert p.returncode == 0, p.stderr[-4000:]
    assert r["repeats"] == REPEATS
    assert r["graph_errors"] == 0, p.stderr[-4000:]
    assert r["bad_reads"] == 0, f"cudapool: {r['bad_reads']} of {REPEATS} delayed reads saw overwritten data"
    # reused_at_once is not checked: once the delayed reader has finished
    # (the capture thread's replay can outlast its sleep), the event
    # cudapool records after the capture is already complete and the
    # block may rightly be reused; a read of overwritten data is the error.


def test_native_result_recorded():
    r, p = run("native")
    assert p.returncode == 0, p.stderr[-4000:]
    assert r["repeats"] == REPEATS
    print(f"\nnative PyTorch {r['torch']}: {r['bad_reads']} bad reads, x reused at once {r['reused_at_once']} "
          f"times, of {REPEATS} repeats")
