# SPDX-License-Identifier: Apache-2.0
"""Unit tests of the benchmark suite's pure-Python parts (no torch, no GPU).

    python3 bench/test_report.py        or        python3 -m pytest bench/test_report.py
"""
import io
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
import types
import unittest
from contextlib import contextmanager, redirect_stderr, redirect_stdout

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import report  # noqa: E402
import torch_bench  # noqa: E402  (imports no torch at module level)
import cupy_alloc_bench  # noqa: E402  (imports no CuPy at module level)
import turns  # noqa: E402
import workloads  # noqa: E402

GiB = 1 << 30


def write_lines(path, objs):
    with open(path, "w") as f:
        for o in objs:
            f.write(o if isinstance(o, str) else json.dumps(o))
            f.write("\n")


def c_rec(config, hot, mixed, t4=4e6, t8=6e6, pa=5 * GiB, pr=6 * GiB):
    return [
        {"kind": "c", "config": config, "section": "init", "backend": config, "reps": 5},
        {"kind": "c", "config": config, "section": "trace", "trace_peak_allocated": pa, "trace_peak_reserved": pr,
         "trace_ns_per_op": 300.0, "trace_ops": 6653, "trace_repeats": 5},
        {"kind": "c", "config": config, "section": "hot", "hot_ns_per_pair": hot, "hot_pairs": 1000000},
        {"kind": "c", "config": config, "section": "mixed", "mixed_ns_per_pair": mixed, "mixed_pairs": 200000},
        {"kind": "c", "config": config, "section": "threads", "threads4_pairs_per_s": t4,
         "threads8_pairs_per_s": t8, "thread_secs": 0.5, "thread_reps": 3},
    ]


def torch_rec(config, step_ms, pa, pr, pool, small=2.3, mixed=3.1):
    return [
        {"kind": "torch", "config": config, "section": "meta", "torch_version": "2.11.0+cu130",
         "device_name": "NVIDIA H200", "torch_cuda": "13.0"},
        {"kind": "torch", "config": config, "section": "train", "train_ms_per_step": step_ms,
         "train_peak_allocated": pa, "train_peak_reserved": pr, "train_steps": 40},
        {"kind": "torch", "config": config, "section": "graph", "graph_capture_ms": 100.0, "graph_replay_ms": 8.0,
         "graph_pool_bytes": pool, "graph_devmem_delta": pool,
         "graph_pool_source": "mem_get_info" if config == "async" else "reserved"},
        {"kind": "torch", "config": config, "section": "empty", "empty_small_us": small, "empty_mixed_us": mixed},
    ]


class Unavailable(Exception):
    """The stand-in bench_ext's ExtensionUnavailable."""


def fake_torch(empty=lambda n, dtype, device: object()):
    """What torch_bench's torch.empty loops use of torch."""
    return types.SimpleNamespace(device=lambda *a: "cuda:0", uint8="u8", empty=empty)


@contextmanager
def fake_ext(**funcs):
    """A stand-in for bench_ext (the benchmark's build of the C++ class)
    with funcs, installed in sys.modules for the block's duration."""
    ext = types.ModuleType("bench_ext")
    ext.ExtensionUnavailable = Unavailable
    for k, v in funcs.items():
        setattr(ext, k, v)
    saved = {"bench_ext": sys.modules.get("bench_ext")}
    sys.modules["bench_ext"] = ext
    try:
        yield ext
    finally:
        restore(sys.modules, saved)


def restore(mapping, saved):
    """Puts back saved's entries in mapping (None: absent before)."""
    for k, v in saved.items():
        if v is None:
            mapping.pop(k, None)
        else:
            mapping[k] = v


def row(rows, label_start):
    for r in rows:
        if r[0].label.startswith(label_start):
            return r
    raise KeyError(label_start)


class TestWorkloads(unittest.TestCase):
    def test_mixed_sequence_matches_c_generator(self):
        # The first entries printed by `c_bench --print-mixed 8` (bench/workloads.h).
        expect = [(286924, 119), (7545, 90), (1093, 246), (46540577, 248), (33203284, 164), (3581, 131),
                  (28533608, 89), (663682, 62)]
        sizes, slots = workloads.mixed_sequence(8)
        self.assertEqual(list(zip(sizes, slots)), expect)

    def test_mixed_sequence_range(self):
        sizes, slots = workloads.mixed_sequence(4096)
        self.assertGreaterEqual(min(sizes), 512)
        self.assertLess(max(sizes), 144 << 20)
        self.assertTrue(all(0 <= s < workloads.LIVE for s in slots))

    def test_warmup_lens_sees_every_timed_length(self):
        lens = [512, 128, 512, 256, 1024, 128, 256, 640, 1024]
        warm = workloads.warmup_lens(lens, 2)
        # The first two steps as they were, then each new timed length once,
        # in order of first use.
        self.assertEqual(warm, [512, 128, 256, 1024, 640])
        self.assertTrue(set(lens[2:]) <= set(warm))
        self.assertEqual(workloads.warmup_lens(lens, 0), [512, 128, 256, 1024, 640])
        self.assertEqual(workloads.warmup_lens([64, 64], 5), [64, 64])


class TestReport(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def full_run(self):
        write_lines(os.path.join(self.dir, "c_native.json"), c_rec("native", 480.0, 830.0))
        write_lines(os.path.join(self.dir, "c_expandable.json"), c_rec("expandable", 500.0, 900.0))
        write_lines(os.path.join(self.dir, "c_async.json"), c_rec("async", 900.0, 1200.0))
        write_lines(os.path.join(self.dir, "c_cudapool.json"), c_rec("cudapool", 400.0, 600.0, t4=8e6))
        write_lines(os.path.join(self.dir, "c_cudapool_exp.json"), c_rec("cudapool_exp", 410.0, 620.0))
        write_lines(os.path.join(self.dir, "torch_cudapool_exp.json"),
                    torch_rec("cudapool_exp", 36.5, 10 * GiB, 10.5 * GiB, 700 << 20))
        write_lines(os.path.join(self.dir, "torch_native.json"), torch_rec("native", 36.1, 10 * GiB, 12 * GiB, 800 << 20))
        write_lines(os.path.join(self.dir, "torch_expandable.json"),
                    torch_rec("expandable", 35.0, 10 * GiB, 11 * GiB, 700 << 20))
        write_lines(os.path.join(self.dir, "torch_async.json"), torch_rec("async", 38.6, 10 * GiB, 11 * GiB, 600 << 20))
        write_lines(os.path.join(self.dir, "torch_cudapool.json"),
                    torch_rec("cudapool", 37.0, 10 * GiB, 11 * GiB, 800 << 20, small=2.5))
        write_lines(os.path.join(self.dir, "meta.json"), [
            {"kind": "meta", "date_utc": "2026-11-22 10:00 UTC", "gpu": "NVIDIA H200", "driver": "580.1",
             "torch_version": "2.11.0+cu130", "torch_cuda": "13.0"}])

    def test_values_ratios_and_targets(self):
        self.full_run()
        res = report.load(self.dir)
        rows, notes = report.build_rows(res)
        hot = row(rows, "C: malloc+free, 4 KiB")
        self.assertEqual(hot[1]["native"], "480")
        self.assertEqual(hot[1]["cudapool"], "400")
        self.assertEqual(hot[2], "0.833x")
        self.assertEqual(hot[4], "NO")  # 0.833 > 0.5
        mixed = row(rows, "C: malloc+free, mixed")
        self.assertEqual(mixed[4], "NO")  # 600/830 = 0.72 > 0.6
        self.assertEqual(row(rows, "torch.empty + free, 4 KiB")[4], "NO")  # 2.5/2.3 > 0.95
        step = row(rows, "GPT-2 training step")
        self.assertEqual(step[2], "1.025x")
        self.assertEqual(step[4], "NO")  # > 1.0
        self.assertEqual(row(rows, "training peak reserved")[4], "yes")
        self.assertEqual(row(rows, "CUDA graph private pool")[4], "yes")  # equal is met
        # Capture: judged by the paired in-process measure, absent here.
        self.assertEqual(row(rows, "CUDA graph capture")[3], "<= 1.02x paired")
        self.assertEqual(row(rows, "CUDA graph capture")[4], "n/a (no paired measure)")
        self.assertEqual(row(rows, "training reserved / allocated")[1]["native"], "1.200")
        self.assertEqual(row(rows, "C: 4 threads")[1]["cudapool"], "8.00")
        self.assertEqual(row(rows, "C: 4 threads")[2], "2.000x")
        # the async graph pool comes from mem_get_info: footnoted
        self.assertIn("[", row(rows, "CUDA graph private pool")[1]["async"])
        self.assertTrue(any("mem_get_info" in n for n in notes))
        self.assertNotIn("n/a", "".join(row(rows, "trace replay: peak reserved")[1].values()))
        self.assertEqual(row(rows, "training reserved / allocated")[1]["cudapool_exp"], "1.050")
        # 1.05 <= native expandable's 1.1; 36.5 / 36.1 = 1.011 <= 1.02
        self.assertTrue(any(n.startswith("cudapool expandable: training reserved/allocated 1.050 vs native "
                                         "expandable 1.100 (met); step time 1.011x native") for n in notes), notes)

    def test_repeated_runs_median_and_range(self):
        self.full_run()
        # Two more runs of the C level for native and cudapool (run_bench.sh's REPEATS), in other files.
        write_lines(os.path.join(self.dir, "c_native_r2.json"), c_rec("native", 500.0, 800.0))
        write_lines(os.path.join(self.dir, "c_native_r3.json"), c_rec("native", 470.0, 810.0, t4=3e6))
        write_lines(os.path.join(self.dir, "c_cudapool_r2.json"), c_rec("cudapool", 440.0, 700.0, t4=8e6))
        write_lines(os.path.join(self.dir, "c_cudapool_r3.json"), [
            {"kind": "c", "config": "cudapool", "section": "hot", "hot_ns_per_pair": -1}])  # unknown: ignored
        res = report.load(self.dir)
        rows, notes = report.build_rows(res)
        hot = row(rows, "C: malloc+free, 4 KiB")
        self.assertEqual(hot[1]["native"], "480 (470-500)")
        self.assertEqual(hot[1]["cudapool"], "420 (400-440)")  # the -1 run does not count
        self.assertEqual(hot[2], "0.875x")  # 420 / 480: ratio of the medians
        mixed = row(rows, "C: malloc+free, mixed")
        self.assertEqual(mixed[1]["native"], "810 (800-830)")
        self.assertEqual(mixed[2], "0.802x")  # 650 / 810
        self.assertEqual(mixed[4], "NO")  # the median misses 0.8 though one run met it
        self.assertEqual(hot[1]["expandable"], "500")  # one run: no range
        self.assertEqual(row(rows, "C: 4 threads")[1]["cudapool"], "8.00")  # equal runs: no range
        self.assertEqual(row(rows, "trace replay: peak reserved")[1]["native"], "6.00")
        self.assertEqual(row(rows, "training reserved / allocated")[1]["native"], "1.200")  # derived: no range
        self.assertEqual(row(rows, "C: 4 threads")[1]["native"], "4.00 (3.00-4.00)")  # a derived row with runs
        self.assertTrue(any("median (min-max) of the runs" in n and "C level: 1-3 runs" in n for n in notes), notes)

    def test_ring_runs_are_named(self):
        # Torch runs whose done lines count turns (bench/turn_ring.py) are
        # said to be rings, in the runs note and the training note.
        self.full_run()
        res = report.load(self.dir)
        self.assertEqual(report.ring_runs(res), 0)
        for c in report.CONFIGS:
            for r in ("", "_r2"):
                write_lines(os.path.join(self.dir, f"torch_{c}{r}.json"),
                            torch_rec(c, 36.0, 10 * GiB, 11 * GiB, 700 << 20) +
                            [{"kind": "torch", "config": c, "section": "done", "turns": 9, "turns_partner_gone": ""}])
        res = report.load(self.dir)
        self.assertEqual(report.ring_runs(res), 2)
        rows, notes = report.build_rows(res)
        self.assertTrue(any("torch level: 2 runs (2 of them rings" in n for n in notes), notes)
        self.assertTrue(any(n.startswith("training ms/step") and "(2 in rings taking turns)" in n for n in notes), notes)
        # One configuration without turns: not all rings.
        write_lines(os.path.join(self.dir, "torch_async_r2.json"), torch_rec("async", 36.0, 10 * GiB, 11 * GiB, 700 << 20))
        self.assertEqual(report.ring_runs(report.load(self.dir)), 1)

    def test_ring_note_pairs_each_ring(self):
        # Per ring, cudapool's process against native's of the same run; a
        # run without turns (not a ring) is left out of the note.
        cap = {("native", 1): 5.0, ("native", 2): 8.0, ("native", 3): 6.0,
               ("cudapool", 1): 4.5, ("cudapool", 2): 8.8, ("cudapool", 3): 3.0,
               ("expandable", 1): 5.0, ("cudapool_exp", 1): 5.5}
        for (c, r), v in cap.items():
            lines = [{"kind": "torch", "config": c, "section": "graph", "graph_capture_ms": v}]
            if r < 3:
                lines.append({"kind": "torch", "config": c, "section": "done", "turns": 9})
            write_lines(os.path.join(self.dir, f"torch_{c}{'' if r == 1 else f'_r{r}'}.json"), lines)
        res = report.load(self.dir)
        note = report.ring_note(res)
        self.assertIn("CUDA graph capture (forward) 1.000x (0.900-1.100, 2 rings)", note)
        self.assertIn("cudapool expandable / native expandable 1.100x (1.100-1.100, 1 rings)", note)
        self.assertNotIn("training", note)
        rows, notes = report.build_rows(res)
        self.assertEqual(row(rows, "CUDA graph capture")[2], "0.750x")  # the table: 4.5 / 6.0, medians of 3 runs
        self.assertIn(note, notes)

    def test_fsdp_runs(self):
        for i, (n, c) in enumerate([(34.8, 33.0), (36.0, 34.1), (35.1, 33.5), (35.5, 33.9), (34.9, 33.2)]):
            suffix = "" if i == 0 else f"_r{i + 1}"
            write_lines(os.path.join(self.dir, f"fsdp_native{suffix}.json"), [
                {"kind": "torch", "config": "native", "section": "fsdp", "fsdp_ms_per_step": n, "fsdp_step_ms": [n]}])
            write_lines(os.path.join(self.dir, f"fsdp_cudapool{suffix}.json"), [
                "[rank0]:" + json.dumps({"kind": "torch", "config": "cudapool", "section": "fsdp",
                                         "fsdp_ms_per_step": c})])
        rows, notes = report.build_rows(report.load(self.dir))
        self.assertIn("FSDP2, 2 GPUs, GPT-2 training step (CUDA-event timed, ranks pinned, 5 launches each), ms/step: "
                      "native 35.10 (34.80-36.00), cudapool 33.50 (33.00-34.10); cudapool/native 0.954x "
                      "(target <= 1x: met); 95% bootstrap interval 0.930-0.974x, 5% wide: resolved to 5%", notes)
        # Launches spread over 20%: the median may meet the target, the resolution does not.
        for i, (n, c) in enumerate([(80.8, 75.4), (85.8, 84.2), (87.7, 82.9), (87.1, 90.0), (72.4, 88.0)]):
            suffix = "" if i == 0 else f"_r{i + 1}"
            for cfg, v in (("native", n), ("cudapool", c)):
                write_lines(os.path.join(self.dir, f"fsdp_{cfg}{suffix}.json"), [
                    {"kind": "torch", "config": cfg, "section": "fsdp", "fsdp_ms_per_step": v}])
        notes = report.build_rows(report.load(self.dir))[1]
        fsdp = [n for n in notes if n.startswith("FSDP2")]
        self.assertEqual(len(fsdp), 1, notes)
        self.assertIn("cudapool/native 0.981x (target <= 1x: met)", fsdp[0])
        self.assertIn("not resolved to 5%", fsdp[0])
        # FSDP2's launches are counted in its own note, not as torch-level runs.
        self.assertFalse(any("torch level: 5 runs" in n for n in notes), notes)

    def test_readme_fsdp_row(self):
        # FSDP2 in the README's table: each side's launches, their ratio, and
        # the turn pairs that judge it; no row where part fsdp did not run.
        self.full_run()
        res = report.load(self.dir)
        self.assertNotIn("FSDP2", report.render_readme(res, report.build_rows(res)[0]))
        for i, (n, c) in enumerate([(85.0, 91.0), (86.0, 92.0), (90.0, 88.0)]):
            suffix = "" if i == 0 else f"_r{i + 1}"
            for cfg, v in (("native", n), ("cudapool", c)):
                write_lines(os.path.join(self.dir, f"fsdp_{cfg}{suffix}.json"), [
                    {"kind": "torch", "config": cfg, "section": "fsdp", "fsdp_ms_per_step": v}])
        res = report.load(self.dir)
        text = report.render_readme(res, report.build_rows(res)[0])
        self.assertIn("| FSDP2, 2 GPUs: GPT-2 training step | ms/step | 86.00 (85.00-90.00) | 91.00 (88.00-92.00) | "
                      "1.058x | n/a (target <= 1x paired) |", text)
        self.assertNotIn("two launches taking turns", text)  # no pairs: no such measure to describe

        def proc(rnd, role, cfg, steps):
            tag = {"kind": "torch_turns", "config": cfg, "turns_kind": "fsdp-native/cudapool",
                   "turns_round": str(rnd), "turns_role": role}
            return [dict(tag, section="fsdp", fsdp_step_ms=steps, fsdp_ms_per_step=steps[0], turns=len(steps))]
        for r, f in ((1, 1.05), (2, 0.97), (3, 0.98)):
            write_lines(os.path.join(self.dir, f"fsdp_turns{'' if r == 1 else f'_r{r}'}.json"),
                        proc(r, "base", "native", [80.0, 90.0, 85.0]) +
                        proc(r, "test", "cudapool", [80.0 * f, 90.0 * f, 85.0 * f]))
        res = report.load(self.dir)
        text = report.render_readme(res, report.build_rows(res)[0])
        self.assertIn("| 1.058x | 0.980x (0.970-1.050), 3 pairs, target <= 1x: met |", text)
        self.assertIn(" The capture rows and FSDP2's are judged by it (the target in their paired cell).", text)
        self.assertIn("FSDP2: two launches taking turns step by step", text)
        self.assertIn("over the processes, rings or pairs.", text)
        # The note judges by the pairs too, the ratio of medians beside.
        note = [n for n in report.build_rows(res)[1] if n.startswith("FSDP2")]
        self.assertIn("cudapool/native 1.058x (ratio of medians; the target, <= 1x, is judged by the 3 turn pairs: "
                      "0.980x, met)", note[0])
        # With the reduce-overhead rows too: three groups.
        write_lines(os.path.join(self.dir, "torch_altcompile.json"), [
            {"kind": "torch", "config": "cudapool", "section": "altcompile", "alt_decode_ratio": 0.99,
             "alt_compiled_ratio": 0.98}])
        res = report.load(self.dir)
        text = report.render_readme(res, report.build_rows(res)[0])
        self.assertIn(" The capture rows, the reduce-overhead rows and FSDP2's are judged by it", text)
        # One side only: no row, and the README as without part fsdp.
        for f in glob.glob(os.path.join(self.dir, "fsdp_cudapool*.json")) + glob.glob(
                os.path.join(self.dir, "fsdp_turns*.json")):
            os.remove(f)
        os.remove(os.path.join(self.dir, "torch_altcompile.json"))
        write_lines(os.path.join(self.dir, "pair_0.json"), [
            {"kind": "pair", "section": "hot", "ratio": 0.07, "cudapool_ns": 40.0, "native_ns": 500.0}])
        res = report.load(self.dir)
        text = report.render_readme(res, report.build_rows(res)[0])
        self.assertNotIn("FSDP2", text)
        self.assertIn("; each the median (min-max) over the processes or rings.", text)

    def test_ratio_interval(self):
        self.assertIsNone(report.ratio_interval([1.0, 2.0], [1.0, 2.0, 3.0]))  # fewer than 3 runs
        self.assertEqual(report.ratio_interval([2.0] * 4, [1.0] * 3), (0.5, 0.5))
        lo, hi = report.ratio_interval([10, 11, 12, 13, 14], [5, 6, 7, 8, 9])
        self.assertLess(lo, 7 / 12)
        self.assertGreater(hi, 7 / 12)
        self.assertGreaterEqual(lo, 5 / 14)
        self.assertLessEqual(hi, 9 / 10)
        self.assertEqual((lo, hi), report.ratio_interval([10, 11, 12, 13, 14], [5, 6, 7, 8, 9]))  # seeded
        self.assertEqual(report.samples({"_samples": {"k": [1.0, -1, float("nan"), 2]}}, "k"), [1.0, 2.0])

    def test_floor_note(self):
        for cfg, small in (("native", 2.4), ("cudapool", 2.0), ("floor", 1.7)):
            write_lines(os.path.join(self.dir, f"torch_{cfg}.json"), [
                {"kind": "torch", "config": cfg, "section": "empty", "empty_small_us": small}])
        notes = report.build_rows(report.load(self.dir))[1]
        self.assertTrue(any(n.startswith("floor:") and "cudapool adds 300 ns to that floor" in n for n in notes), notes)
        # A floor measured above cudapool (the host's slower state): said so, no negative cost.
        write_lines(os.path.join(self.dir, "torch_floor.json"), [
            {"kind": "torch", "config": "floor", "section": "empty", "empty_small_us": 3.3}])
        notes = report.build_rows(report.load(self.dir))[1]
        floor = [n for n in notes if n.startswith("floor:")]
        self.assertEqual(len(floor), 1, notes)
        self.assertIn("cudapool's median is 1,300 ns below the floor's", floor[0])
        self.assertNotIn("adds -", floor[0])

    def test_pair_note(self):
        def pair(sec, ratio, cp, nat):
            return {"kind": "pair", "section": sec, "ratio": ratio, "cudapool_ns": cp, "native_ns": nat,
                    "ratio_reps": [ratio] * 15, "cudapool_reps_ns": [cp] * 15, "native_reps_ns": [nat] * 15}
        for i, (h, m) in enumerate(((0.08, 0.72), (0.09, 0.58), (0.07, 0.70))):
            write_lines(os.path.join(self.dir, f"pair_{i}.json"), [
                {"kind": "pair", "section": "init", "cudapool": "cudapool", "native": "native", "reps": 15},
                pair("hot", h, 40.0, 500.0), pair("mixed", m, 700.0 + i, 1000.0)])
        res = report.load(self.dir)
        self.assertEqual(res.bad_lines, 0)
        note = [n for n in report.build_rows(res)[1] if n.startswith("C level with both allocators")]
        self.assertEqual(len(note), 1)
        self.assertIn("3 processes of 15 pairs of reps", note[0])
        self.assertIn("4 KiB hot pair 0.080x (0.070-0.090) (cudapool 40 ns, native 500 ns; target <= 0.5x: met)", note[0])
        self.assertIn("mixed sizes 0.700x (0.580-0.720) (cudapool 701 ns, native 1,000 ns; target <= 0.6x: NOT met)",
                      note[0])
        # A failed run is said, not hidden.
        for f in os.listdir(self.dir):
            os.remove(os.path.join(self.dir, f))
        write_lines(os.path.join(self.dir, "pair_0.json"), [
            {"kind": "pair", "section": "init", "error": "no CUDA device"}])
        notes = report.build_rows(report.load(self.dir))[1]
        self.assertIn("C level in one process: failed (init: no CUDA device)", notes)

    def test_turns_note(self):
        def proc(kind, rnd, role, cfg, small, cap, turns_n=12, gone=""):
            tag = {"kind": "torch_turns", "config": cfg, "turns_kind": kind, "turns_round": str(rnd),
                   "turns_role": role}
            return [dict(tag, section="graph", graph_capture_reps_ms=cap, graph_capture_ms=cap[0]),
                    dict(tag, section="empty", empty_small_reps_us=small, empty_small_us=small[0]),
                    dict(tag, section="done", turns=turns_n, turns_partner_gone=gone)]
        for r, f in ((1, 0.6), (2, 0.7), (3, 0.65)):
            write_lines(os.path.join(self.dir, f"turns_native_cudapool_{r}.json"),
                        proc("native/cudapool", r, "base", "native", [4.0, 4.4], [8.0, 8.0]) +
                        proc("native/cudapool", r, "test", "cudapool", [4.0 * f, 4.4 * f], [8.8, 8.8], gone="ended"))
        write_lines(os.path.join(self.dir, "turns_expandable_cudapool_exp_1.json"),
                    proc("expandable/cudapool_exp", 1, "base", "expandable", [4.0], [8.0]) +
                    proc("expandable/cudapool_exp", 1, "test", "cudapool_exp", [3.0], [6.0]) +
                    proc("expandable/cudapool_exp", 2, "base", "expandable", [4.0], [8.0]) +
                    proc("expandable/cudapool_exp", 2, "test", "cudapool_exp", [3.0], [6.0], turns_n=3))
        res = report.load(self.dir)
        self.assertEqual(res.bad_lines, 0)
        self.assertIsNone(res.record("torch", "native"))  # the pairs stay out of the unpaired rows
        note = [n for n in report.build_rows(res)[1] if n.startswith("torch level with two processes")]
        self.assertEqual(len(note), 1)
        # The capture rows are judged by the paired in-process measure (the
        # alt note), so the turn pairs give their figure without a verdict.
        self.assertIn("native/cudapool (3 pairs): capture 1.100x (1.100-1.100), "
                      "torch.empty 4 KiB 0.650x (0.600-0.700); target <= 0.95x: met", note[0])
        self.assertIn("expandable/cudapool_exp (1 pair): capture 0.750x, torch.empty 4 KiB 0.750x;", note[0])
        self.assertIn("not paired: expandable/cudapool_exp 2: turns differ: 12 and 3", note[0])
        self.assertLess(note[0].index("native/cudapool (3"), note[0].index("expandable/cudapool_exp (1"))

    def test_alt_note(self):
        # Each process's alt line is a paired figure of its own: the note
        # gives their median (min-max), and none reaches the table's rows.
        for r, (small, mixed) in enumerate(((0.80, 1.02), (0.78, 0.93), (0.82, 1.04)), 1):
            # As torch_bench.py writes them: meta and done lines around the
            # alt line, which must not count as runs of cudapool either.
            write_lines(os.path.join(self.dir, f"torch_alt_r{r}.json"), [
                {"kind": "torch", "config": "cudapool", "section": "meta", "device_total_bytes": 80 << 30},
                {"kind": "torch", "config": "cudapool", "section": "alt", "alt_small_ratio": small,
                 "alt_small_ratio_reps": [small] * 9, "alt_mixed_ratio": mixed, "alt_mixed_ratio_reps": [mixed] * 9,
                 "alt_capture_ratio": 0.96 + 0.02 * r, "alt_capture_pairs": 6},
                {"kind": "torch", "config": "cudapool", "section": "done", "torch_total_s": 10.0}])
        write_lines(os.path.join(self.dir, "torch_alt_r4.json"), [
            {"kind": "torch", "config": "cudapool", "section": "alt", "alt_error": "RuntimeError: no"}])
        res = report.load(self.dir)
        self.assertEqual(res.bad_lines, 0)
        self.assertIsNone(res.record("torch", "cudapool"))
        note = [n for n in report.build_rows(res)[1] if n.startswith("torch.empty with PyTorch's allocator")]
        self.assertEqual(len(note), 1)
        self.assertIn("3 processes of 9 pairs of reps", note[0])
        self.assertIn("4 KiB 0.800x (0.780-0.820) (target <= 0.95x: met); "
                      "mixed sizes 1.020x (0.930-1.040) (target <= 0.95x: NOT met)", note[0])
        self.assertIn("the capture rows' judge): cudapool/native 1.000x (0.980-1.020), 3 processes of 6 pairs "
                      "(target <= 1.02x: met)", note[0])
        # The failed process is kept for the reasons, not for the figures.
        self.assertEqual(res.alt_errors, {"cudapool": ["alt: RuntimeError: no"]})

    def test_alt_section_alternates_and_switches_back(self):
        # torch_bench.py's alt section against a stand-in for torch and for
        # bench_ext: each pair of reps runs both sides, who goes first
        # alternating, and the switch ends on cudapool even after a failure.
        made = []
        fake = fake_torch(empty=lambda n, dtype, device: made.append(n) or object())
        calls = []
        with fake_ext(passthrough=calls.append):
            args = torch_bench.parse_args(["cudapool", "--sections", "alt", "--reps", "3", "--empty-pairs", "10",
                                           "--mixed-pairs", "10", "--alt-captures", "0"])
            out = torch_bench.bench_alt(fake, args)
            self.assertEqual(len(out["alt_small_ratio_reps"]), 3)
            self.assertEqual(len(out["alt_mixed_native_reps_us"]), 3)
            # set-up (native, cudapool), then per loop: N C, C N, N C; then off.
            self.assertEqual(calls, [True, False] + [True, False, False, True, True, False] * 2 + [False])
            calls.clear()
            fake.empty = lambda n, dtype, device: 1 / 0
            with self.assertRaises(ZeroDivisionError):
                torch_bench.bench_alt(fake, args)
            self.assertEqual(calls, [True, False])
            with self.assertRaises(RuntimeError):  # native has no passthrough
                torch_bench.bench_alt(fake, torch_bench.parse_args(["native", "--sections", "alt"]))

    @contextmanager
    def fake_captures(self, state, **ext_funcs):
        """torch, the model and the clock for alt_captures: native's captures
        take 5 ms, cudapool's 4; each capture is logged with its side and
        counted in state["graphs"] while its graph lives."""
        clock = [0.0]

        class Graph:
            def __init__(self):
                state["graphs"] += 1

            def __del__(self):
                state["graphs"] -= 1

        @contextmanager
        def graph(g):
            side = "native" if state["native"] else "cudapool"
            state["log"].append(side)
            clock[0] += 5e-3 if state["native"] else 4e-3
            if "device" in state:  # a capture makes segments: native 2 of 20 MiB, cudapool 3 of 2 MiB
                n, mib = (2, 20) if state["native"] else (3, 2)
                dev = state["device"][side]
                dev[0] += n
                dev[2] += (n * mib) << 20
            yield

        def memory_stats():
            dev = state.get("device", {}).get("cudapool", [0, 0, 0])
            return {"num_device_alloc": dev[0], "num_device_free": dev[1], "reserved_bytes.all.current": dev[2]}

        fake = types.SimpleNamespace(
            no_grad=contextmanager(lambda: (yield)),
            cuda=types.SimpleNamespace(CUDAGraph=Graph, graph=graph, synchronize=lambda: None,
                                       empty_cache=lambda: None, current_device=lambda: 0,
                                       memory_stats=memory_stats))
        saved = (torch_bench.graph_model, torch_bench.warm_forward, torch_bench.time.perf_counter)
        torch_bench.graph_model = lambda torch, args: (lambda x: object(), None)
        torch_bench.warm_forward = lambda torch, model, x: None
        torch_bench.time.perf_counter = lambda: clock[0]
        try:
            with fake_ext(passthrough=lambda on: state.update(native=on), **ext_funcs) as ext:
                yield fake, ext
        finally:
            torch_bench.graph_model, torch_bench.warm_forward, torch_bench.time.perf_counter = saved

    def test_alt_captures_alternate_and_pair(self):
        # The alt section's captures: one discarded capture per side, then
        # pairs whose first side alternates; every capture meets its side's
        # allocator, the switch ends on cudapool, and the ratios pair the
        # captures in order.
        state = {"native": False, "log": [], "graphs": 0}
        with self.fake_captures(state) as (fake, ext):
            args = torch_bench.parse_args(["cudapool", "--sections", "alt", "--alt-captures", "3"])
            out = torch_bench.alt_captures(fake, args, ext)
        self.assertEqual(state["log"], ["native", "cudapool", "cudapool", "native", "native", "cudapool",
                                        "cudapool", "native"])
        self.assertFalse(state["native"])
        self.assertEqual(state["graphs"], 0, "every graph deleted")
        self.assertEqual(out["alt_capture_pairs"], 3)
        self.assertEqual([round(r, 6) for r in out["alt_capture_ratio_reps"]], [0.8, 0.8, 0.8])
        self.assertEqual([round(v, 6) for v in out["alt_capture_native_reps_ms"]], [5.0, 5.0, 5.0])

    def test_timed_captures_split_each_capture_by_call(self):
        # --alt-timing with captures: each capture's timed calls are its
        # own (what ran before its clock started is taken and dropped),
        # summed per capture, their slowest few apart, per side.
        state = {"native": False, "log": [], "graphs": 0, "device": {"native": [0, 0, 0], "cudapool": [0, 0, 0]}}
        takes = []

        def native_counts(device):
            self.assertEqual(device, 0)
            return tuple(state["device"]["native"])

        def timing_take():
            # After a capture: ten 1 us allocate() calls and one 50 us
            # (native) or ten 1.5 us and one 80 us (cudapool); before one,
            # a stray call that must not count.
            takes.append(state["native"])
            side = "native" if state["native"] else "cudapool"
            if len(takes) % 2:
                return {(side, "alloc"): ([999_000.0], 1)}
            slow, typical = (50_000.0, 1_000.0) if side == "native" else (80_000.0, 1_500.0)
            return {(side, "alloc"): ([typical] * 10 + [slow], 11), (side, "free"): ([], 0)}

        with self.fake_captures(state, timing_take=timing_take, native_counts=native_counts) as (fake, ext):
            args = torch_bench.parse_args(["cudapool", "--sections", "alt", "--alt-captures", "3", "--alt-timing"])
            out = torch_bench.timed_captures(fake, args, ext)
        self.assertEqual(len(takes), 16, "one take before and one after each of the 8 captures")
        self.assertAlmostEqual(out["alt_capture_native_alloc_per_capture_ms"], 0.060)
        self.assertAlmostEqual(out["alt_capture_native_alloc_top8_per_capture_ms"], 0.057)
        self.assertAlmostEqual(out["alt_capture_cudapool_alloc_per_capture_ms"], 0.095)
        self.assertAlmostEqual(out["alt_capture_cudapool_alloc_top8_per_capture_ms"], 0.0905)
        self.assertEqual(out["alt_capture_cudapool_alloc_top_us"], [80.0] + [1.5] * 7, "slowest first")
        self.assertEqual(out["alt_capture_native_device_allocs"], 2, "from native's own counts")
        self.assertEqual(out["alt_capture_cudapool_device_allocs"], 3, "from cudapool's memory_stats")
        self.assertEqual(out["alt_capture_native_reserved_mib"], 40)
        self.assertEqual(out["alt_capture_cudapool_reserved_mib"], 6)
        self.assertEqual(out["alt_capture_cudapool_alloc_calls"], 33, "3 captures of 11 calls count")
        self.assertEqual(out["alt_capture_cudapool_alloc_median_ns"], 1_500.0)
        self.assertNotIn("alt_capture_native_free_per_capture_ms", out, "no calls, no figure")
        self.assertAlmostEqual(out["alt_capture_native_total_ms"], 5.0)
        self.assertAlmostEqual(out["alt_capture_cudapool_enter_ms"], 4.0)  # the fake capture takes its time entering
        self.assertNotIn("alt_capture_rows", out)
        self.assertAlmostEqual(out["alt_capture_ratio"], 0.8)

    def test_timed_captures_without_native_counts(self):
        # Where the benchmark's build cannot read native's counts, native's
        # device figures are left out and cudapool's still come.
        state = {"native": False, "log": [], "graphs": 0, "device": {"native": [0, 0, 0], "cudapool": [0, 0, 0]}}

        def native_counts(device):
            raise Unavailable("no native allocator at hand")

        with self.fake_captures(state, timing_take=lambda: {}, native_counts=native_counts) as (fake, ext):
            args = torch_bench.parse_args(["cudapool", "--sections", "alt", "--alt-captures", "2", "--alt-timing"])
            out = torch_bench.timed_captures(fake, args, ext)
        self.assertNotIn("alt_capture_native_device_allocs", out)
        self.assertEqual(out["alt_capture_cudapool_device_allocs"], 3)

    def test_alt_captures_failing_keeps_the_loops(self):
        # A capture that fails leaves the loops' results in the alt line.
        saved = torch_bench.graph_model
        torch_bench.graph_model = lambda torch, args: 1 / 0
        try:
            with fake_ext(passthrough=lambda on: None):
                args = torch_bench.parse_args(["cudapool", "--sections", "alt", "--reps", "1", "--empty-pairs", "10",
                                               "--mixed-pairs", "10", "--alt-captures", "2"])
                out = torch_bench.bench_alt(fake_torch(), args)
        finally:
            torch_bench.graph_model = saved
        self.assertIn("alt_small_ratio", out)
        self.assertIn("ZeroDivisionError", out["alt_capture_error"])

    def test_params_line_names_the_captures(self):
        write_lines(os.path.join(self.dir, "torch_native.json"), [
            {"kind": "torch", "config": "native", "section": "graph", "graph_capture_ms": 5.0, "graph_batch": 8,
             "graph_seq": 512, "graph_replays": 50, "graph_captures": 6}])
        line = report.params_line(report.load(self.dir))
        self.assertIn("graph: batch 8 x seq 512, capture time the median of 6 captures per process", line)

    def test_library_b(self):
        saved = {k: os.environ.get(k) for k in ("CUDAPOOL_LIBRARY", "CUDAPOOL_LIBRARY_B")}
        try:
            os.environ["CUDAPOOL_LIBRARY"] = "/a/libcudapool.so"
            os.environ.pop("CUDAPOOL_LIBRARY_B", None)
            torch_bench.use_library_b("cudapool")  # not a second build: nothing changes
            self.assertEqual(os.environ["CUDAPOOL_LIBRARY"], "/a/libcudapool.so")
            with self.assertRaises(RuntimeError):
                torch_bench.use_library_b("cudapool_b")
            os.environ["CUDAPOOL_LIBRARY_B"] = "/b/libcudapool.so"
            torch_bench.use_library_b("cudapool_exp_b")
            self.assertEqual(os.environ["CUDAPOOL_LIBRARY"], "/b/libcudapool.so")
        finally:
            restore(os.environ, saved)

    def test_header_names_the_go_runtime(self):
        res = report.Results()
        res.meta = {"git_commit": "abc1234", "git_dirty": False, "go_runtime": "tick"}
        self.assertIn("- cudapool: commit abc1234; Go runtime: tick", report.machine_lines(res))
        res.meta = {"git_commit": "abc1234", "git_dirty": True}  # a run from before the field
        self.assertIn("- cudapool: commit abc1234 (with local changes)", report.machine_lines(res))
        # The README's one-line header names them too.
        res.meta = {"git_commit": "abc1234", "go_runtime": "tick", "gpu": "NVIDIA H100"}
        self.assertIn("NVIDIA H100, PyTorch unknown, cudapool commit abc1234 (Go runtime: tick).",
                      report.render_readme(res, []))

    def test_failed_repeat_is_explained(self):
        write_lines(os.path.join(self.dir, "c_native.json"), c_rec("native", 480.0, 830.0))
        write_lines(os.path.join(self.dir, "steps.jsonl"), [
            {"kind": "step", "name": "c_cudapool", "status": "ok", "reason": ""},
            {"kind": "step", "name": "c_cudapool_r2", "status": "timeout", "reason": "timed out after 120s"},
        ])
        res = report.load(self.dir)
        rows, notes = report.build_rows(res)
        self.assertIn("c_cudapool_r2: timed out after 120s", report.text_table(rows, notes))

    def test_missing_and_broken_results_do_not_crash(self):
        write_lines(os.path.join(self.dir, "c_native.json"), c_rec("native", 480.0, 830.0))
        write_lines(os.path.join(self.dir, "c_cudapool.json"), [
            {"kind": "c", "config": "cudapool", "section": "init", "backend": "cudapool"},
            {"kind": "c", "config": "cudapool", "section": "trace", "trace_error": "malloc of 8 bytes failed"},
            {"kind": "c", "config": "cudapool", "section": "hot", "hot_ns_per_pair": 410.0},
            '{"kind": "c", "config": "cudapool", "section": "mixed", "mixed_ns_per',  # cut short by a kill
            "not json at all",
            "[1, 2]",
            {"kind": "c", "config": "cudapool", "section": "threads", "threads4_pairs_per_s": -1,
             "threads8_error": "thread 3: malloc failed"},
        ])
        write_lines(os.path.join(self.dir, "torch_async.json"), [
            {"kind": "torch", "config": "async", "section": "meta", "meta_error": "RuntimeError: no GPU"}])
        write_lines(os.path.join(self.dir, "steps.jsonl"), [
            {"kind": "step", "name": "torch_native", "status": "timeout", "reason": "timed out after 240 s"},
            {"kind": "step", "name": "build_native", "status": "failed", "reason": "g++ failed"},
        ])
        res = report.load(self.dir)
        self.assertEqual(res.bad_lines, 1)  # the cut line; lines not starting with "{" are skipped
        rows, notes = report.build_rows(res)
        self.assertEqual(row(rows, "C: malloc+free, 4 KiB")[2], "0.854x")
        mixed = row(rows, "C: malloc+free, mixed")
        self.assertTrue(mixed[1]["cudapool"].startswith("n/a ["))
        self.assertEqual(mixed[4], "n/a")
        text = report.text_table(rows, notes)
        self.assertIn("trace: malloc of 8 bytes failed", text)
        self.assertIn("threads8: thread 3: malloc failed", text)
        self.assertEqual(row(rows, "C: 4 threads")[1]["cudapool"].split()[0], "n/a")  # -1: unknown
        self.assertIn("torch_native: timed out after 240 s", text)
        self.assertIn("meta: RuntimeError: no GPU", text)
        self.assertIn("build_native: g++ failed", text)  # c expandable: no results, build failed
        self.assertIn("section mixed did not report", text)
        md = report.md_table(rows, notes)
        self.assertEqual(md.count("\n| "), len(report.METRICS) + 0)  # header + rows, one line each

    def test_empty_directory(self):
        buf = io.StringIO()
        with redirect_stdout(buf):
            rc = report.main(["--results", os.path.join(self.dir, "nothing-here")])
        self.assertEqual(rc, 0)
        out = buf.getvalue()
        self.assertIn("no result files", out)
        self.assertIn("n/a", out)

    def test_main_writes_markdown_and_readme(self):
        self.full_run()
        readme = os.path.join(self.dir, "README.md")
        with open(readme, "w") as f:
            f.write("# cudapool\n\nintro\n\n## Performance\n\n<!-- perf:start -->\nold table\n<!-- perf:end -->\n\nrest\n")
        md = os.path.join(self.dir, "out", "RESULTS.md")
        buf = io.StringIO()
        with redirect_stdout(buf):
            report.main(["--results", self.dir, "--md", md, "--readme", readme])
        with open(md) as f:
            results = f.read()
        self.assertIn("# cudapool benchmark results", results)
        self.assertIn("NVIDIA H200", results)
        self.assertIn("2.11.0+cu130", results)
        self.assertIn("2026-11-22 10:00 UTC", results)
        with open(readme) as f:
            text = f.read()
        self.assertNotIn("old table", text)
        self.assertTrue(text.startswith("# cudapool\n\nintro\n\n## Performance\n\n<!-- perf:start -->\n"))
        self.assertTrue(text.endswith("<!-- perf:end -->\n\nrest\n"))
        # The README gets the compact tables: native and cudapool with their
        # ratio (no paired figure in this run), and memory for every
        # configuration; RESULTS.md keeps every column and note.
        self.assertIn("| GPT-2 training step, variable seq len | ms/step | 36.10 | 37.00 | 1.025x | - |", text)
        self.assertIn("| GPT-2 training: peak reserved / peak allocated | 1.200 | 1.100 | 1.100 | 1.100 | 1.050 |",
                      text)
        self.assertIn("| CUDA graph private pool, MiB | 800.0 | 700.0 | 600.0 | 800.0 | 700.0 |", text)
        self.assertIn("NVIDIA H200 (driver 580.1), PyTorch 2.11.0+cu130 (CUDA 13.0), 2026-11-22 10:00 UTC", text)
        self.assertNotIn("trace replay: peak allocated", text)  # RESULTS.md's row, not the README's
        self.assertNotIn("| met? |", text)
        self.assertIn("| GPT-2 training step, variable seq len | ms/step | 36.10 | 35.00 | 38.60 | 37.00 | 36.50 | "
                      "1.025x | <= 1x | NO |", results)
        self.assertNotIn("# cudapool benchmark results", text)
        # a second run leaves it as it is
        with redirect_stdout(io.StringIO()):
            report.main(["--results", self.dir, "--readme", readme])
        with open(readme) as f:
            self.assertEqual(f.read(), text)

    def write_trace(self, label, reserved_gib, run=1, allocated_gib=10):
        """ctrace_LABEL_CFG[_rN].json as run_bench.sh's part "traces" writes
        them: c_bench's lines (init and done with their numbers too), the
        trace section's reserved per config in GiB."""
        for cfg, r in reserved_gib.items():
            name = f"ctrace_{label}_{cfg}" + (f"_r{run}" if run > 1 else "") + ".json"
            write_lines(os.path.join(self.dir, name), [
                {"kind": "c", "config": cfg, "section": "init", "backend": cfg, "hot_size": 4096,
                 "live_blocks": 256, "reps": 5, "mixed_seed": 1},
                {"kind": "c", "config": cfg, "section": "trace", "trace_peak_allocated": allocated_gib * GiB,
                 "trace_peak_reserved": r * GiB, "trace_ns_per_op": 100.0, "trace_ops": 169797},
                {"kind": "c", "config": cfg, "section": "done", "c_total_s": 2.5}])

    def test_traces_part_rows_and_the_memory_margin(self):
        # The other traces' replays become rows of their own (their keys
        # renamed, demo/trace.txt's left alone), in RESULTS.md and the
        # README's memory table, and a line under that table states by how
        # much cudapool's defaults reserve less than the best of PyTorch's
        # allocators, and where they do not.
        self.full_run()
        self.write_trace("kv1", {"native": 11.5, "expandable": 10.5, "async": 11.0, "cudapool": 10.1,
                                 "cudapool_exp": 10.5})
        self.write_trace("kv1", {"cudapool": 10.3}, run=2)
        self.write_trace("kv2", {"native": 15.0, "expandable": 12.5, "async": 11.5, "cudapool": 10.1,
                                 "cudapool_exp": 12.5})
        res = report.load(self.dir)
        rec = res.record("c", "native")
        self.assertEqual(rec["trace_peak_reserved"], 6 * GiB, "demo/trace.txt's keys untouched")
        self.assertEqual(rec["kv1_peak_reserved"], 11.5 * GiB)
        self.assertEqual(res.record("c", "cudapool")["kv1_peak_reserved"], 10.2 * GiB, "the median of two runs")
        self.assertEqual(res.record("c", "native")["reps"], 5)
        self.assertNotIn("c_total_s", res.record("c", "native"), "the replays' other lines add no numbers")
        rows, notes = report.build_rows(res)
        kv1 = row(rows, "LLM serving, 1 stream: reserved / allocated")
        self.assertEqual(kv1[1]["native"], "1.150")
        self.assertEqual(kv1[1]["cudapool"].split(" ")[0], "1.020")
        self.assertEqual(row(rows, "LLM serving, prefill stream: peak reserved")[1]["async"], "11.50")
        # Runs: part c's one, kv1's two of cudapool; the replays' init and
        # done lines would make native's init figures three runs.
        self.assertIn("(C level: 1-2 runs)", report.text_table(rows, notes))
        text = report.render_readme(res, rows)
        self.assertIn("| LLM serving, 1 stream (C trace): peak reserved / peak allocated | 1.150 | 1.050 | 1.100 | "
                      "1.020 | 1.050 |", text)
        self.assertNotIn("FSDP2 training, rank 0 (C trace)", text, "a trace not run has no row")
        margin = text.rstrip("\n").split("\n")[-1]
        # kv1: 1 - 1.02/1.05 = 2.9%; kv2: 1 - 1.01/1.15 = 12.2%; demo/trace.txt
        # (6 GiB / 5 GiB everywhere), the training ratio (1.1, as native
        # expandable's and cudaMallocAsync's: a tie names the first) and the
        # graph pool (800 against 600 MiB) are not below.
        self.assertTrue(margin.startswith("cudapool's defaults reserve less than every PyTorch allocator on 2 of 5 "
                                          "memory rows: from 2.9% (LLM serving, 1 stream"), margin)
        self.assertIn("to 12.2% (LLM serving, prefill stream (C trace)", margin)
        self.assertIn("Not below them all: GPT-2 training: peak reserved / peak allocated (1.100 against native "
                      "expandable's 1.100)", margin)
        self.assertIn("CUDA graph private pool, MiB (800.0 against native cudaMallocAsync's 600.0)", margin)

    def test_memory_margin_on_every_row_and_rows_not_compared(self):
        # Below them all on every row shown: one range. A row lacking one of
        # PyTorch's allocators is named as not compared, and the count says
        # so.
        write_lines(os.path.join(self.dir, "meta.json"), [{"kind": "meta", "gpu": "NVIDIA H200"}])
        self.write_trace("kv1", {"native": 11.5, "expandable": 10.5, "async": 11.0, "cudapool": 10.1})
        res = report.load(self.dir)
        rows = report.build_rows(res)[0]
        keep = [r for r in rows if r[0].label.startswith("LLM serving, 1 stream")]
        by_label = {r[0].label: r for r in keep}
        self.assertEqual(report.memory_margin(res, by_label), "cudapool's defaults reserve less than every PyTorch "
                                                              "allocator on every memory row: 3.8% less than the best of them.")
        self.assertEqual(report.memory_margin(res, {}), "")
        self.write_trace("kv2", {"native": 15.0, "expandable": 12.5, "cudapool": 10.1})  # no cudaMallocAsync
        res = report.load(self.dir)
        text = report.render_readme(res, report.build_rows(res)[0])
        margin = text.rstrip("\n").split("\n")[-1]
        self.assertIn("on 1 of 5 memory rows: 3.8% less", margin)
        self.assertIn("Not compared: GPT-2 training: peak reserved / peak allocated (no value for native, native "
                      "expandable, native cudaMallocAsync, cudapool)", margin)
        self.assertIn("LLM serving, prefill stream (C trace): peak reserved / peak allocated (no value for native "
                      "cudaMallocAsync)", margin)
        self.assertIn("| GPT-2 training: peak reserved / peak allocated | n/a | n/a |", text, "shown though not run")
        self.assertNotIn("FSDP2 training, rank 0 (C trace)", text, "a trace not run has no row")

    def test_traces_reasons(self):
        # Why a trace row has no value: the replay's error, a failed step,
        # a failed generation of the traces, or the part not run; and part
        # c's rows say when only part traces ran.
        self.write_trace("kv1", {"native": 11.5, "cudapool": 10.1})
        write_lines(os.path.join(self.dir, "ctrace_kv1_expandable.json"), [
            {"kind": "c", "config": "expandable", "section": "trace", "trace_error": "malloc of 8 bytes failed"}])
        write_lines(os.path.join(self.dir, "ctrace_kv1_async.json"), [
            {"kind": "c", "config": "async", "section": "init", "init_error": "no CUDA device"}])
        write_lines(os.path.join(self.dir, "ctrace_nope_native.json"), [
            {"kind": "c", "config": "native", "section": "trace", "trace_peak_reserved": 1}])
        write_lines(os.path.join(self.dir, "steps.jsonl"), [
            {"kind": "step", "name": "ctrace_kv1_cudapool_exp_r2", "status": "timeout", "reason": "timed out after 120 s"},
            {"kind": "step", "name": "gen_traces", "status": "failed", "reason": "exit code 1"}])
        res = report.load(self.dir)
        self.assertEqual(res.bad_lines, 1, "a trace the report does not know is left out")
        self.assertNotIn("trace_peak_reserved", res.record("c", "native"))
        m = next(m for m in report.METRICS if m.label == "LLM serving, 1 stream: reserved / allocated")
        self.assertEqual(res.reason(m, "expandable"), "trace_kv1: malloc of 8 bytes failed")
        self.assertEqual(res.reason(m, "async"), "trace_kv1: init: no CUDA device")
        self.assertEqual(res.reason(m, "cudapool_exp"), "ctrace_kv1_cudapool_exp_r2: timed out after 120 s")
        m2 = next(m for m in report.METRICS if m.label == "LLM serving, prefill stream: reserved / allocated")
        self.assertEqual(res.reason(m2, "native"), "gen_traces: exit code 1")
        hot = next(m for m in report.METRICS if m.label.startswith("C: malloc+free, 4 KiB"))
        self.assertEqual(res.reason(hot, "native"), "not run (bench/run_bench.sh's part c was not in this run)")
        write_lines(os.path.join(self.dir, "steps.jsonl"), [])
        res = report.load(self.dir)
        self.assertEqual(res.reason(m2, "native"), "not run (bench/run_bench.sh's part traces was not in this run)")

    def test_readme_paired_column(self):
        # The README's paired column: pair_bench.c's processes for the C
        # rows, the alt processes for torch.empty and the capture, the rings
        # for the training step; a row without a paired measure shows "-".
        self.full_run()
        for i, h in enumerate((0.08, 0.06, 0.07)):
            write_lines(os.path.join(self.dir, f"pair_{i}.json"), [
                {"kind": "pair", "section": "hot", "ratio": h, "cudapool_ns": 40.0, "native_ns": 500.0}])
        write_lines(os.path.join(self.dir, "torch_alt.json"), [
            {"kind": "torch", "config": "cudapool", "section": "alt", "alt_small_ratio": 0.8,
             "alt_mixed_ratio": 0.9, "alt_capture_ratio": 1.01}])
        for r, (n, c) in enumerate(((30.0, 27.0), (32.0, 32.0)), 2):
            for cfg, v in (("native", n), ("cudapool", c)):
                write_lines(os.path.join(self.dir, f"torch_{cfg}_r{r}.json"), [
                    {"kind": "torch", "config": cfg, "section": "train", "train_ms_per_step": v},
                    {"kind": "torch", "config": cfg, "section": "done", "turns": 9}])
        res = report.load(self.dir)
        text = report.render_readme(res, report.build_rows(res)[0])
        self.assertIn("| C: malloc+free, 4 KiB hot loop | ns/pair | 480 | 400 | 0.833x | 0.070x (0.060-0.080) |", text)
        self.assertIn("| torch.empty + free, 4 KiB | us/pair | 2.30 | 2.50 | 1.087x | 0.800x |", text)
        self.assertIn("| CUDA graph capture (forward) | ms | 100.0 | 100.0 | 1.000x | 1.010x, target <= 1.02x: met |",
                      text)
        # No alt run with expandable segments: its row says what would judge it.
        self.assertIn("| CUDA graph capture (forward), expandable segments | ms | 100.0 | 100.0 | 1.000x | "
                      "n/a (target <= 1.02x paired) |", text)
        # The reduce-overhead rows, measured only in one process, are left out when not measured.
        self.assertNotIn("graph-tree decoding", text)
        # rings 2 and 3: 27/30 and 32/32
        self.assertIn("| 0.950x (0.900-1.000) |", text.split("GPT-2 training step")[1].split("\n")[0] + "|")
        self.assertIn("| C: malloc+free, mixed 512 B-144 MiB, 256 live | ns/pair | 830 | 600 | 0.723x | - |", text)
        self.assertIn("Paired: C rows", text)
        self.assertIn("training step: fresh processes taking turns", text)
        self.assertIn("of 1-3 fresh processes per allocator", text)

    def test_capture_rows_are_judged_by_the_paired_measure(self):
        # The ratio of medians over fresh processes reads 1.200x, above the
        # 1.02x target; the paired in-process measure reads 1.005x: the row
        # is met, and shows both numbers. And the other way round: a paired
        # measure above the target fails a row whose medians meet it.
        self.full_run()  # every capture 100 ms: then two runs each of these
        for cfg, cap in (("native", 5.0), ("cudapool", 6.0), ("expandable", 5.0), ("cudapool_exp", 4.0)):
            for r in (2, 3):
                write_lines(os.path.join(self.dir, f"torch_{cfg}_r{r}.json"), [
                    {"kind": "torch", "config": cfg, "section": "graph", "graph_capture_ms": cap}])
        for r, (c, e) in enumerate(((1.005, 1.03), (0.998, 1.04), (1.010, 1.05)), 1):
            write_lines(os.path.join(self.dir, f"torch_alt{'' if r == 1 else f'_r{r}'}.json"), [
                {"kind": "torch", "config": "cudapool", "section": "meta"},
                {"kind": "torch", "config": "cudapool", "section": "alt", "alt_capture_ratio": c,
                 "alt_capture_pairs": 6},
                {"kind": "torch", "config": "cudapool", "section": "done"}])
            write_lines(os.path.join(self.dir, f"torch_alt_exp{'' if r == 1 else f'_r{r}'}.json"), [
                {"kind": "torch", "config": "cudapool_exp", "section": "alt", "alt_capture_ratio": e,
                 "alt_capture_pairs": 6}])
        res = report.load(self.dir)
        rows, notes = report.build_rows(res)
        cap = row(rows, "CUDA graph capture")
        # medians of 3 runs: native 5.0, cudapool 6.0: 1.2x, above the target
        self.assertEqual(cap[1]["native"], "5.0 (5.0-100.0)")
        self.assertEqual(cap[2], "1.200x")
        self.assertEqual(cap[3], "<= 1.02x paired")
        self.assertEqual(cap[4], "yes (paired 1.005x, 0.998-1.010)")
        md = report.md_table(rows, notes)
        self.assertIn("| 1.200x | <= 1.02x paired | yes (paired 1.005x, 0.998-1.010) |", md)
        # The expandable pair: medians 4.0 against 5.0 meet 1.02x, the paired 1.04x does not.
        exp = [n for n in notes if n.startswith("cudapool expandable:")]
        self.assertEqual(len(exp), 1, notes)
        self.assertIn("graph capture 4.0 ms vs native expandable 5.0 ms = 0.800x (ratio of medians); target <= "
                      "1.02x by the paired in-process measure: NO (paired 1.040x, 1.030-1.050)", exp[0])
        text = report.render_readme(res, rows)
        self.assertIn("| CUDA graph capture (forward) | ms | 5.0 (5.0-100.0) | 6.0 (6.0-100.0) | 1.200x | "
                      "1.005x (0.998-1.010), target <= 1.02x: met |", text)
        self.assertIn("| CUDA graph capture (forward), expandable segments | ms | 5.0 (5.0-100.0) | 4.0 (4.0-100.0) "
                      "| 0.800x | 1.040x (1.030-1.050), target <= 1.02x: NOT met |", text)
        # The alt processes are paired figures, not runs of cudapool.
        self.assertEqual(len(res.record("torch", "cudapool")["_samples"]["graph_capture_ms"]), 3)
        # A ratio of medians above the target with a paired measure above it too: NO.
        for r in (1, 2, 3):
            os.remove(os.path.join(self.dir, f"torch_alt{'' if r == 1 else f'_r{r}'}.json"))
        write_lines(os.path.join(self.dir, "torch_alt.json"), [
            {"kind": "torch", "config": "cudapool", "section": "alt", "alt_capture_ratio": 1.03}])
        self.assertEqual(row(report.build_rows(report.load(self.dir))[0], "CUDA graph capture")[4],
                         "NO (paired 1.030x)")

    def altcompile_lines(self, cfg="cudapool", decode=(1.60, 1.56), compiled=(80.0, 81.0), **extra):
        nd, cd = decode
        nc, cc = compiled
        line = {"kind": "torch", "config": cfg, "section": "altcompile",
                "alt_decode_native_ms": nd, "alt_decode_cudapool_ms": cd, "alt_decode_ratio": cd / nd,
                "alt_decode_pairs": 6, "alt_decode_tokens": 64, "alt_decode_batch": 1, "alt_decode_prompt": 16,
                "alt_decode_layers": 12, "alt_decode_width": 768,
                "alt_decode_native_allocs_per_token": 6.0, "alt_decode_native_frees_per_token": 6.0,
                "alt_decode_cudapool_allocs_per_token": 6.0, "alt_decode_cudapool_frees_per_token": 6.0,
                "alt_compiled_native_us": nc, "alt_compiled_cudapool_us": cc, "alt_compiled_ratio": cc / nc,
                "alt_compiled_pairs": 6, "alt_compiled_calls": 2000, "alt_compiled_batch": 32,
                "alt_compiled_layers": 4, "alt_compiled_width": 1024}
        line.update(extra)
        return [{"kind": "torch", "config": cfg, "section": "meta", "device_total_bytes": 80 << 30}, line,
                {"kind": "torch", "config": cfg, "section": "done", "torch_total_s": 90.0}]

    def test_altcompile_rows(self):
        # The reduce-overhead rows: each side's cell is the median (min-max)
        # over the processes of its median rep; the row is judged by the
        # median of the processes' paired ratios.
        self.full_run()
        for r, (d, c) in enumerate((((1.60, 1.56), (80.0, 81.0)), ((1.70, 1.69), (90.0, 88.0)),
                                    ((1.50, 1.53), (85.0, 85.0))), 1):
            write_lines(os.path.join(self.dir, f"torch_altcompile{'' if r == 1 else f'_r{r}'}.json"),
                        self.altcompile_lines(decode=d, compiled=c))
        res = report.load(self.dir)
        self.assertEqual(res.bad_lines, 0)
        self.assertEqual(len(res.record("torch", "cudapool")["_samples"]["train_ms_per_step"]), 1, "no runs added")
        rows, notes = report.build_rows(res)
        dec = row(rows, "graph-tree decoding")
        self.assertEqual(dec[1]["native"], "1.600 (1.500-1.700)")
        self.assertEqual(dec[1]["cudapool"], "1.560 (1.530-1.690)")
        self.assertEqual(dec[1]["expandable"], "-")
        self.assertEqual(dec[2], "0.975x")  # 1.56 / 1.60
        self.assertEqual(dec[3], "<= 1x paired")
        # per-process ratios 0.975, 0.994, 1.020: median 0.994
        self.assertEqual(dec[4], "yes (paired 0.994x, 0.975-1.020)")
        comp = row(rows, "compiled model call")
        self.assertEqual(comp[1]["native"], "85.0 (80.0-90.0)")
        # per-process ratios 1.0125, 0.978, 1.0: the median, 1.0, meets 1.0
        self.assertEqual(comp[4], "yes (paired 1.000x, 0.978-1.012)")
        note = [n for n in notes if n.startswith("torch.compile(mode=")]
        self.assertEqual(len(note), 1, notes)
        self.assertIn("3 processes of 6 pairs", note[0])
        self.assertIn("batch 1, 64 greedy tokens per rep after a 16-token prompt", note[0])
        self.assertIn("(native 6 allocate() and 6 frees, cudapool 6 allocate() and 6 frees per token)", note[0])
        self.assertNotIn("differed", note[0])
        # A process whose sides' tokens differed, or that recorded graphs in its reps: said.
        write_lines(os.path.join(self.dir, "torch_altcompile_r4.json"), self.altcompile_lines(
            alt_decode_same_results=False, alt_compiled_cudapool_graphs_recorded_in_reps=1,
            alt_compiled_same_results=True))
        note4 = [n for n in report.build_rows(report.load(self.dir))[1] if n.startswith("torch.compile(mode=")][0]
        self.assertIn("decoding: the two sides' results differed in 1 of 4 processes", note4)
        self.assertIn("compiled call: cudapool recorded graphs during its reps in 1 of 4 processes", note4)
        os.remove(os.path.join(self.dir, "torch_altcompile_r4.json"))
        text = report.render_readme(res, rows)
        self.assertIn("| graph-tree decoding, static KV cache (reduce-overhead) | ms/token | 1.600 (1.500-1.700) | "
                      "1.560 (1.530-1.690) | 0.975x | 0.994x (0.975-1.020), target <= 1x: met |", text)
        self.assertIn("| compiled model call (reduce-overhead) | us/call | 85.0 (80.0-90.0) | 85.0 (81.0-88.0) | "
                      "1.000x | 1.000x (0.978-1.012), target <= 1x: met |", text)

    def test_altcompile_failures_are_explained(self):
        write_lines(os.path.join(self.dir, "torch_altcompile.json"), [
            {"kind": "torch", "config": "cudapool", "section": "altcompile",
             "altcompile_error": "RuntimeError: torch.compile is not available"}])
        rows, notes = report.build_rows(report.load(self.dir))
        dec = row(rows, "graph-tree decoding")
        self.assertTrue(dec[1]["native"].startswith("n/a ["), dec)
        self.assertEqual(dec[4], "n/a")
        self.assertIn("alt_decode: altcompile: RuntimeError: torch.compile is not available", notes)
        # One row failing inside the section: its own error.
        write_lines(os.path.join(self.dir, "torch_altcompile.json"),
                    self.altcompile_lines(alt_decode_error="RuntimeError: capture failed")[:1] +
                    [{"kind": "torch", "config": "cudapool", "section": "altcompile",
                      "alt_decode_error": "RuntimeError: capture failed", "alt_compiled_native_us": 80.0,
                      "alt_compiled_cudapool_us": 79.0, "alt_compiled_ratio": 0.9875}])
        rows, notes = report.build_rows(report.load(self.dir))
        self.assertIn("alt_decode: RuntimeError: capture failed", notes)
        self.assertEqual(row(rows, "compiled model call")[4], "yes (paired 0.988x)")
        # Not run at all: the step's failure, else what would measure it.
        os.remove(os.path.join(self.dir, "torch_altcompile.json"))
        self.assertTrue(any("torch_bench.py --sections altcompile" in n for n in report.build_rows(
            report.load(self.dir))[1]))
        write_lines(os.path.join(self.dir, "steps.jsonl"), [
            {"kind": "step", "name": "torch_altcompile_r2", "status": "timeout", "reason": "timed out after 300s"}])
        self.assertIn("torch_altcompile_r2: timed out after 300s", report.build_rows(report.load(self.dir))[1])

    def test_readme_without_markers_is_left_alone(self):
        readme = os.path.join(self.dir, "README.md")
        with open(readme, "w") as f:
            f.write("# cudapool\n<!-- perf:end -->\n<!-- perf:start -->\n")
        msg = report.update_readme(readme, "table\n")
        self.assertIn("no <!-- perf:start -->", msg)
        with open(readme) as f:
            self.assertEqual(f.read(), "# cudapool\n<!-- perf:end -->\n<!-- perf:start -->\n")
        self.assertIn("does not exist", report.update_readme(os.path.join(self.dir, "nope.md"), "x"))


class TestTorchBenchArgs(unittest.TestCase):
    def test_parse_args(self):
        a = torch_bench.parse_args(["cudapool", "--sections", "empty,train", "--steps", "3"])
        self.assertEqual(a.config, "cudapool")
        self.assertEqual(a.sections, ["train", "empty"])  # always in the fixed order
        self.assertEqual(a.steps, 3)
        self.assertEqual(torch_bench.parse_args(["native"]).graph_captures, 6)
        self.assertEqual(torch_bench.parse_args(["cudapool_nofront", "--graph-captures", "2"]).graph_captures, 2)
        for bad in (["native", "--sections", "bogus"], ["native", "--graph-captures", "0"]):
            with self.subTest(bad=bad), redirect_stdout(io.StringIO()), self.assertRaises(SystemExit):
                with open(os.devnull, "w") as devnull:
                    old, sys.stderr = sys.stderr, devnull
                    try:
                        torch_bench.parse_args(bad)
                    finally:
                        sys.stderr = old

    def test_every_cudapool_configuration_is_a_choice(self):
        # A configuration named only in CUDAPOOL_CONFS would be refused by
        # the argument parser, and its processes would fail in a ring.
        self.assertEqual(set(torch_bench.CUDAPOOL_CONFS) - set(torch_bench.CONFIGS), set())
        for name in torch_bench.CUDAPOOL_CONFS:
            self.assertEqual(torch_bench.parse_args([name]).config, name)

    def test_warm_forward(self):
        # A stand-in for torch.cuda that records the calls in order.
        calls = []

        class Stream:
            def __init__(self, name="side"):
                self.name = name

            def wait_stream(self, other):
                calls.append(f"{self.name} waits for {other.name}")

        class StreamCtx:
            def __init__(self, s):
                self.s = s

            def __enter__(self):
                calls.append(f"enter {self.s.name}")

            def __exit__(self, *exc):
                calls.append(f"leave {self.s.name}")

        main = Stream("main")
        cuda = type("cuda", (), {"Stream": staticmethod(Stream), "current_stream": staticmethod(lambda: main),
                                 "stream": staticmethod(StreamCtx),
                                 "synchronize": staticmethod(lambda: calls.append("synchronize"))})
        torch_bench.warm_forward(type("torch", (), {"cuda": cuda}), lambda x: calls.append(f"model({x})"), 7, n=2)
        self.assertEqual(calls, ["side waits for main", "enter side", "model(7)", "model(7)", "leave side",
                                 "main waits for side", "synchronize"])

    def test_altcompile_args(self):
        a = torch_bench.parse_args(["cudapool", "--sections", "altcompile,alt"])
        self.assertEqual(a.sections, ["alt", "altcompile"])
        self.assertEqual((a.alt_decode, a.decode_tokens, a.decode_prompt, a.decode_batch), (6, 64, 16, 1))
        self.assertEqual((a.alt_compiled, a.compiled_calls, a.compiled_batch, a.compiled_width,
                          a.compiled_layers), (6, 500, 32, 1024, 4))
        a = torch_bench.parse_args(["cudapool", "--sections", "altcompile", "--alt-decode", "0", "--alt-compiled", "2"])
        self.assertEqual((a.alt_decode, a.alt_compiled), (0, 2))
        self.assertNotIn("altcompile", torch_bench.parse_args(["cudapool"]).sections)  # only when asked for
        for bad in (["cudapool", "--alt-decode", "-1"], ["cudapool", "--decode-tokens", "0"],
                    ["cudapool", "--compiled-width", "0"], ["cudapool", "--decode-prompt", "1000", "--decode-tokens", "25"]):
            with self.subTest(bad=bad), redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()), \
                    self.assertRaises(SystemExit):
                torch_bench.parse_args(bad)

    def test_alt_native_conf(self):
        # The alt sections' native side has expandable segments when cudapool's configuration has.
        self.assertEqual(torch_bench.alt_native_conf("cudapool_exp", ["alt"]), "expandable_segments:True")
        self.assertEqual(torch_bench.alt_native_conf("cudapool_exp2", ["altcompile"]), "expandable_segments:True")
        self.assertEqual(torch_bench.alt_native_conf("cudapool", ["alt"]), "")
        self.assertEqual(torch_bench.alt_native_conf("cudapool_exp", ["graph", "empty"]), "")
        self.assertEqual(torch_bench.alt_native_conf("expandable", ["alt"]), "")

    def test_side_function(self):
        # Each side's copy has a code object of its own (torch.compile keeps
        # compiled code per code object) and its own globals.
        def f(x):
            return SCALE * x  # noqa: F821

        a = torch_bench.side_function(f, "native", SCALE=2)
        b = torch_bench.side_function(f, "cudapool", SCALE=3)
        self.assertIsNot(a.__code__, b.__code__)
        self.assertIsNot(a.__code__, f.__code__)
        self.assertEqual((a(5), b(5)), (10, 15))
        self.assertEqual((a.__name__, b.__code__.co_name), ("f_native", "f_cudapool"))
        self.assertEqual(torch_bench._decode_step.__code__.co_names[:2], ("MODEL", "decode"))

    def test_graph_trees_keep_each_side_apart(self):
        # A stand-in for torch._inductor.cudagraph_trees: a thread-local dict
        # of containers per device, each with a manager whose tree has roots
        # and children.
        class Node:
            def __init__(self, *children):
                self.children = {"f": list(children)}

        class Manager:
            def __init__(self, roots):
                self.roots, self.shut = roots, False

            def shutdown(self):
                self.shut = True

        class Container:
            def __init__(self, manager):
                self.tree_manager = manager

        trees = types.SimpleNamespace(local=types.SimpleNamespace(tree_manager_containers={}))
        trees.get_obj = lambda local, name: getattr(local, name)
        d = trees.local.tree_manager_containers
        g = torch_bench.GraphTrees(0, trees)
        self.assertIsNone(g.graphs("native"))
        g.use("native")
        self.assertNotIn(0, d)  # the side's first compiled call makes its container
        mn = Manager({"f": [Node(Node(), Node())]})
        d[0] = Container(mn)
        self.assertEqual(g.graphs("native"), 3)
        g.use("cudapool")
        self.assertNotIn(0, d, "cudapool gets a tree of its own")
        mc = Manager({"f": [Node()], "g": [Node()]})
        d[0] = Container(mc)
        self.assertEqual((g.graphs("native"), g.graphs("cudapool")), (3, 2))
        g.use("native")
        self.assertIs(d[0].tree_manager, mn)
        g.use("native")
        self.assertIs(d[0].tree_manager, mn)
        g.shutdown("native")
        self.assertTrue(mn.shut and not mc.shut)
        self.assertNotIn(0, d)
        g.use("cudapool")
        self.assertIs(d[0].tree_manager, mc)
        g.shutdown("cudapool")
        self.assertTrue(mc.shut)
        self.assertEqual(d, {})
        # A tree made before would be shared by both sides: refused.
        d[0] = Container(Manager({}))
        with self.assertRaisesRegex(RuntimeError, "exists already"):
            torch_bench.GraphTrees(0, trees)

    def test_altcompile_sides_alternate_in_their_turns(self):
        # Every step of a side (set-up, reps, the counted rep, its result,
        # its tree's end) runs with its switch and its tree in place; reps
        # alternate N C, C N, ... after one discarded rep each.
        log = []
        state = {"native": False, "timing": False}

        class Trees:
            side = None
            kept = {}

            def use(self, side):
                self.side = side

            def graphs(self, side):
                return 4

            def shutdown(self, side):
                log.append(("shutdown", side, self.side, state["native"]))

        trees = Trees()

        def where():
            return "native" if state["native"] else "cudapool"

        def setup(side):
            log.append(("setup", side, trees.side, where()))
            return side

        times = {"native": iter([9.0, 10.0, 10.0, 10.0, 9.0]), "cudapool": iter([9.0, 9.0, 9.5, 9.9, 9.0])}

        def rep(st, n):
            log.append(("rep", st, trees.side, where(), state["timing"]))
            return next(times[st])

        def take():
            side = where()
            return {(side, "alloc"): ([], 7 * 5), (side, "free"): ([], 6 * 5), (side, "begin_pool"): ([], 0)}

        fake_torch_ = types.SimpleNamespace(cuda=types.SimpleNamespace(synchronize=lambda: None))
        with fake_ext(passthrough=lambda on: state.update(native=on), timing_take=take,
                      timing=lambda on, cross=False: state.update(timing=on)) as ext:
            reps, counts, graphs, results = torch_bench.altcompile_sides(
                fake_torch_, ext, trees, setup, rep, lambda st: f"result of {st}", 3, 5)
        self.assertEqual(log[:2], [("setup", "native", "native", "native"), ("setup", "cudapool", "cudapool", "cudapool")])
        reps_log = [e for e in log if e[0] == "rep"]
        self.assertTrue(all(e[1] == e[2] == e[3] for e in reps_log), reps_log)
        self.assertEqual([e[1] for e in reps_log], ["native", "cudapool", "cudapool", "native", "native", "cudapool",
                                                   "cudapool", "native", "native", "cudapool"])
        self.assertEqual([e[4] for e in reps_log], [False] * 8 + [True, True])  # the counted reps last
        self.assertEqual(reps, {"native": [10.0, 10.0, 10.0], "cudapool": [9.0, 9.5, 9.9]})
        self.assertEqual(results, {"native": "result of native", "cudapool": "result of cudapool"})
        self.assertEqual(log[-2:], [("shutdown", "native", "native", True), ("shutdown", "cudapool", "cudapool", False)])
        self.assertFalse(state["native"] or state["timing"])
        out = torch_bench.altcompile_fields("alt_decode", "ms", "token", reps, counts, graphs, 5)
        self.assertAlmostEqual(out["alt_decode_ratio"], 0.95)
        self.assertEqual(out["alt_decode_pairs"], 3)
        self.assertEqual((out["alt_decode_native_ms"], out["alt_decode_cudapool_ms"]), (10.0, 9.5))
        self.assertEqual(out["alt_decode_native_allocs_per_token"], 7.0)
        self.assertEqual(out["alt_decode_cudapool_frees_per_token"], 6.0)
        self.assertEqual((out["alt_decode_native_pool_calls"], out["alt_decode_cudapool_other_allocs"]), (0, 0))
        self.assertEqual(out["alt_decode_native_graphs_recorded_in_reps"], 0)
        # A rep that fails still ends both trees, each in its turn, and the switch on cudapool.
        log.clear()
        with fake_ext(passthrough=lambda on: state.update(native=on), timing_take=take,
                      timing=lambda on, cross=False: None) as ext:
            with self.assertRaises(ZeroDivisionError):
                torch_bench.altcompile_sides(fake_torch_, ext, trees, setup, lambda st, n: 1 / 0, None, 3, 5)
        self.assertEqual([e for e in log if e[0] == "shutdown"],
                         [("shutdown", "native", "native", True), ("shutdown", "cudapool", "cudapool", False)])
        self.assertFalse(state["native"])

    def test_altcompile_rows_fail_apart(self):
        # Without torch's graph trees each row reports its error; the section
        # still returns its sizes, and the switch ends on cudapool.
        state = {"native": None}
        fake = types.SimpleNamespace(no_grad=contextmanager(lambda: (yield)),
                                     _dynamo=types.SimpleNamespace(reset=lambda: None),
                                     cuda=types.SimpleNamespace(synchronize=lambda: None, empty_cache=lambda: None))
        args = torch_bench.parse_args(["cudapool", "--sections", "altcompile", "--alt-decode", "2"])
        saved = torch_bench.GraphTrees
        torch_bench.GraphTrees = lambda: (_ for _ in ()).throw(RuntimeError("no graph trees here"))
        try:
            with fake_ext(passthrough=lambda on: state.update(native=on)):
                out = torch_bench.bench_altcompile(fake, args)
        finally:
            torch_bench.GraphTrees = saved
        self.assertEqual(out["alt_decode_error"], "RuntimeError: no graph trees here")
        self.assertEqual(out["alt_compiled_error"], "RuntimeError: no graph trees here")
        self.assertEqual((out["alt_decode_tokens"], out["alt_compiled_calls"]), (64, 500))
        with self.assertRaises(RuntimeError):
            torch_bench.bench_altcompile(fake, torch_bench.parse_args(["native", "--sections", "altcompile"]))

    def test_allocator_env(self):
        env = {"PYTORCH_CUDA_ALLOC_CONF": "x", "PYTORCH_ALLOC_CONF": "y", "CUDAPOOL_CONF": "z", "HOME": "/"}
        torch_bench.set_allocator_env("async", env)
        self.assertEqual(env, {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync", "HOME": "/"})
        torch_bench.set_allocator_env("cudapool", env)
        self.assertEqual(env, {"HOME": "/"})
        torch_bench.set_allocator_env("native", env)
        self.assertEqual(env, {"HOME": "/"})

    def test_wait_start(self):
        slept = []
        self.assertEqual(torch_bench.wait_start({}, clock=lambda: 100.0, sleep=slept.append), 0.0)
        self.assertEqual(torch_bench.wait_start({"BENCH_START_AT": "102.5"}, clock=lambda: 100.0, sleep=slept.append), 2.5)
        self.assertEqual(slept, [2.5])
        # Late: no sleep; capped at 60 s ahead.
        self.assertEqual(torch_bench.wait_start({"BENCH_START_AT": "99"}, clock=lambda: 100.0, sleep=slept.append), -1.0)
        self.assertEqual(torch_bench.wait_start({"BENCH_START_AT": "1000"}, clock=lambda: 100.0, sleep=slept.append), 60.0)
        self.assertEqual(slept, [2.5, 60.0])

    def test_sched_reexec(self):
        # cudapool_sched execs itself once with the GODEBUG setting added to
        # what was there; other configurations, and the exec'd process, do not.
        calls = []
        exe = lambda path, args, env: calls.append((path, args, env))
        torch_bench.sched_reexec("cudapool", {"GODEBUG": ""}, ["tb.py", "cudapool"], exe)
        self.assertEqual(calls, [])
        torch_bench.sched_reexec("cudapool_sched", {"GODEBUG": "gctrace=0", "HOME": "/"}, ["tb.py", "cudapool_sched"], exe)
        self.assertEqual(calls, [(sys.executable, [sys.executable, "tb.py", "cudapool_sched"],
                                  {"GODEBUG": "gctrace=0," + torch_bench.SCHED_GODEBUG, "HOME": "/"})])
        torch_bench.sched_reexec("cudapool_sched", calls[0][2], ["tb.py", "cudapool_sched"], exe)
        self.assertEqual(len(calls), 1)
        torch_bench.sched_reexec("cudapool_sched", {}, ["tb.py", "cudapool_sched"], exe)
        self.assertEqual(calls[1][2], {"GODEBUG": torch_bench.SCHED_GODEBUG})


# A process taking turns (run by TestTurns through python3 -c): it appends
# "NAME k" to LOG in each of its N turns, sleeping a little inside the turn.
TURN_CHILD = """
import sys, time
sys.path.insert(0, sys.argv[1])
import torch_bench
name, n, log = sys.argv[2], int(sys.argv[3]), sys.argv[4]
t = torch_bench.Turns(sys.argv[5], timeout=float(sys.argv[6]))
t.begin()
for k in range(n):
    with open(log, "a") as f:
        f.write(f"{name} {k} start\\n")
    time.sleep(0.02)
    with open(log, "a") as f:
        f.write(f"{name} {k} end\\n")
    t.turn()
t.end()
print(t.summary())
"""


class TestTurns(unittest.TestCase):
    def run_pair(self, na, nb, timeout=30.0):
        d = tempfile.mkdtemp()
        f1, f2, log = os.path.join(d, "f1"), os.path.join(d, "f2"), os.path.join(d, "log")
        os.mkfifo(f1)
        os.mkfifo(f2)
        # The second starts first: the barrier must hold the first back.
        b = subprocess.Popen([sys.executable, "-c", TURN_CHILD, HERE, "B", str(nb), log, f"{f2}:{f1}:second",
                              str(timeout)], stdout=subprocess.PIPE, text=True)
        time.sleep(0.2)
        a = subprocess.Popen([sys.executable, "-c", TURN_CHILD, HERE, "A", str(na), log, f"{f1}:{f2}:first",
                              str(timeout)], stdout=subprocess.PIPE, text=True)
        oa, _ = a.communicate(timeout=60)
        ob, _ = b.communicate(timeout=60)
        with open(log) as f:
            events = f.read().split("\n")[:-1]
        return events, oa, ob

    def test_alt_timing_summarizes_each_side(self):
        # --alt-timing: the samples taken after each rep belong to the side
        # that ran it; the summary keeps them apart, counts every timed call,
        # and leaves out what was taken before the timed reps.
        state = {"native": False, "timing": [], "takes": 0}

        def take():
            state["takes"] += 1
            side = "native" if state["native"] else "cudapool"
            base = 100.0 if side == "native" else 60.0
            # Every kind is reported, most with no samples.
            out = {(s, c): ([], 0) for s in ("native", "cudapool") for c in ("alloc", "free", "alloc_lib", "cross")}
            out[(side, "alloc")] = ([base, base + 10, 1e6], 5)  # 5 calls, 3 kept
            out[(side, "free")] = ([base / 2], 1)
            return out

        with fake_ext(passthrough=lambda on: state.update(native=on), timing_take=take,
                      timing=lambda on, cross=False: state["timing"].append((on, cross))):
            args = torch_bench.parse_args(["cudapool", "--sections", "alt", "--reps", "3", "--empty-pairs", "10",
                                           "--mixed-pairs", "10", "--alt-timing", "--alt-captures", "0"])
            out = torch_bench.bench_alt(fake_torch(), args)
        self.assertEqual(state["timing"], [(True, False), (False, False)])
        self.assertEqual(state["takes"], 2 * (1 + 3 * 2))  # per loop: one discarded, one per rep
        for loop in ("small", "mixed"):
            self.assertEqual(out[f"alt_{loop}_native_alloc_median_ns"], 110.0)
            self.assertEqual(out[f"alt_{loop}_cudapool_alloc_median_ns"], 70.0)
            self.assertEqual(out[f"alt_{loop}_cudapool_free_median_ns"], 30.0)
            self.assertEqual(out[f"alt_{loop}_native_alloc_calls"], 15)
            self.assertEqual(out[f"alt_{loop}_cudapool_alloc_lib_calls"], 0)
            self.assertNotIn(f"alt_{loop}_cudapool_alloc_lib_median_ns", out)
            self.assertAlmostEqual(out[f"alt_{loop}_native_alloc_mean_ns"], (100 + 110 + 1e6) / 3)

    def test_strict_alternation(self):
        events, oa, ob = self.run_pair(3, 3)
        want = []
        for k in range(3):
            for name in "AB":
                want += [f"{name} {k} start", f"{name} {k} end"]
        self.assertEqual(events, want)
        self.assertIn("'turns': 3", oa)
        self.assertIn("'turns_partner_gone': ''", oa)

    def test_partner_ending_early_does_not_block(self):
        t0 = time.perf_counter()
        events, oa, ob = self.run_pair(1, 4)
        self.assertLess(time.perf_counter() - t0, 20)
        self.assertEqual(events[:4], ["A 0 start", "A 0 end", "B 0 start", "B 0 end"])
        self.assertEqual(len(events), 10)
        self.assertIn("'turns_partner_gone': 'ended'", ob)

    def test_silent_partner_times_out(self):
        d = tempfile.mkdtemp()
        f1, f2 = os.path.join(d, "f1"), os.path.join(d, "f2")
        os.mkfifo(f1)
        os.mkfifo(f2)
        t = torch_bench.Turns(f"{f1}:{f2}:first", timeout=0.2)
        t.begin()  # nobody answers the barrier
        t.turn()
        self.assertEqual(t.summary()["turns_partner_gone"], "no answer in 0 s")
        self.assertEqual(t.summary()["turns"], 1)
        self.assertLess(t.waited, 1.0)

    def test_off_and_bad_spec(self):
        t = torch_bench.Turns("")
        t.begin()
        t.turn()
        t.end()
        self.assertEqual(t.summary(), {})
        with self.assertRaises(ValueError):
            torch_bench.Turns("a:b:third")

    def test_train_blocks_arg(self):
        self.assertEqual(torch_bench.parse_args(["native"]).train_blocks, 6)
        self.assertEqual(torch_bench.parse_args(["native", "--steps", "4", "--train-blocks", "5"]).train_blocks, 4)
        with redirect_stderr(io.StringIO()), self.assertRaises(SystemExit):
            torch_bench.parse_args(["native", "--train-blocks", "0"])

    def test_cpu_list(self):
        self.assertEqual(torch_bench.cpu_list("2"), {2})
        self.assertEqual(torch_bench.cpu_list("2,4-6"), {2, 4, 5, 6})
        with self.assertRaises(ValueError):
            torch_bench.cpu_list("x")

    def test_turns_tag(self):
        self.assertEqual(torch_bench.turns_tag({}), {})
        self.assertEqual(torch_bench.turns_tag({"BENCH_TURNS_TAG": "native/cudapool:3:test"}),
                         {"turns_kind": "native/cudapool", "turns_round": "3", "turns_role": "test"})
        with self.assertRaises(ValueError):
            torch_bench.turns_tag({"BENCH_TURNS_TAG": "native/cudapool:3:other"})

    def test_paired_figures(self):
        tag = {"kind": "torch_turns", "turns_kind": "cp/native"}
        base = {"empty_small_reps_us": [4.0, 5.0, 8.0], "graph_capture_reps_ms": [6.0, 6.0], "turns": 5,
                "turns_partner_gone": ""}
        test = {"empty_small_reps_us": [2.0, 3.0, 4.0], "graph_capture_reps_ms": [3.0], "turns": 5,
                "turns_partner_gone": "ended"}
        p = turns.paired(base, test)
        self.assertEqual(set(p), {"torch.empty 4 KiB"})  # capture: rep counts differ
        self.assertEqual(p["torch.empty 4 KiB"], (0.5, 5.0, 3.0, 3))  # per-rep ratios 0.5, 0.6, 0.5
        lines = [dict(tag, turns_round="1", turns_role="base", **base), dict(tag, turns_round="1", turns_role="test", **test),
                 dict(tag, turns_round="2", turns_role="base", **base),
                 dict(tag, turns_round="2", turns_role="test", turns=4, empty_small_reps_us=[1.0, 1.0, 1.0]),
                 dict(tag, turns_round="3", turns_role="base", **base),
                 dict(tag, turns_round="3", turns_role="test", **dict(test, turns_partner_gone="no answer in 300 s")),
                 {"kind": "torch", "config": "native", "empty_small_reps_us": [1.0]}]
        pairs = turns.collect(lines)
        self.assertEqual(sorted(pairs), [("cp/native", "1"), ("cp/native", "2"), ("cp/native", "3")])
        out = turns.summarize(pairs)
        self.assertIn("cp/native 1 torch.empty 4 KiB: 0.500 (5, 3, 3)", out)
        self.assertIn("cp/native 2 not paired: turns differ: 5 and 4", out)
        self.assertIn("cp/native 3 not paired: test: partner gave no answer in 300 s", out)
        self.assertEqual(sum("n=1 0.500 (0.500-0.500)" in ln for ln in out), 1)
        self.assertIn("base: no turns", turns.broken({}, test))

    def test_capture_phases_and_counts(self):
        # The phases pair like the metrics; the counters print side by side.
        base = {"graph_forward_reps_ms": [4.0, 5.0], "graph_num_device_alloc_reps": [9, 9],
                "empty_mixed_num_device_alloc": 3, "turns": 2, "turns_partner_gone": ""}
        test = {"graph_forward_reps_ms": [5.0, 5.0], "graph_num_device_alloc_reps": [9, 12],
                "empty_mixed_num_device_alloc": 7, "turns": 2, "turns_partner_gone": "ended"}
        self.assertEqual(turns.paired(base, test), {"capture: forward": (1.125, 4.5, 5.0, 2)})
        tag = {"kind": "torch_turns", "turns_kind": "native/cudapool", "turns_round": "1"}
        out = turns.summarize(turns.collect([dict(tag, turns_role="base", **base), dict(tag, turns_role="test", **test)]))
        self.assertIn("native/cudapool 1 graph_num_device_alloc_reps: [9, 9] | [9, 12]", out)
        self.assertIn("native/cudapool 1 empty_mixed_num_device_alloc: 3 | 7", out)
        # Not a target: the report's note leaves the phases out.
        self.assertNotIn("forward", " ".join(label for label, _, _ in turns.METRICS))

    def test_turn_pair_script(self):
        # bench/turn_pair.sh with a stand-in for torch_bench.py (PYTHON): a
        # test process that takes half the base's time per rep.
        d = tempfile.mkdtemp()
        stub = os.path.join(d, "py")
        with open(stub, "w") as f:
            f.write(f"#!{sys.executable}\n" + TURN_STUB.replace("HERE", repr(HERE)))
        os.chmod(stub, 0o755)
        out = os.path.join(d, "pair.json")
        r = subprocess.run(["bash", os.path.join(HERE, "turn_pair.sh"), "0", "native/cudapool", "1", "native",
                            "cudapool", "test", out, "--reps", "4"], env=dict(os.environ, PYTHON=stub),
                           capture_output=True, text=True, timeout=60)
        with open(out + ".log") as f:
            log = f.read()
        self.assertEqual(r.returncode, 0, r.stderr + log)
        per, bad = turns.figures(turns.load([out]))
        self.assertEqual(bad, [])
        (key, v), = per.items()
        self.assertEqual(key, ("native/cudapool", "torch.empty 4 KiB"))
        self.assertTrue(0.3 < v[0] < 0.8, v)
        base = turns.load([out])[("native/cudapool", "1")]["base"]
        self.assertEqual((base["pin"], base["cpus"]), ("", [0]))  # taskset pinned the whole process
        # TURN_PIN=thread: no taskset; the program is told the CPU (torch_bench.py pins its main thread).
        r = subprocess.run(["bash", os.path.join(HERE, "turn_pair.sh"), "0", "native/cudapool", "1", "native",
                            "cudapool", "base", out, "--reps", "2"], env=dict(os.environ, PYTHON=stub, TURN_PIN="thread"),
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        base = turns.load([out])[("native/cudapool", "1")]["base"]
        self.assertEqual(base["pin"], "0")
        self.assertEqual(base["cpus"], sorted(os.sched_getaffinity(0)))
        # Two ranks per launch, each rank with its own FIFOs.
        r = subprocess.run(["bash", os.path.join(HERE, "turn_pair.sh"), "0", "fsdp-native/cudapool", "1", "native",
                            "cudapool", "base", out, "--reps", "3"],
                           env=dict(os.environ, PYTHON=stub, TURN_RANKS="2", TURN_PROG="launch", LOCAL_RANK="0"),
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        per, bad = turns.figures(turns.load([out]))
        self.assertEqual(bad, [])
        self.assertEqual(list(per), [("fsdp-native/cudapool", "torch.empty 4 KiB")])
        self.assertTrue(0.3 < per[("fsdp-native/cudapool", "torch.empty 4 KiB")][0] < 0.8)
        # A partner that dies without a word: the other finishes at once
        # (not after BENCH_TURNS_TIMEOUT), and the exit status is the failure's.
        t0 = time.perf_counter()
        r = subprocess.run(["bash", os.path.join(HERE, "turn_pair.sh"), "0", "native/cudapool", "2", "native",
                            "crash", "test", out, "--reps", "3"],
                           env=dict(os.environ, PYTHON=stub, BENCH_TURNS_TIMEOUT="30"),
                           capture_output=True, text=True, timeout=60)
        self.assertLess(time.perf_counter() - t0, 15)
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assertIn("exit 3 (base 0, test 3)", r.stderr)
        pairs = turns.load([out])
        self.assertEqual(pairs[("native/cudapool", "2")]["base"]["turns_partner_gone"], "ended")
        self.assertEqual(turns.figures(pairs)[1], [("native/cudapool", "2", "test: no turns (BENCH_TURNS unset, "
                                                    "or the process did not finish)")])
        r = subprocess.run(["bash", os.path.join(HERE, "turn_pair.sh"), "0", "k", "1", "native", "cudapool", "middle",
                            out], capture_output=True, text=True)
        self.assertEqual(r.returncode, 2)
        self.assertIn("FIRST must be base or test", r.stderr)


class TestTurnRing(unittest.TestCase):
    """bench/turn_ring.py with RING_STUB standing in for torch_bench.py."""

    def ring(self, runs, reps=3, extra=(), timeout=60):
        d = tempfile.mkdtemp()
        stub = os.path.join(d, "stub.py")
        with open(stub, "w") as f:
            f.write(RING_STUB.replace("HERE", repr(HERE)))
        log = os.path.join(d, "events")
        r = subprocess.run([sys.executable, os.path.join(HERE, "turn_ring.py"), "--cpu", "0", "--prog", stub,
                            "--out-dir", os.path.join(d, "res"), "--log-dir", os.path.join(d, "logs"), *extra,
                            *runs, "--", "--reps", str(reps)],
                           env=dict(os.environ, RING_LOG=log), capture_output=True, text=True, timeout=timeout)
        events = open(log).read().split("\n")[:-1] if os.path.exists(log) else []
        out = {}
        for name in (x.split("=")[0] for x in runs):
            with open(os.path.join(d, "res", name + ".json")) as f:
                out[name] = [json.loads(ln) for ln in f if ln.strip()]
        return r, events, out

    def test_round_robin(self):
        # Rep k of every process runs in one round, in the order given, one
        # at a time; each writes its own lines, as a lone process would.
        r, events, out = self.ring(["c=cudapool", "a=native", "b=expandable"], reps=3)
        self.assertEqual(r.returncode, 0, r.stderr)
        want = []
        for k in range(3):
            for name in ("cudapool", "native", "expandable"):
                want += [f"{name} {k} start", f"{name} {k} end"]
        self.assertEqual(events, want)
        self.assertEqual([ln["config"] for ln in out["a"]], ["native", "native"])
        self.assertEqual(out["a"][0]["kind"], "torch")
        self.assertEqual(out["a"][1]["turns"], 3)
        self.assertEqual(out["a"][1]["turns_partner_gone"], "")
        self.assertEqual(out["c"][0]["pin"], "0")  # thread pinning: the program is told the CPU
        self.assertIn("turn_ring: a (native): exit 0, 3 turns", r.stderr)

    def test_members_leaving(self):
        # One that fails at start, one that ends early: the rest go on in
        # turns, at once, and the exit status is the failure's.
        t0 = time.perf_counter()
        r, events, out = self.ring(["a=native", "x=crash", "s=short", "b=cudapool"], reps=3)
        self.assertLess(time.perf_counter() - t0, 20)
        self.assertEqual(r.returncode, 3, r.stderr)
        want = ["native 0 start", "native 0 end", "short 0 start", "short 0 end", "cudapool 0 start", "cudapool 0 end"]
        for k in (1, 2):
            want += [f"native {k} start", f"native {k} end", f"cudapool {k} start", f"cudapool {k} end"]
        self.assertEqual(events, want)
        self.assertEqual(out["x"], [])
        self.assertIn("turn_ring: x (crash): exit 3, 0 turns, left the ring: ended before the first turn", r.stderr)

    def test_silent_member_is_cut_off(self):
        t0 = time.perf_counter()
        r, events, out = self.ring(["a=native", "h=hang"], reps=3, extra=("--turn-timeout", "1"))
        self.assertLess(time.perf_counter() - t0, 20)
        self.assertEqual(r.returncode, 124, r.stderr)
        self.assertEqual(events[:4], ["native 0 start", "native 0 end", "hang 0 start", "hang 0 end"])
        self.assertEqual(events[4:], ["native 1 start", "native 1 end", "hang 1 start",
                                      "native 2 start", "native 2 end"])
        self.assertIn("left the ring: silent", r.stderr)

    def test_bad_arguments(self):
        for bad in (["native"], ["a=native", "a=cudapool"], ["a/b=native"]):
            r = subprocess.run([sys.executable, os.path.join(HERE, "turn_ring.py"), "--out-dir", "/tmp", *bad],
                               capture_output=True, text=True, timeout=30)
            self.assertEqual(r.returncode, 2, bad)


# Stands in for torch_bench.py in TestTurnRing: argv is [stub, CONFIG,
# --reps, N]. crash fails before its first turn, short ends after one rep,
# hang stops answering in its second rep.
RING_STUB = """
import os, sys, time
sys.path.insert(0, HERE)
import torch_bench as tb
cfg, n = sys.argv[1], int(sys.argv[3])
if cfg == "crash":
    os._exit(3)
t = tb.Turns(os.environ["BENCH_TURNS"])
t.begin()
def note(s):
    fd = os.open(os.environ["RING_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, s.encode())
    os.close(fd)
for k in range(1 if cfg == "short" else n):
    note(f"{cfg} {k} start\\n")
    if cfg == "hang" and k == 1:
        time.sleep(30)
    time.sleep(0.02)
    note(f"{cfg} {k} end\\n")
    t.turn()
tb.emit(cfg, "empty", pin=os.environ.get("BENCH_TURNS_PIN", ""))
t.end()
tb.emit(cfg, "done", **t.summary())
"""


# Stands in for torch_bench.py in TestTurns.test_turn_pair_script: argv is
# [bench/torch_bench.py, CONFIG, --reps, N], or [launch, CONFIG, --reps, N]
# for a torchrun of 2 ranks (rank 0 reports).
TURN_STUB = """
import os, subprocess, sys, time
sys.path.insert(0, HERE)
import torch_bench as tb
if sys.argv[1] == "launch":
    kids = [subprocess.Popen([sys.executable, sys.argv[0], "rank"] + sys.argv[2:], env=dict(os.environ, LOCAL_RANK=str(r)),
                             stdout=None if r == 0 else subprocess.DEVNULL) for r in (0, 1)]
    sys.exit(max(k.wait() for k in kids))
cfg, n = sys.argv[2], int(sys.argv[4])
if cfg == "crash":
    os._exit(3)  # no end(): turn_pair.sh must release the partner
tb.TAG = tb.turns_tag()
t = tb.Turns(os.environ["BENCH_TURNS"])
t.begin()
reps = []
for _ in range(n):
    t0 = time.perf_counter()
    time.sleep(0.02 if cfg == "cudapool" else 0.04)
    reps.append((time.perf_counter() - t0) * 1e6)
    t.turn()
tb.emit(cfg, "empty", empty_small_reps_us=reps, pin=os.environ.get("BENCH_TURNS_PIN", ""),
        cpus=sorted(os.sched_getaffinity(0)))
t.end()
tb.emit(cfg, "done", **t.summary())
"""


class TestCupyAllocBench(unittest.TestCase):
    """bench/cupy_alloc_bench.py's parent side, without CuPy."""

    def test_rounds_alternate_who_goes_first(self):
        self.assertEqual([cupy_alloc_bench.round_order(r) for r in range(3)],
                         [("cupy", "cudapool"), ("cudapool", "cupy"), ("cupy", "cudapool")])

    def test_summary(self):
        def cp(alloc):
            return {"mode": "cupy", "alloc": alloc, "pool": alloc - 0.1, "loop": 0.02}

        def pool(alloc, raw=0.5):
            return {"mode": "cudapool", "install_mode": "c", "alloc": alloc, "installed": alloc - 0.05,
                    "cfunc": alloc - 0.15, "raw": raw, "ctypes": 0.3, "loop": 0.02}

        rounds = [{"cupy": cp(0.70), "cudapool": pool(1.00)}, {"cudapool": pool(1.10), "cupy": cp(0.60)},
                  {"cupy": cp(0.65), "cudapool": {"mode": "cudapool", "error": "RuntimeError: no"}}]
        s = cupy_alloc_bench.summarize(rounds)
        self.assertEqual(s["layers"]["cupy"]["alloc"], (0.65, 0.60, 0.70))
        a = s["layers"]["cudapool"]["alloc"]
        self.assertEqual((round(a[0], 6), a[1], a[2]), (1.05, 1.00, 1.10))
        self.assertAlmostEqual(s["ratio_of_medians"], 1.05 / 0.65)
        # per round: 1.00/0.70 and 1.10/0.60; the failed round pairs nothing
        self.assertEqual(len(s["round_ratios"]), 2)
        self.assertAlmostEqual(s["round_ratio"][0], (1.0 / 0.7 + 1.1 / 0.6) / 2)
        self.assertAlmostEqual(s["raw_minus_ctypes"], 0.2)
        self.assertEqual(s["errors"], ["round 3 cudapool: RuntimeError: no"])
        self.assertEqual(s["cudapool_install_mode"], "c")
        text = cupy_alloc_bench.report(s, 3)
        self.assertIn("| cupy | alloc | 0.650 (0.600-0.700) |", text)
        self.assertIn("| cudapool | raw | 0.500 (0.500-0.500) |", text)
        self.assertIn("cudapool / cupy (alloc): 1.615x of the medians", text)
        self.assertIn("round 3 cudapool: RuntimeError: no", text)

    def test_args(self):
        a = cupy_alloc_bench.parse_args([])
        self.assertEqual((a.rounds, a.iters, a.reps, a.size), (8, 200_000, 5, 4096))
        with redirect_stderr(io.StringIO()), self.assertRaises(SystemExit):
            cupy_alloc_bench.parse_args(["--rounds", "0"])

    def test_without_cupy_it_says_why(self):
        r = subprocess.run([sys.executable, os.path.join(HERE, "cupy_alloc_bench.py"), "--rounds", "1"],
                           capture_output=True, text=True, timeout=120)
        self.assertEqual(r.returncode, 0, r.stderr)
        try:
            import cupy  # noqa: F401
        except ImportError:
            self.assertIn("cupy_alloc_bench: skipped: CuPy cannot run here", r.stdout)


class TestScript(unittest.TestCase):
    def test_run_bench_sh_parses(self):
        r = subprocess.run(["bash", "-n", os.path.join(HERE, "run_bench.sh")], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)


class TestBenchExt(unittest.TestCase):
    """The benchmark's build of the C++ class (bench_ext), without torch: a
    stand-in compiler and torch tree."""

    def setUp(self):
        import bench_ext

        self.bench_ext = bench_ext
        self._ext = bench_ext._cudapool()[0]
        self.tmp = tempfile.mkdtemp()
        self.saved = {"CUDAPOOL_CACHE": os.environ.get("CUDAPOOL_CACHE")}
        os.environ["CUDAPOOL_CACHE"] = os.path.join(self.tmp, "cache")

    def tearDown(self):
        restore(os.environ, self.saved)
        subprocess.run(["rm", "-rf", self.tmp], check=True)

    def touch(self, *parts, text=""):
        path = os.path.join(self.tmp, *parts)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
        return path

    def test_build_is_the_shipped_source_and_cached_apart(self):
        log = os.path.join(self.tmp, "cxx.log")
        cxx = self.touch("cxx", text='#!/bin/sh\necho "$@" >> "%s"\n'
                                     'while [ $# -gt 0 ]; do [ "$1" = -o ] && : > "$2"; shift; done\n' % log)
        os.chmod(cxx, 0o755)
        self.touch("torch", "version.py", text="__version__ = '9.9.9'\n")
        kw = dict(torch_dir=os.path.join(self.tmp, "torch"), cuda_include=[os.path.dirname(
            self.touch("cuda", "cuda_runtime_api.h"))], abi=1, library=self.touch("lib", "libcudapool.so"), cxx=cxx)
        bench = self.bench_ext.build(**kw)
        shipped = self._ext.build(**kw)
        self.assertTrue(os.path.basename(bench).startswith("cudapool_torch_bench_"), bench)
        self.assertNotEqual(bench, shipped)
        self.assertEqual(self.bench_ext.build(**kw), bench)  # cached
        with open(log) as f:
            calls = f.read().splitlines()
        self.assertEqual(len(calls), 2)
        product = self._ext.source_path()
        self.assertIn(self.bench_ext.SOURCE, calls[0].split())
        self.assertIn("-I " + os.path.dirname(product), calls[0])
        # The benchmark's source includes the shipped class's, by name.
        with open(self.bench_ext.SOURCE) as f:
            self.assertIn('#include "%s"' % os.path.basename(product), f.read())

    def test_timing_kinds_match_the_build(self):
        with open(self.bench_ext.SOURCE) as f:
            src = f.read()
        enum = src[src.index("enum Kind {"):src.index("kKinds")]
        kinds = [ln.strip().split(",")[0] for ln in enum.splitlines()[1:] if ln.strip().startswith("k")]
        self.assertEqual(len(kinds), len(self.bench_ext.TIMING_KINDS), kinds)

    def test_switches_need_the_bench_build(self):
        for call in (lambda: self.bench_ext.passthrough(True), lambda: self.bench_ext.timing(True),
                     self.bench_ext.timing_take):
            with self.assertRaisesRegex(self._ext.ExtensionUnavailable, r"bench_ext\.install\(\)"):
                call()

    def test_install_hands_its_build_to_cudapool_install(self):
        # bench_ext.install() sets cudapool._ext's state to its build, so that
        # cudapool.install() loads it instead of building the shipped class.
        saved = dict(self._ext._state)
        try:
            self._ext._state.update(path="/bench/build.so", why=None)
            self.assertEqual(self._ext.ensure(), ("/bench/build.so", None))
        finally:
            self._ext._state.clear()
            self._ext._state.update(saved)


if __name__ == "__main__":
    unittest.main()
