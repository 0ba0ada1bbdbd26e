# SPDX-License-Identifier: Apache-2.0
"""Unit tests of report.py (and of select_tests.py's expansion) with small
synthetic JUnit XML files: no torch, no GPU.

    python3 -m pytest -q gpu/pytorch_tests/test_report.py      (or: python3 gpu/pytorch_tests/test_report.py)
"""

import os
import subprocess
import sys
import tempfile
import textwrap
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))


def load(name, filename):
    """Import a file of this directory without putting the directory on sys.path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, filename))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


report = load("cudapool_pt_report", "report.py")

NATIVE = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="2" tests="8" time="3.0">
<testcase classname="test_cuda.TestCuda" name="test_memory_stats" file="test_cuda.py" line="10" time="0.5"/>
<testcase classname="test_cuda.TestCuda" name="test_out_of_memory" file="test_cuda.py" line="20" time="0.2"/>
<testcase classname="test_cuda.TestCuda" name="test_record_stream" file="test_cuda.py" line="30" time="0.1"/>
<testcase classname="test_cuda.TestMemPool" name="test_mempool_expandable" file="test_cuda.py" line="40" time="0.1"/>
<testcase classname="test_cuda.TestCuda" name="test_graph_debugdump" file="test_cuda.py" line="50" time="0.0">
  <skipped type="pytest.skip" message="needs CUDA 12.3 | or later">test_cuda.py:50: needs CUDA 12.3</skipped></testcase>
<testcase classname="test_cuda.TestCuda" name="test_xf" time="0.0">
  <skipped type="pytest.xfail" message="expected failure"/></testcase>
<testcase classname="test_cuda.TestCuda" name="test_broken_natively" time="0.3">
  <failure message="AssertionError: 1 != 2&#10;second line">Traceback ...</failure></testcase>
<testcase classname="test_cuda.TestCuda" name="test_error_natively" time="0.3">
  <error message="">RuntimeError: setup exploded
more</error></testcase>
</testsuite></testsuites>
"""

CUDAPOOL = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="0" failures="2" skipped="1" tests="7" time="3.0">
<testcase classname="test_cuda.TestCuda" name="test_memory_stats" time="0.5"/>
<testcase classname="test_cuda.TestCuda" name="test_out_of_memory" time="0.2">
  <failure message="AssertionError: Regex pattern did not match.&#10;  Regex: 'Tried to allocate 800000000.00 GiB'">long traceback</failure></testcase>
<testcase classname="test_cuda.TestMemPool" name="test_mempool_expandable" time="0.1">
  <failure message="RuntimeError: expandable segments | not supported">tb</failure></testcase>
<testcase classname="test_cuda.TestCuda" name="test_graph_debugdump" time="0.0">
  <skipped type="pytest.skip" message="needs CUDA 12.3 or later"/></testcase>
<testcase classname="test_cuda.TestCuda" name="test_xf" time="0.0"/>
<testcase classname="test_cuda.TestCuda" name="test_broken_natively" time="0.3"/>
<testcase classname="test_cuda.TestCuda" name="test_error_natively" time="0.3">
  <error message="RuntimeError: setup exploded">tb</error></testcase>
<testcase classname="test_cuda.TestCuda" name="test_new_in_cudapool_run" time="0.3"/>
<testcase time="0.000" />
</testsuite></testsuites>
"""

# a second chunk of the same file, and another file
CHUNK2_NATIVE = """<testsuites><testsuite name="pytest">
<testcase classname="test_cuda.TestBlockStateAbsorption" name="test_simple" time="1"/>
</testsuite></testsuites>"""
CHUNK2_CUDAPOOL = """<testsuites><testsuite name="pytest">
<testcase classname="test_cuda.TestBlockStateAbsorption" name="test_simple" time="1"/>
</testsuite></testsuites>"""
TREES_NATIVE = """<testsuite name="pytest">
<testcase classname="test_cudagraph_trees.CudaGraphTreeTests" name="test_basic" time="1"/>
<testcase classname="test_cudagraph_trees.CudaGraphTreeTests" name="test_checkpointing" time="1"/>
</testsuite>"""

REASONS = "# comment line\n" \
    "TestCuda::test_out_of_memory\tcudapool words the OOM message differently\n" \
    "test_cuda.py::TestMemPool::test_*expandable*\texpandable segments: not in cudapool yet\n" \
    "test_broken_natively\tbroken upstream\n"


def write(d, name, text):
    with open(os.path.join(d, name), "w") as f:
        f.write(text)


class ReportTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.d = self.tmp.name
        write(self.d, "test_cuda.native.xml", NATIVE)
        write(self.d, "test_cuda.cudapool.xml", CUDAPOOL)
        write(self.d, "test_cuda.native.run", "rc=1 seconds=42 timeout=1800 timed_out=0\n")
        write(self.d, "test_cuda.cudapool.run", "rc=124 seconds=1800 timeout=1800 timed_out=1\n")
        write(self.d, "test_cuda.cudapool.installs",
              "ok 11 class python -m pytest\nok 12 class python -c x\nFAILED 13 [CudapoolError: boom] python -c y\n")
        write(self.d, "test_cuda.env", "torch 2.11.0+cu130 CUDA 13.0\nGPU 0: NVIDIA H100 80GB HBM3, 79.2 GiB\n")
        write(self.d, "chunk2.native.xml", CHUNK2_NATIVE)
        write(self.d, "chunk2.cudapool.xml", CHUNK2_CUDAPOOL)
        write(self.d, "trees.native.xml", TREES_NATIVE)
        write(self.d, "trees.cudapool.run", "rc=-9 seconds=3 timeout=1800 timed_out=0\n")
        self.reasons = os.path.join(self.d, "reasons.txt")
        write(self.d, "reasons.txt.in", REASONS)
        write(os.path.dirname(self.reasons), "reasons.txt", REASONS)

    def tearDown(self):
        self.tmp.cleanup()

    def results(self):
        return report.read_junit(os.path.join(self.d, "test_cuda.native.xml"))

    def test_parse_statuses_and_messages(self):
        r = self.results()
        self.assertEqual(r["test_cuda.py::TestCuda::test_memory_stats"].status, report.PASS)
        self.assertEqual(r["test_cuda.py::TestCuda::test_graph_debugdump"].status, report.SKIP)
        self.assertEqual(r["test_cuda.py::TestCuda::test_graph_debugdump"].message, "needs CUDA 12.3 | or later")
        self.assertEqual(r["test_cuda.py::TestCuda::test_xf"].status, report.XFAIL)
        broken = r["test_cuda.py::TestCuda::test_broken_natively"]
        self.assertEqual((broken.status, broken.message), (report.FAIL, "AssertionError: 1 != 2"))
        err = r["test_cuda.py::TestCuda::test_error_natively"]  # empty message attribute: the text's first line
        self.assertEqual((err.status, err.message), (report.ERROR, "RuntimeError: setup exploded"))
        self.assertEqual(len(r), 8)

    def test_test_id_without_class_or_file(self):
        xml = '<testsuite><testcase classname="test_mod" name="test_fn[3]"/></testsuite>'
        write(self.d, "x.xml", xml)
        self.assertEqual(list(report.read_junit(os.path.join(self.d, "x.xml"))), ["test_mod.py::test_fn[3]"])

    def test_duplicate_case_keeps_the_worse_outcome(self):
        xml = ('<testsuite><testcase classname="m.C" name="t"/>'
               '<testcase classname="m.C" name="t"><error message="teardown"/></testcase></testsuite>')
        write(self.d, "dup.xml", xml)
        self.assertEqual(report.read_junit(os.path.join(self.d, "dup.xml"))["m.py::C::t"].status, report.ERROR)

    def test_classification(self):
        files, _ = report.collect([self.d])
        self.assertEqual(sorted(files), ["test_cuda.py", "test_cudagraph_trees.py"])
        g = report.classify(files["test_cuda.py"]["native"], files["test_cuda.py"]["cudapool"])
        ids = {k: [t[0].split("::", 1)[1] for t in v] for k, v in g.items()}
        # the second chunk merged into the same file
        self.assertEqual(ids["pass_both"], ["TestBlockStateAbsorption::test_simple", "TestCuda::test_memory_stats"])
        self.assertEqual(ids["regressions"], ["TestCuda::test_out_of_memory", "TestCuda::test_record_stream",
                                              "TestMemPool::test_mempool_expandable"])
        self.assertEqual(ids["skipped_native"], ["TestCuda::test_graph_debugdump", "TestCuda::test_xf"])
        self.assertEqual(ids["failed_native"], ["TestCuda::test_broken_natively", "TestCuda::test_error_natively"])
        self.assertEqual(ids["only_cp"], ["TestCuda::test_new_in_cudapool_run"])
        missing = dict((t[0], t[2]) for t in g["regressions"])["test_cuda.py::TestCuda::test_record_stream"]
        self.assertEqual(missing.status, report.MISSING)
        trees = report.classify(files["test_cudagraph_trees.py"]["native"], files["test_cudagraph_trees.py"]["cudapool"])
        self.assertEqual(len(trees["regressions"]), 2)  # no cudapool XML: both "not run"

    def test_reasons(self):
        reasons = report.read_reasons(self.reasons)
        self.assertEqual(len(reasons), 3)
        self.assertEqual(report.reason_for("test_cuda.py::TestCuda::test_out_of_memory", reasons),
                         "cudapool words the OOM message differently")
        self.assertEqual(report.reason_for("test_cuda.py::TestMemPool::test_mempool_expandable", reasons),
                         "expandable segments: not in cudapool yet")
        self.assertEqual(report.reason_for("test_cuda.py::TestCuda::test_broken_natively", reasons), "broken upstream")
        self.assertEqual(report.reason_for("test_cuda.py::TestCuda::test_memory_stats", reasons), "")
        self.assertEqual(report.read_reasons(os.path.join(self.d, "absent.txt")), [])
        write(self.d, "bad.txt", "no tab here\n")
        with self.assertRaises(SystemExit):
            report.read_reasons(os.path.join(self.d, "bad.txt"))

    def test_rendered_report(self):
        out = os.path.join(self.d, "docs", "pytorch-tests.md")
        rc = report.main([self.d, "-o", out, "--reasons", self.reasons])
        self.assertEqual(rc, 0)
        with open(out) as f:
            text = f.read()
        # totals: 9 tests in test_cuda.py (8 + chunk2, + 1 cudapool-only), 5 pass natively, 2 of them with cudapool
        self.assertIn("| test_cuda.py | 10 | 5 | 2 | 3 | 2 | 2 |", text)
        self.assertIn("| test_cudagraph_trees.py | 2 | 2 | 0 | 2 | 0 | 0 |", text)
        # each regression with its first message line and its reason; pipes escaped
        self.assertIn("| `TestCuda::test_out_of_memory` | failed | AssertionError: Regex pattern did not match. "
                      "| cudapool words the OOM message differently |", text)
        self.assertIn("RuntimeError: expandable segments \\| not supported", text)
        self.assertIn("| `TestCuda::test_record_stream` | not run |", text)
        self.assertNotIn("long traceback", text)
        # skipped and failing natively are listed apart, with the cudapool outcome
        self.assertIn("| `TestCuda::test_graph_debugdump` | skipped | needs CUDA 12.3 \\| or later | skipped |", text)
        self.assertIn("| `TestCuda::test_broken_natively` | failed | AssertionError: 1 != 2 | passed | broken upstream |", text)
        # runs: timeout, installs, a run with no XML, the machine
        self.assertIn("TIMED OUT after 1800 s", text)
        self.assertIn("cudapool installed in 2 process(es), FAILED in 1", text)
        self.assertIn("no JUnit XML (crashed or killed)", text)
        self.assertIn("NVIDIA H100", text)
        self.assertIn("Pass natively and with cudapool (2)", text)
        self.assertNotIn("Configuration:", text, "no NAME.conf: nothing said")

    def test_configuration_of_the_pair(self):
        write(self.d, "test_cuda.conf", "expandable_segments:True\n")
        write(self.d, "chunk2.conf", "expandable_segments:True\n")
        out = os.path.join(self.d, "r.md")
        self.assertEqual(report.main([self.d, "-o", out, "--reasons", self.reasons]), 0)
        with open(out) as f:
            text = f.read()
        self.assertIn("Configuration: `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` on both sides.", text)
        write(self.d, "test_cuda.conf", "\n")
        write(self.d, "chunk2.conf", "\n")
        self.assertEqual(report.main([self.d, "-o", out, "--reasons", self.reasons]), 0)
        with open(out) as f:
            self.assertIn("Configuration: each allocator's defaults", f.read())

    def test_empty_dir_fails(self):
        empty = os.path.join(self.d, "empty")
        os.mkdir(empty)
        self.assertEqual(report.main([empty]), 1)

    def test_command_line(self):
        proc = subprocess.run([sys.executable, os.path.join(HERE, "report.py"), self.d, "--reasons", self.reasons],
                              capture_output=True, text=True)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertTrue(proc.stdout.startswith("# PyTorch's own tests with cudapool"))


class ExpandTest(unittest.TestCase):
    """select_tests.py expand: selection lines -> collected node ids."""

    COLLECTED = textwrap.dedent("""\
        test_cuda.py::TestCuda::test_memory_stats
        test_cuda.py::TestCuda::test_memory_stats_of_multiple_generators_and_graphs
        test_cuda.py::TestCuda::test_graph_capture_simple
        test_cuda.py::TestCuda::test_streams
        test_cuda.py::TestCuda::test_out_of_memory_retry
        test_cuda.py::TestCuda::test_out_of_memory_retry_slow_True
        test_cuda.py::TestCuda::test_out_of_memory_x_1
        test_cuda.py::TestCuda::test_out_of_memory
        test_cuda.py::TestCudaMallocAsync::test_memory_plots_free_stack_context_all
        test_cuda.py::TestCudaMallocAsync::test_memory_plots_free_stack_context_state
        test_cuda.py::TestCudaOptimsCUDA::test_graph_optims_Adam_cuda_float32
        test_cuda.py::TestCudaOptimsCUDA::test_graph_optims_SGD_cuda_float32
        test_cuda.py::TestCudaDeviceParametrizedCUDA::test_graph_external_wait_and_record_cuda

        128 tests collected in 3.21s
        """)

    SOURCE = textwrap.dedent("""\
        class TestCuda(TestCase):
            def test_memory_stats(self): pass
            def test_memory_stats_of_multiple_generators_and_graphs(self): pass
            @parametrize("x", [1, 2])
            def test_out_of_memory(self, x): pass
            def test_out_of_memory_retry(self): pass
        if TEST_CUDA:
            class TestCudaOptims(TestCase):
                @optims(optim_db)
                def test_graph_optims(self, device, dtype, optim_info): pass
        instantiate_device_type_tests(TestCudaOptims, globals())
        """)

    def test_read_tests(self):
        sel = load("cudapool_pt_select", "select_tests.py")
        with tempfile.TemporaryDirectory() as d:
            write(d, "t.py", self.SOURCE)
            tests, device = sel.read_tests(os.path.join(d, "t.py"))
        self.assertEqual(device, {"TestCudaOptims"})
        self.assertEqual(tests, [("TestCuda", "test_memory_stats", False),
                                 ("TestCuda", "test_memory_stats_of_multiple_generators_and_graphs", False),
                                 ("TestCuda", "test_out_of_memory", True), ("TestCuda", "test_out_of_memory_retry", False),
                                 ("TestCudaOptims", "test_graph_optims", True)])

    def test_inventory_drives_the_selection(self):
        sel = load("cudapool_pt_select", "select_tests.py")
        inventory = textwrap.dedent("""\
            # Inventory
            | `test_cuda.py` | snapshot | 1 / 2 |
            ## test/test_cuda.py
            ### Allocator / memory (2)
            ```
            TestCuda.test_memory_stats
            TestCuda.test_out_of_memory  -- skipIf(IS_JETSON); parametrize('x')
            ```
            ### Other (2)
            ```
            TestCuda.test_memory_stats_of_multiple_generators_and_graphs
            TestCudaOptims.test_graph_optims  -- optims(...)
            ```
            ## Static check
            - `test_memory_stats` is mentioned again here without its class
            """)
        with tempfile.TemporaryDirectory() as d:
            write(d, "INVENTORY.md", inventory)
            inv = sel.read_inventory(os.path.join(d, "INVENTORY.md"))
            write(d, "t.py", self.SOURCE)
            tests, _ = sel.read_tests(os.path.join(d, "t.py"))
        self.assertEqual(inv["TestCuda::test_memory_stats"], "Allocator / memory (2)")
        chosen = {(c, n): (topic, src) for c, n, _, topic, src in sel.select_cuda(tests, inv)}
        self.assertEqual(chosen[("TestCuda", "test_memory_stats")], ("Allocator / memory (2)", "inventory"))
        self.assertIn(("TestCuda", "test_out_of_memory"), chosen)
        # INVENTORY.md files it under Other, but its name says memory: kept, marked as the rules' choice
        self.assertEqual(chosen[("TestCuda", "test_memory_stats_of_multiple_generators_and_graphs")][1], "rules")
        # not in INVENTORY.md at all: the rules decide (memory by name)
        self.assertEqual(chosen[("TestCuda", "test_out_of_memory_retry")][1], "rules")
        self.assertIn(("TestCudaOptims", "test_graph_optims"), chosen)  # graph by name, filed under Other
        self.assertEqual(sel.select_cuda(tests, {"TestCudaOptims::test_graph_optims": "Other (2)",
                                                 "TestCuda::test_memory_stats": "Other"})[0][4], "rules")

    def test_command_line_help(self):
        proc = subprocess.run([sys.executable, os.path.join(HERE, "select_tests.py"), "expand", "--help"],
                              capture_output=True, text=True)
        self.assertEqual(proc.returncode, 0, proc.stderr)

    def test_expand(self):
        sel = load("cudapool_pt_select", "select_tests.py")
        with tempfile.TemporaryDirectory() as d:
            write(d, "collected", self.COLLECTED)
            write(d, "selection", textwrap.dedent("""\
                # memory
                TestCuda::test_memory_stats        # exact: not the ..._of_multiple_... test
                TestCuda::test_out_of_memory*      # parametrized pattern, but test_out_of_memory_retry is its own test
                TestCudaMallocAsync::test_memory_plots_free_stack*
                TestCudaOptims::test_graph_optims*
                TestCudaDeviceParametrized::test_graph_external_wait_and_record
                test_cuda.py::TestCuda::test_streams
                TestCuda::test_does_not_exist
                """))
            write(d, "test_cuda.py", self.SOURCE)
            args = ["expand", "--collected", os.path.join(d, "collected"), "--selection", os.path.join(d, "selection"),
                    "--file", "test_cuda.py", "--out", os.path.join(d, "out"), "--unmatched", os.path.join(d, "unmatched")]
            self.assertEqual(sel.main(args + ["--source", os.path.join(d, "test_cuda.py")]), 0)
            with open(os.path.join(d, "out")) as f:
                got = f.read().split()
            with open(os.path.join(d, "unmatched")) as f:
                unmatched = f.read().split("\n")
            # without the source, test_out_of_memory* cannot tell test_out_of_memory_retry from a variant
            self.assertEqual(sel.main(args), 0)
            with open(os.path.join(d, "out")) as f:
                without_source = f.read().split()
        self.assertIn("test_cuda.py::TestCuda::test_out_of_memory_retry", without_source)
        self.assertIn("test_cuda.py::TestCuda::test_out_of_memory_retry_slow_True", without_source)
        self.assertEqual(got, [
            "test_cuda.py::TestCuda::test_memory_stats",
            "test_cuda.py::TestCuda::test_out_of_memory_x_1",  # in collection order
            "test_cuda.py::TestCuda::test_out_of_memory",
            "test_cuda.py::TestCudaMallocAsync::test_memory_plots_free_stack_context_all",
            "test_cuda.py::TestCudaMallocAsync::test_memory_plots_free_stack_context_state",
            "test_cuda.py::TestCudaOptimsCUDA::test_graph_optims_Adam_cuda_float32",
            "test_cuda.py::TestCudaOptimsCUDA::test_graph_optims_SGD_cuda_float32",
            "test_cuda.py::TestCudaDeviceParametrizedCUDA::test_graph_external_wait_and_record_cuda",
            "test_cuda.py::TestCuda::test_streams",
        ])
        self.assertIn("TestCuda::test_does_not_exist", unmatched)


if __name__ == "__main__":
    unittest.main()
