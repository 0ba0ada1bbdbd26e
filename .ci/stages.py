#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""stages.py - runs make targets as the stages of `make test` and `make check`.

    stages.py --make MAKE --logs DIR [--tail N] [--title T] TARGET... [-- VAR=VALUE...]

Each stage runs as `MAKE TARGET VAR=VALUE...` with its output in
DIR/TARGET.log. One line per stage says ok or FAIL, what the stage counted and
how long it took; a failing stage's line is followed by the tail of its log.
The summary at the end names every skipped test with its reason. Every stage
runs even after one fails; the exit status is non-zero if any failed.

What is counted comes from the logs:
  go test      "ok <package>" lines; with -v its "--- PASS/SKIP" lines, and
               the line a skipped test logged last (its t.Skip reason)
  C tests      "ok    <check>" and "FAIL  <check>" lines (capi/ctest/check.h),
               "skip  <reason>" lines
  pytest       the "N passed, M skipped in S s" lines, and with -rs the
               "SKIPPED [n] where: reason" lines
"""

import argparse
import collections
import os
import re
import subprocess
import sys
import time

GO_PKG = re.compile(r"^(ok|FAIL|\?)\s+(\S+)\t")  # ok  \tpkg\t0.1s; ?   \tpkg\t[no test files]
GO_RUN = re.compile(r"^=== (?:RUN|CONT|NAME)\s+(\S+)")
GO_RESULT = re.compile(r"^(\s*)--- (PASS|FAIL|SKIP): (\S+) \(")
GO_LOG = re.compile(r"^\s+\S+\.go:\d+: (.*)")
CHECK = re.compile(r"^(ok {4}|FAIL {2}|skip {2})(.*)")
PYTEST_SUMMARY = re.compile(r"^=*\s*\d+ (?:passed|failed|skipped|errors?|deselected|xfailed|xpassed)\b.* in [\d.]+s\b")
PYTEST_COUNT = re.compile(r"(\d+) (subtests passed|subtests failed|subtests skipped|passed|failed|skipped|errors?|xfailed|xpassed)")
PYTEST_SKIP = re.compile(r"^SKIPPED \[(\d+)\] (.+)$")


class Counts:
    def __init__(self):
        self.go = collections.Counter()  # ok, fail, notests, passed, failed, skipped
        self.checks = collections.Counter()  # ok, fail, skip
        self.py = collections.Counter()  # passed, failed, skipped, errors
        self.go_skips = []  # (package, test, reason)
        self.py_skips = []  # (n, "where: reason")
        self.other_skips = []  # "reason"


def parse(path):
    c = Counts()
    current = None
    last_log = {}
    pending = []  # go skips before their package's "ok" line
    with open(path, errors="replace") as f:
        for raw in f:
            line = raw.rstrip("\n")
            m = GO_PKG.match(line)
            if m:
                kind = {"ok": "ok", "FAIL": "fail", "?": "notests"}[m.group(1)]
                c.go[kind] += 1
                c.go_skips += [(m.group(2), t, r) for t, r in pending]
                pending, last_log, current = [], {}, None
                continue
            m = GO_RUN.match(line)
            if m:
                current = m.group(1)
                continue
            m = GO_RESULT.match(line)
            if m:
                indent, result, name = m.groups()
                if not indent:  # top-level tests; subtests are part of them
                    c.go[{"PASS": "passed", "FAIL": "failed", "SKIP": "skipped"}[result]] += 1
                if result == "SKIP":
                    pending.append((name, last_log.get(name, "(no reason given)")))
                continue
            m = GO_LOG.match(line)
            if m and current:
                last_log[current] = m.group(1).strip()
                continue
            m = CHECK.match(line)
            if m:
                kind = m.group(1).strip().lower()
                c.checks[kind] += 1
                if kind == "skip":
                    c.other_skips.append(m.group(2).strip())
                continue
            m = PYTEST_SKIP.match(line)
            if m:
                c.py_skips.append((int(m.group(1)), m.group(2).strip()))
                continue
            if PYTEST_SUMMARY.match(line):
                for n, what in PYTEST_COUNT.findall(line):
                    if not what.startswith("subtests"):
                        c.py["errors" if what.startswith("error") else what] += int(n)
    return c


def plural(n, word):
    return f"{n:,} {word}" + ("" if n == 1 or word.endswith("s") else "s")


def describe(c):
    parts = []
    if c.go["ok"] or c.go["fail"]:
        s = f"{plural(c.go['ok'], 'package')} ok"
        if c.go["fail"]:
            s += f", {c.go['fail']} FAILED"
        if c.go["notests"]:
            s += f", {c.go['notests']} without tests"
        parts.append(s)
        if c.go["passed"] or c.go["failed"] or c.go["skipped"]:
            s = f"{plural(c.go['passed'], 'test')} passed"
            if c.go["failed"]:
                s += f", {c.go['failed']} failed"
            if c.go["skipped"]:
                s += f", {c.go['skipped']} skipped"
            parts.append(s)
    if c.checks["ok"] or c.checks["fail"]:
        s = f"{plural(c.checks['ok'], 'check')} ok"
        if c.checks["fail"]:
            s += f", {c.checks['fail']} FAILED"
        if c.checks["skip"]:
            s += f", {c.checks['skip']} skipped"
        parts.append(s)
    if sum(c.py.values()):
        s = f"{c.py['passed']:,} passed"
        for k in ("failed", "errors", "skipped", "xfailed", "xpassed"):
            if c.py[k]:
                s += f", {c.py[k]} {k}"
        parts.append(s)
    return "; ".join(parts)


def duration(s):
    return f"{s:.0f} s" if s < 90 else f"{int(s // 60)} min {int(s % 60)} s"


def clip(s, n=170):
    return s if len(s) <= n else s[: n - 3] + "..."


def main():
    argv = sys.argv[1:]
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--make", default="make")
    ap.add_argument("--logs", required=True)
    ap.add_argument("--tail", type=int, default=40)
    ap.add_argument("--title", default="stages")
    ap.add_argument("targets", nargs="+")
    args = ap.parse_args(argv)

    os.makedirs(args.logs, exist_ok=True)
    for t in args.targets:  # no stale log from an earlier run
        try:
            os.remove(os.path.join(args.logs, t + ".log"))
        except FileNotFoundError:
            pass
    width = max(len(t) for t in args.targets) + 2
    print(f"{args.title}: {len(args.targets)} stages, logs in {args.logs}/", flush=True)
    t0 = time.monotonic()
    failed, all_counts = [], []
    for t in args.targets:
        log = os.path.join(args.logs, t + ".log")
        print(f"  {t:<{width}}", end="", flush=True)
        s0 = time.monotonic()
        with open(log, "w") as f:
            rc = subprocess.call(args.make.split() + ["--no-print-directory", t] + extra,
                                 stdout=f, stderr=subprocess.STDOUT)
        dt = time.monotonic() - s0
        c = parse(log)
        all_counts.append(c)
        what = describe(c)
        status = "ok  " if rc == 0 else "FAIL"
        print(f"{status}  {what + '  ' if what else ''}({duration(dt)})", flush=True)
        if rc != 0:
            failed.append(t)
            with open(log, errors="replace") as f:
                lines = f.read().splitlines()
            print(f"      exit status {rc}; the last {min(args.tail, len(lines))} lines of {log}:")
            for line in lines[-args.tail:]:
                print("      | " + line)

    total = duration(time.monotonic() - t0)
    go_skips = collections.OrderedDict()  # reason -> {(package, test)}
    for c in all_counts:
        for pkg, test, reason in c.go_skips:
            go_skips.setdefault(reason, set()).add((pkg.split("/", 3)[-1] if pkg.count("/") >= 3 else pkg, test))
    py_skips = collections.Counter()
    for c in all_counts:
        for n, where in c.py_skips:
            py_skips[where] += n
    other = collections.Counter(r for c in all_counts for r in c.other_skips)

    nskip = sum(len(v) for v in go_skips.values()) + sum(py_skips.values()) + sum(other.values())
    if nskip:
        print(f"skipped tests and their reasons ({nskip}):")
        for reason, tests in go_skips.items():
            names = sorted(tests)
            pkgs = sorted({p for p, _ in names})
            shown = ", ".join(n for _, n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            print(clip(f"  go   {len(names):>3}  {' '.join(pkgs)} {shown}: {reason}"))
        for where, n in py_skips.items():
            print(clip(f"  py   {n:>3}  {where}"))
        for reason, n in other.items():
            print(clip(f"  sh   {n:>3}  {reason}"))
    if failed:
        print(f"{args.title}: FAILED: {', '.join(failed)} ({len(args.targets) - len(failed)} of "
              f"{len(args.targets)} stages passed, {total}; logs in {args.logs}/)")
        return 1
    print(f"{args.title}: all {len(args.targets)} stages passed ({total})")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
