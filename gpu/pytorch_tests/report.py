#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Markdown report of PyTorch's own tests run natively and with cudapool.

    python3 gpu/pytorch_tests/report.py OUT_DIR [OUT_DIR ...] [-o REPORT.md]
                                        [--reasons gpu/pytorch_tests/reasons.txt]

Reads the JUnit XML files run.sh leaves in OUT_DIR: NAME.native.xml and
NAME.cudapool.xml (several NAMEs, e.g. one per file or per chunk, are
merged by test file), with NAME.MODE.run (exit status, time, timeout),
NAME.cudapool.installs (processes that installed cudapool), NAME.env and
NAME.conf (the PYTORCH_CUDA_ALLOC_CONF both sides ran with: run.sh -c)
when present. The report gives totals per file; the tests that pass
natively and, of those, how many pass with cudapool; each one that does not,
with the first line of its failure message; and the tests skipped or failing
natively, separately.

reasons.txt (no YAML): one `test_id<TAB>reason` per line, '#' comments.
test_id is `file.py::Class::test`, `Class::test` or `test`, and may hold
fnmatch wildcards (`TestMemPool::test_*expandable*`). The reason is printed
next to each matching test that does not pass with cudapool (or natively).
"""

import argparse
import datetime
import fnmatch
import glob
import os
import re
import sys
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ("native", "cudapool")
PASS, FAIL, ERROR, SKIP, XFAIL, MISSING = "passed", "failed", "error", "skipped", "xfailed", "not run"


class Result:
    __slots__ = ("status", "message", "time")

    def __init__(self, status, message="", time=0.0):
        self.status, self.message, self.time = status, message, time


def first_line(text, limit=240):
    for line in (text or "").splitlines():
        line = line.strip()
        if line:
            return line if len(line) <= limit else line[: limit - 1] + "\u2026"
    return ""


def test_id(case):
    """file.py::Class::test from a <testcase> (classname "mod.Class" or "pkg.mod.Class")."""
    classname = case.get("classname") or ""
    name = case.get("name") or "?"
    parts = classname.split(".") if classname else []
    filename = case.get("file")
    if parts and parts[-1][:1].isupper():
        cls, mod = parts[-1], parts[:-1]
    else:
        cls, mod = None, parts
    if filename:
        filename = os.path.basename(filename)
    elif mod:
        filename = mod[-1] + ".py"
    else:
        filename = "?"
    return "::".join(p for p in (filename, cls, name) if p)


def parse_case(case):
    """The Result of one <testcase>."""
    time = float(case.get("time") or 0.0)
    failure = case.find("failure")
    error = case.find("error")
    skipped = case.find("skipped")
    for elem, status in ((failure, FAIL), (error, ERROR)):
        if elem is not None:
            msg = first_line(elem.get("message")) or first_line(elem.text)
            if failure is not None and error is not None and status == FAIL:
                msg += " (and an error in teardown)"
            return Result(status, msg, time)
    if skipped is not None:
        kind = (skipped.get("type") or "").lower()
        msg = first_line(skipped.get("message")) or first_line(skipped.text)
        return Result(XFAIL if "xfail" in kind else SKIP, msg, time)
    return Result(PASS, "", time)


def read_junit(path):
    """{test_id: Result} of one JUnit XML file."""
    root = ET.parse(path).getroot()
    out = {}
    for case in root.iter("testcase"):
        if not case.get("name"):  # pytest writes an empty <testcase/> for a run interrupted mid-test
            continue
        tid = test_id(case)
        r = parse_case(case)
        prev = out.get(tid)
        # a test reported twice (rerun, setup and call): keep the worse outcome
        if prev is None or _rank(r.status) > _rank(prev.status):
            out[tid] = r
    return out


def _rank(status):
    return {PASS: 0, SKIP: 1, XFAIL: 1, FAIL: 2, ERROR: 3}.get(status, 0)


def read_reasons(path):
    """[(pattern, reason)] from reasons.txt; missing file: []."""
    if not path or not os.path.isfile(path):
        return []
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            if "\t" not in line:
                raise SystemExit(f"{path}:{n}: expected `test_id<TAB>reason`, got {line!r}")
            pattern, reason = line.split("\t", 1)
            out.append((pattern.strip(), reason.strip()))
    return out


def reason_for(tid, reasons):
    short = tid.split("::", 1)[1] if "::" in tid else tid
    name = tid.rsplit("::", 1)[-1]
    for pattern, reason in reasons:
        if pattern == tid or pattern == short or pattern == name:
            return reason
    for pattern, reason in reasons:
        if any(fnmatch.fnmatchcase(x, pattern) for x in (tid, short, name)):
            return reason
    return ""


def read_kv(path):
    """rc=0 seconds=12 ... -> dict."""
    try:
        with open(path) as f:
            return dict(item.split("=", 1) for item in f.read().split() if "=" in item)
    except OSError:
        return {}


def collect(dirs):
    """Runs found in dirs: {file: {"native": {tid: Result}, "cudapool": {...}}}, and notes per run."""
    files, runs = {}, []
    for d in dirs:
        for xml in sorted(glob.glob(os.path.join(d, "*.xml"))):
            base = os.path.basename(xml)
            m = re.match(r"(.+)\.(native|cudapool)\.xml$", base)
            if not m:
                continue
            name, mode = m.groups()
            try:
                results = read_junit(xml)
            except ET.ParseError as e:
                runs.append({"name": name, "mode": mode, "dir": d, "problem": f"unreadable XML: {e}"})
                continue
            for tid, r in results.items():
                fname = tid.split("::", 1)[0]
                files.setdefault(fname, {m_: {} for m_ in MODES})[mode][tid] = r
            info = read_kv(os.path.join(d, f"{name}.{mode}.run"))
            run = {"name": name, "mode": mode, "dir": d, "tests": len(results), **info}
            if mode == "cudapool":
                run.update(installs(os.path.join(d, f"{name}.cudapool.installs")))
            runs.append(run)
        for runfile in sorted(glob.glob(os.path.join(d, "*.run"))):
            m = re.match(r"(.+)\.(native|cudapool)\.run$", os.path.basename(runfile))
            if m and not os.path.exists(os.path.join(d, f"{m.group(1)}.{m.group(2)}.xml")):
                runs.append({"name": m.group(1), "mode": m.group(2), "dir": d, "tests": 0,
                             "problem": "no JUnit XML (crashed or killed)", **read_kv(runfile)})
    return files, runs


def installs(path):
    if not os.path.isfile(path):
        return {}
    ok = failed = 0
    first_failure = ""
    with open(path, errors="replace") as f:
        for line in f:
            if line.startswith("ok "):
                ok += 1
            elif line.startswith("FAILED "):
                failed += 1
                first_failure = first_failure or line.strip()
    return {"installs_ok": ok, "installs_failed": failed, "first_install_failure": first_failure}


def env_lines(dirs):
    seen = []
    for d in dirs:
        for p in sorted(glob.glob(os.path.join(d, "*.env"))):
            with open(p, errors="replace") as f:
                for line in f:
                    line = line.strip()
                    if line and line not in seen:
                        seen.append(line)
    return seen


def conf_lines(dirs):
    """The configurations both sides ran with (NAME.conf), each once; an
    empty file is each allocator's defaults."""
    seen = []
    for d in dirs:
        for p in sorted(glob.glob(os.path.join(d, "*.conf"))):
            with open(p, errors="replace") as f:
                conf = f.read().strip()
            if conf not in seen:
                seen.append(conf)
    return seen


def describe_conf(conf):
    if not conf:
        return "each allocator's defaults (PYTORCH_CUDA_ALLOC_CONF unset)"
    return f"`PYTORCH_CUDA_ALLOC_CONF={conf}` on both sides"


def md(text):
    """Safe inside a Markdown table cell."""
    return (text or "").replace("|", "\\|").replace("\n", " ").replace("`", "'")


def classify(native, cp):
    """Split one file's tests into the report's groups."""
    groups = {"pass_both": [], "regressions": [], "skipped_native": [], "failed_native": [], "only_cp": []}
    for tid in sorted(set(native) | set(cp)):
        n = native.get(tid)
        c = cp.get(tid, Result(MISSING))
        if n is None:
            groups["only_cp"].append((tid, c))
        elif n.status == PASS:
            (groups["pass_both"] if c.status == PASS else groups["regressions"]).append((tid, n, c))
        elif n.status in (SKIP, XFAIL):
            groups["skipped_native"].append((tid, n, c))
        else:
            groups["failed_native"].append((tid, n, c))
    return groups


def short(tid):
    return tid.split("::", 1)[1] if "::" in tid else tid


def render(files, runs, reasons, env, sources, confs=()):
    out = []
    w = out.append
    w("# PyTorch's own tests with cudapool")
    w("")
    w(f"Generated by `gpu/pytorch_tests/report.py` on {datetime.date.today().isoformat()} from "
      + ", ".join(f"`{s}`" for s in sources) + ". Each selected test ran twice: natively "
      "(PyTorch's caching allocator) and with cudapool installed in every Python process "
      "(`gpu/pytorch_tests/run.sh`, `CUDAPOOL_AUTOINSTALL=1`).")
    w("")
    if env:
        w("Machine: " + "; ".join(env) + ".")
        w("")
    if confs:
        w("Configuration: " + "; ".join(describe_conf(c) for c in confs) + ".")
        w("")
    w("## Totals")
    w("")
    w("| test file | tests | pass natively | of those, pass with cudapool | do not | skipped/xfail natively | fail natively |")
    w("|---|---:|---:|---:|---:|---:|---:|")
    all_groups = {}
    for fname in sorted(files):
        g = classify(files[fname]["native"], files[fname]["cudapool"])
        all_groups[fname] = g
        npass = len(g["pass_both"]) + len(g["regressions"])
        total = npass + len(g["skipped_native"]) + len(g["failed_native"]) + len(g["only_cp"])
        w(f"| {fname} | {total} | {npass} | {len(g['pass_both'])} | {len(g['regressions'])} | "
          f"{len(g['skipped_native'])} | {len(g['failed_native'])} |")
    w("")
    if runs:
        w("## Runs")
        w("")
        w("| run | mode | tests | exit status | time | notes |")
        w("|---|---|---:|---:|---:|---|")
        for r in sorted(runs, key=lambda r: (r["name"], MODES.index(r["mode"]))):
            notes = []
            if r.get("timed_out") == "1":
                notes.append(f"TIMED OUT after {r.get('timeout', '?')} s")
            if r.get("problem"):
                notes.append(r["problem"])
            if "installs_ok" in r:
                notes.append(f"cudapool installed in {r['installs_ok']} process(es)"
                             + (f", FAILED in {r['installs_failed']}: {r['first_install_failure'][:160]}"
                                if r["installs_failed"] else ""))
            secs = f"{r['seconds']} s" if r.get("seconds") else ""
            w(f"| {md(r['name'])} | {r['mode']} | {r.get('tests', 0)} | {r.get('rc', '')} | {secs} | {md('; '.join(notes))} |")
        w("")
    for fname, g in sorted(all_groups.items()):
        w(f"## {fname}")
        w("")
        npass = len(g["pass_both"]) + len(g["regressions"])
        w(f"{npass} tests pass natively; {len(g['pass_both'])} of them pass with cudapool.")
        w("")
        def section(title, rows, header, cells):
            w(f"### {title} ({len(rows)})")
            w("")
            if rows:
                w("| " + " | ".join(header) + " |")
                w("|" + "---|" * len(header))
                for tid, n, c in rows:
                    w(f"| `{md(short(tid))}` | " + " | ".join(cells(n, c)) + f" | {md(reason_for(tid, reasons))} |")
            else:
                w("None.")
            w("")

        section("Pass natively, not with cudapool", g["regressions"],
                ["test", "with cudapool", "first line of the message", "reason"],
                lambda n, c: [c.status, md(c.message)])
        section("Skipped or expected to fail natively", g["skipped_native"],
                ["test", "natively", "why", "with cudapool", "reason"],
                lambda n, c: [n.status, md(n.message), c.status])
        section("Fail natively", g["failed_native"],
                ["test", "natively", "first line of the message", "with cudapool", "reason"],
                lambda n, c: [n.status, md(n.message), c.status])
        if g["only_cp"]:
            w(f"### Run with cudapool only ({len(g['only_cp'])})")
            w("")
            w("| test | with cudapool | first line of the message |")
            w("|---|---|---|")
            for tid, c in g["only_cp"]:
                w(f"| `{md(short(tid))}` | {c.status} | {md(c.message)} |")
            w("")
        w(f"<details><summary>Pass natively and with cudapool ({len(g['pass_both'])})</summary>")
        w("")
        for tid, n, c in g["pass_both"]:
            w(f"- `{md(short(tid))}`")
        w("")
        w("</details>")
        w("")
    return "\n".join(out).rstrip() + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description="Markdown report of PyTorch's tests, natively and with cudapool.")
    ap.add_argument("dirs", nargs="+", help="directories with NAME.native.xml and NAME.cudapool.xml (run.sh's OUT_DIR)")
    ap.add_argument("-o", "--out", help="write the report here (default: stdout)")
    ap.add_argument("--reasons", default=os.path.join(HERE, "reasons.txt"), help="test_id<TAB>reason file")
    args = ap.parse_args(argv)
    for d in args.dirs:
        if not os.path.isdir(d):
            ap.error(f"{d} is not a directory")
    files, runs = collect(args.dirs)
    if not files and not runs:
        print(f"no NAME.native.xml / NAME.cudapool.xml in {', '.join(args.dirs)}", file=sys.stderr)
        return 1
    text = render(files, runs, read_reasons(args.reasons), env_lines(args.dirs), args.dirs, conf_lines(args.dirs))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {args.out}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
