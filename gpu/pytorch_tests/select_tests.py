#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Selections of PyTorch's own tests for run.sh.

    python3 gpu/pytorch_tests/select_tests.py build [--tests-dir .ref/pytorch-tests] [--out-dir gpu/pytorch_tests/selections]
    python3 gpu/pytorch_tests/select_tests.py show  [--tests-dir ...]        # every test with its topic, selected or not
    python3 gpu/pytorch_tests/select_tests.py expand --collected F --selection F --file test_cuda.py --out F [--unmatched F] [--source test_cuda.py]

build writes, from INVENTORY.md (the topics it lists tests under) and the
test files' source (which tests exist, which are parametrized):

    test_cuda.txt                  allocator/memory, streams/events (record_stream ...),
                                   CUDA graph and MemPool tests of test_cuda.py
    test_cuda.{memory,streams,graphs}.txt   the same, split by topic
    test_cudagraph_trees.txt       every test of inductor/test_cudagraph_trees.py
    test_cudagraph_trees.partN.txt the same in --parts parts (default 4)
    test_cudagraph_trees.short.txt 27 representative ones (SHORT_TREES below)

A selection line is `Class::test` (that test; in a device-type class also
ClassCUDA::test_cuda), `Class::test*` (a parametrized test: its generated
variants test_<suffix>) or a pytest node id; `#` starts a comment (build
writes the topic there). expand (called by run.sh) turns the lines into the
node ids `pytest --collect-only -q` printed.
"""

import argparse
import ast
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
DEFAULT_TESTS = os.path.join(REPO, ".ref", "pytorch-tests")
DEFAULT_OUT = os.path.join(HERE, "selections")
CUDA_FILE = "test_cuda.py"
TREES_FILE = os.path.join("inductor", "test_cudagraph_trees.py")

# Decorators whose tests pytest sees under generated names (test_<suffix>).
PARAM_DECORATORS = {"parametrize", "dtypes", "dtypesIfCUDA", "ops", "optims", "modules", "subtest"}

# ---- test_cuda.py: what is "the allocator" ----------------------------------
# Classes taken whole (topic), then per-test keyword rules for the others.
CUDA_CLASSES = {
    "TestMemPool": "mempool",
    "TestBlockStateAbsorption": "graphs (pool checkpoints)",
    "TestCachingHostAllocatorCudaGraph": "graphs",
    "TestFXMemoryProfiler": "memory (snapshots)",
}
# TestCudaMallocAsync holds the allocator's tests (snapshots, history,
# settings, OOM) next to device telemetry through NVML/AMD SMI.
CUDA_EXCLUDE = re.compile(r"nvml|temperature|power_draw|clock_speed|amdsmi|uuid|_fp16$|cublas_allow|cudnn_allow|"
                          r"batch_norm|reduction_gpu_memory|"
                          r"pinned|host_memory|cudart_register|is_pinned|non_blocking|autocast|compile_kernel|gds|"
                          r"greencontext|device_count|get_device|lazy_init|serialization|multinomial|randint")
CUDA_TOPICS = (  # (topic, regex on the test name), first match wins
    ("mempool", re.compile(r"mempool|mem_pool")),
    ("graphs", re.compile(r"graph")),
    ("streams/events", re.compile(r"record_stream|stream|event|synchroniz")),
    ("memory/allocator", re.compile(r"memory|alloc|oom|out_of_memory|fraction|caching|empty_cache|stats|snapshot|"
                                    r"leak|workspace|expandable|garbage_collect|max_split|cycles|raises_oom")),
)
# test_cuda.txt split by topic (regex on the topic): test_cuda.PART.txt
CUDA_PARTS = (
    ("graphs", re.compile(r"graph", re.I)),
    ("streams", re.compile(r"stream|event", re.I)),
    ("memory", re.compile(r"^(?!.*(graph|stream|event)).*", re.I)),
)
# Topic words in INVENTORY.md headings that select a group of tests.
INVENTORY_WANTED = re.compile(r"alloc|memory|mempool|mem pool|pool|stream|event|graph|snapshot|oom|stat|ipc|"
                              r"record_stream|checkpoint|history|fraction", re.I)
INVENTORY_UNWANTED = re.compile(r"host|pinned|autocast|telemetry|nvml|amdsmi", re.I)

# ---- test_cudagraph_trees.py: a short representative set --------------------
# CudaGraphTreeTests (and TestSAC) tests chosen for what they make the
# allocator do. A name missing from the file is reported by build.
SHORT_TREES = [
    ("CudaGraphTreeTests", "test_run_simple", "record and replay"),
    ("CudaGraphTreeTests", "test_rng_trees", "record and replay"),
    ("CudaGraphTreeTests", "test_function_compiled_multiple_times", "several graphs in one tree"),
    ("CudaGraphTreeTests", "test_separate_recordings", "several graphs in one tree"),
    ("CudaGraphTreeTests", "test_accumulate_multiple_recordings", "several graphs in one tree"),
    ("CudaGraphTreeTests", "test_end_recording_early", "recording ends, pool state"),
    ("CudaGraphTreeTests", "test_execution_into_recording", "checkpoint: replay then record"),
    ("CudaGraphTreeTests", "test_tensor_dies_between_checkpoint", "checkpoint"),
    ("CudaGraphTreeTests", "test_checkpointing_resets_persistent_refs", "checkpoint"),
    ("CudaGraphTreeTests", "test_aliased_output_checkpoint", "checkpoint"),
    ("CudaGraphTreeTests", "test_checkpoint_shared_output_storage_deallocation", "checkpoint, deallocation"),
    ("CudaGraphTreeTests", "test_live_outputs_multiple_graphs", "liveness of outputs"),
    ("CudaGraphTreeTests", "test_peristed_output_livenes", "liveness of outputs"),
    ("CudaGraphTreeTests", "test_aliased_storage_single_weakref", "aliasing"),
    ("CudaGraphTreeTests", "test_tensor_no_longer_in_pool", "pool membership"),
    ("CudaGraphTreeTests", "test_error_on_dealloc_use", "deallocated outputs"),
    ("CudaGraphTreeTests", "test_cleanup", "pool released"),
    ("CudaGraphTreeTests", "test_forward_backward", "training"),
    ("CudaGraphTreeTests", "test_backward_gets_cached_cudagraphs", "training"),
    ("CudaGraphTreeTests", "test_forward_generation", "training, generations"),
    ("CudaGraphTreeTests", "test_dynamic_backward", "dynamic shapes"),
    ("CudaGraphTreeTests", "test_rerecord_if_static_input_address_changed", "addresses of static inputs"),
    ("CudaGraphTreeTests", "test_single_stream_use", "streams"),
    ("CudaGraphTreeTests", "test_side_stream_memory_allocation", "allocation on a side stream"),
    ("CudaGraphTreeTests", "test_workspace_allocation_error", "allocation during capture"),
    ("CudaGraphTreeTests", "test_conv_benchmark", "cuDNN benchmark (cacheInfo) in a tree"),
    ("TestSAC", "test_simple", "selective activation checkpointing"),
]


# ---------------------------------------------------------------------------
# Reading the test files


def _decorator_names(fn):
    out = set()
    for d in fn.decorator_list:
        node = d.func if isinstance(d, ast.Call) else d
        while isinstance(node, ast.Attribute):
            out.add(node.attr)
            node = node.value
        if isinstance(node, ast.Name):
            out.add(node.id)
    return out


def read_tests(path):
    """[(class, test, parametrized)] in source order, and the device-type
    classes (instantiate_device_type_tests)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    device_classes = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == \
                "instantiate_device_type_tests" and node.args and isinstance(node.args[0], ast.Name):
            device_classes.add(node.args[0].id)
    tests = []
    for node in ast.walk(tree):  # classes may sit under `if HAS_CUDA:` blocks
        if not isinstance(node, ast.ClassDef):
            continue
        for fn in node.body:
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name.startswith("test"):
                param = bool(_decorator_names(fn) & PARAM_DECORATORS) or node.name in device_classes
                tests.append((node.name, fn.name, param))
    return tests, device_classes


def read_inventory(path):
    """{test name or Class::test: heading it is listed under} from INVENTORY.md.
    Headings (#...) and table/list rows naming tests are read; a row's own
    topic column, if any, is appended to the heading."""
    found = {}
    if not path or not os.path.isfile(path):
        return found
    heading = ""
    with open(path, encoding="utf-8") as f:
        for line in f:
            s = line.strip()
            if s.startswith("#"):
                heading = s.lstrip("#").strip()
                continue
            names = re.findall(r"(?:\b([A-Z]\w*)(?:::|\.))?\b(test_\w+)", s)
            if not names:
                continue
            cells = [c.strip() for c in s.strip("|").split("|")] if s.startswith("|") else []
            topic_cells = [c for c in cells if c and not re.search(r"test_\w+", c)]
            topic = heading + (" / " + " / ".join(topic_cells) if topic_cells else "")
            for cls, name in names:
                found[f"{cls}::{name}" if cls else name] = topic
    return found


def inventory_topic(inv, cls, name):
    return inv.get(f"{cls}::{name}") or inv.get(name)


def cuda_topic(cls, name):
    """The rules' topic for a test_cuda.py test, or None (not the allocator's)."""
    if cls in CUDA_CLASSES:
        return CUDA_CLASSES[cls]
    if cls in ("TestCudaAutocast", "TestCompileKernel", "TestGDS", "TestGreenContext", "TestThatContainsCUDAAssertFailure"):
        return None
    if CUDA_EXCLUDE.search(name):
        return None
    for topic, rx in CUDA_TOPICS:
        if rx.search(name):
            return topic
    if cls == "TestCudaMallocAsync":  # despite its name, the caching allocator's class
        return "memory/allocator"
    return None


def line_for(cls, name, param, comment):
    return f"{cls}::{name}{'*' if param else ''}".ljust(72) + f"  # {comment}"


# ---------------------------------------------------------------------------
# build / show


def select_cuda(tests, inv):
    """[(class, name, param, topic, source)] of test_cuda.py's selected tests."""
    out = []
    for cls, name, param in tests:
        it = inventory_topic(inv, cls, name)
        rule = cuda_topic(cls, name)
        if it is not None:
            take = bool(INVENTORY_WANTED.search(it)) and not INVENTORY_UNWANTED.search(it)
            if take:
                out.append((cls, name, param, it, "inventory"))
            elif rule and cls not in CUDA_CLASSES:  # a memory test by its name that INVENTORY.md files elsewhere
                out.append((cls, name, param, f"{rule} (rules; INVENTORY.md: {it})", "rules"))
        elif rule:
            out.append((cls, name, param, rule, "rules"))
    return out


def select_short(tests):
    """[(class, name, param, topic)] of SHORT_TREES found in tests, and the missing ones."""
    by_key = {(c, n): p for c, n, p in tests}
    chosen, missing = [], []
    for cls, name, topic in SHORT_TREES:
        if (cls, name) in by_key:
            chosen.append((cls, name, by_key[(cls, name)], topic))
        else:
            missing.append(f"{cls}::{name}")
    return chosen, missing


def cmd_build(args):
    inv_path = args.inventory or os.path.join(args.tests_dir, "INVENTORY.md")
    inv = read_inventory(inv_path)
    if not inv:
        print(f"note: no tests read from {inv_path}: test_cuda.py's selection follows select_tests.py's rules only")
    os.makedirs(args.out_dir, exist_ok=True)
    written = []
    cuda_path = os.path.join(args.tests_dir, CUDA_FILE)
    if os.path.isfile(cuda_path):
        tests, _ = read_tests(cuda_path)
        sel = select_cuda(tests, inv)
        lines = [f"# {CUDA_FILE}: allocator/memory, streams/events, CUDA graphs, MemPool ({len(sel)} of {len(tests)} tests)",
                 "# written by select_tests.py build; Class::test* = all parametrized variants"]
        lines += [line_for(c, n, p, topic) for c, n, p, topic, _ in sel]
        written.append(_write(os.path.join(args.out_dir, "test_cuda.txt"), lines))
        # the same, one file per topic (shorter runs)
        for part, rx in CUDA_PARTS:
            some = [x for x in sel if rx.search(x[3])]
            lines = [f"# {CUDA_FILE}, {part}: {len(some)} tests (part of test_cuda.txt)"]
            lines += [line_for(c, n, p, topic) for c, n, p, topic, _ in some]
            written.append(_write(os.path.join(args.out_dir, f"test_cuda.{part}.txt"), lines))
    else:
        print(f"skipped {CUDA_FILE}: {cuda_path} does not exist")
    trees_path = os.path.join(args.tests_dir, TREES_FILE)
    if os.path.isfile(trees_path):
        tests, _ = read_tests(trees_path)
        lines = [f"# {TREES_FILE}: every test ({len(tests)})"]
        lines += [line_for(c, n, p, inventory_topic(inv, c, n) or "cudagraph trees") for c, n, p in tests]
        written.append(_write(os.path.join(args.out_dir, "test_cudagraph_trees.txt"), lines))
        for k in range(args.parts):  # the same in parts, for runs under a time limit
            some = tests[k::args.parts]
            lines = [f"# {TREES_FILE}: part {k + 1} of {args.parts} ({len(some)} tests)"]
            lines += [line_for(c, n, p, inventory_topic(inv, c, n) or "cudagraph trees") for c, n, p in some]
            written.append(_write(os.path.join(args.out_dir, f"test_cudagraph_trees.part{k + 1}.txt"), lines))
        short, missing = select_short(tests)
        lines = [f"# {TREES_FILE}: {len(short)} representative tests (select_tests.py SHORT_TREES)"]
        lines += [line_for(c, n, p, topic) for c, n, p, topic in short]
        if missing:
            lines.append("# not in this file: " + " ".join(missing))
            print(f"note: SHORT_TREES names missing from {trees_path}: {' '.join(missing)}")
        written.append(_write(os.path.join(args.out_dir, "test_cudagraph_trees.short.txt"), lines))
    else:
        print(f"skipped {TREES_FILE}: {trees_path} does not exist")
    for path, n in written:
        print(f"wrote {path} ({n} lines)")
    return 0 if written else 1


def _write(path, lines):
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return path, sum(1 for x in lines if not x.startswith("#"))


def cmd_show(args):
    inv = read_inventory(args.inventory or os.path.join(args.tests_dir, "INVENTORY.md"))
    path = os.path.join(args.tests_dir, CUDA_FILE)
    tests, _ = read_tests(path)
    chosen = {(c, n): (t, src) for c, n, _, t, src in select_cuda(tests, inv)}
    for cls, name, param in tests:
        topic, src = chosen.get((cls, name), (None, None))
        mark = "+" if topic else "-"
        extra = inventory_topic(inv, cls, name) or ""
        print(f"{mark} {cls}::{name}{'*' if param else ''}  [{topic or cuda_topic(cls, name) or ''}] {src or ''}"
              + (f"  INVENTORY: {extra}" if extra else ""))
    return 0


# ---------------------------------------------------------------------------
# expand (run.sh)


def read_selection(path):
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            s = line.split("#", 1)[0].strip()
            if s:
                out.append(s)
    return out


def read_collected(path):
    ids = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            s = line.strip()
            if "::" in s and not s.startswith(("<", "=", "ERROR", "FAILED", "WARNING")) and " " not in s:
                ids.append(s)
    return ids


def expand(collected, selection, filename, defined=None):
    """Selection lines -> (node ids in selection order, unmatched lines).

    defined: {class: {test names defined in the source}}; a pattern's prefix
    match skips tests defined in their own right and their variants
    (test_x* takes neither test_x_retry nor test_x_retry_<suffix> when the
    source defines test_x_retry)."""
    defined = defined or {}
    parsed = []
    for nid in collected:
        parts = nid.split("::")
        if len(parts) >= 3:
            parsed.append((nid, parts[-2], parts[-1]))
        elif len(parts) == 2:
            parsed.append((nid, None, parts[-1]))
    out, seen, unmatched = [], set(), []
    for line in selection:
        hits = []
        if line.endswith(".py") or ".py::" in line:  # a node id
            hits = [line] if line in collected or not collected else []
        else:
            pattern = line.endswith("*")
            body = line[:-1] if pattern else line
            cls, _, name = body.rpartition("::")
            others = [o for o in defined.get(cls, ()) if o != name and o.startswith(name + "_")]
            for nid, c, n in parsed:
                if cls and c not in (cls, cls + "CUDA"):
                    continue
                if n in (name, name + "_cuda"):
                    hits.append(nid)
                elif pattern and n.startswith(name + "_") and not any(n == o or n.startswith(o + "_") for o in others):
                    hits.append(nid)
        if not hits:
            unmatched.append(line)
        for h in hits:
            if h not in seen:
                seen.add(h)
                out.append(h)
    return out, unmatched


def cmd_expand(args):
    collected = read_collected(args.collected)
    selection = read_selection(args.selection)
    defined = {}
    if args.source and os.path.isfile(args.source):
        tests, _ = read_tests(args.source)
        for c, n, _ in tests:
            defined.setdefault(c, set()).add(n)
    ids, unmatched = expand(collected, selection, args.file, defined)
    if not collected:
        print(f"select_tests.py expand: {args.collected} lists no collected tests (collection failed?)", file=sys.stderr)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write("".join(i + "\n" for i in ids))
    if args.unmatched:
        with open(args.unmatched, "w", encoding="utf-8") as f:
            f.write("".join(u + "\n" for u in unmatched))
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("build", "show"):
        p = sub.add_parser(name)
        p.add_argument("--tests-dir", default=DEFAULT_TESTS, help="where test_cuda.py and inductor/ are")
        p.add_argument("--inventory", help="INVENTORY.md (default: TESTS_DIR/INVENTORY.md)")
        if name == "build":
            p.add_argument("--out-dir", default=DEFAULT_OUT)
            p.add_argument("--parts", type=int, default=4, help="test_cudagraph_trees.partN.txt files to write")
    p = sub.add_parser("expand")
    p.add_argument("--collected", required=True, help="output of pytest --collect-only -q")
    p.add_argument("--selection", required=True)
    p.add_argument("--file", required=True, help="the test file's name, as in the node ids")
    p.add_argument("--source", help="the test file (to tell parametrized variants from tests of their own)")
    p.add_argument("--out", required=True)
    p.add_argument("--unmatched")
    args = ap.parse_args(argv)
    return {"build": cmd_build, "show": cmd_show, "expand": cmd_expand}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
