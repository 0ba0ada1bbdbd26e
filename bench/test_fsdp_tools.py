# SPDX-License-Identifier: Apache-2.0
"""Tests of the FSDP2 tools' pure parts: the trace converter of
bench/record_trace.py, the thread accounting of bench/fsdp2_bench.py and
gpu/fsdp_counters.py's table. None needs torch or a GPU."""
import importlib.util
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import record_trace  # noqa: E402


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


fsdp2_bench = load(os.path.join(HERE, "fsdp2_bench.py"), "fsdp2_bench")
fsdp_counters = load(os.path.join(HERE, "..", "gpu", "fsdp_counters.py"), "fsdp_counters")


def test_snapshot_ops_numbers_allocations_and_streams_in_order():
    trace = [
        {"action": "alloc", "addr": 0x100, "size": 512, "stream": 0},
        {"action": "alloc", "addr": 0x200, "size": 4096, "stream": 77},
        {"action": "free_requested", "addr": 0x100},
        {"action": "free_completed", "addr": 0x100},  # not an operation of the caller
        {"action": "free_requested", "addr": 0x999},  # allocated before the recording
        {"action": "alloc", "addr": 0x100, "size": 1024, "stream": 77},  # the address reused: a new id
        {"action": "free_requested", "addr": 0x200},
    ]
    lines, nallocs, nstreams = record_trace.snapshot_ops({"device_traces": [trace]})
    assert lines == ["a 0 512 0", "a 1 4096 1", "f 0", "a 2 1024 1", "f 1"]
    assert (nallocs, nstreams) == (3, 2)


def test_write_trace_comments_the_header(tmp_path):
    out = tmp_path / "t.txt"
    record_trace.write_trace(str(out), ["a 0 512 0", "f 0"], ["first", "second"])
    assert out.read_text() == "# first\n# second\na 0 512 0\nf 0\n"


def test_thread_deltas_per_step_busiest_first(monkeypatch):
    monkeypatch.setattr(os, "getpid", lambda: 10)
    before = {10: ("python3", 1.0, 5, 1), 11: ("pt_autograd_0", 2.0, 0, 0), 12: ("idle", 0.5, 3, 0)}
    after = {10: ("python3", 1.4, 9, 3), 11: ("pt_autograd_0", 2.8, 4, 8), 12: ("idle", 0.5, 3, 0),
             13: ("new", 0.2, 40, 0)}
    rows = fsdp2_bench.thread_deltas(before, after, steps=4)
    assert rows == [["pt_autograd_0", False, 200.0, 1.0, 2.0], ["python3", True, 100.0, 1.0, 0.5],
                    ["new", False, 50.0, 10.0, 0.0]]  # the idle thread is left out


def test_thread_times_reads_this_process():
    threads = fsdp2_bench.thread_times()
    if not os.path.isdir("/proc/self/task"):
        assert threads == {}
        return
    assert os.getpid() in threads
    name, cpu, vol, inv = threads[os.getpid()]
    assert name and cpu >= 0 and vol >= 0 and inv >= 0


def test_fsdp_counters_prints_each_launch_and_its_threads(tmp_path, capsys):
    rec = {"kind": "torch_turns", "config": "cudapool", "section": "fsdp", "turns_kind": "fsdp-native/cudapool",
           "turns_round": "1", "turns_role": "test", "fsdp_ms_per_step": 66.44, "fsdp_cpu_ms_per_step": 66.43,
           "fsdp_allocation_per_step": 1387.4, "fsdp_front_hits_per_step": 60.3,
           "fsdp_threads": [["pt_autograd_0", False, 34.5, 3, 76], ["python3", True, 33.0, 2, 46.2],
                            ["python3", False, 0.75, 104, 65]]}
    f = tmp_path / "r.json"
    f.write_text("noise\n" + json.dumps(rec) + "\n" + json.dumps({"section": "train"}) + "\n")
    fsdp_counters.main([str(f)])
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3  # header, the launch, its threads
    assert out[1].startswith("fsdp-native/cudapool:1:test cudapool")
    assert "66.44" in out[1] and "1387.4" in out[1] and "60.3" in out[1]
    assert "main 33.00 ms cpu, 2.0+46.2 switches; 2 others 35.25 ms cpu, 107.0+141.0 switches" in out[2]

