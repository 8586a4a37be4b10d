#!/usr/bin/env python3
"""Counts test cases from JUnit-style XML (GoogleTest and pytest write it).

    count_test_results.py --testlogs bazel-testlogs --targets targets.txt
    count_test_results.py results/*.xml

Prints failing and skipped cases, then one last line
"N passed, N failed, N skipped". A case that skipped (GTEST_SKIP, e.g. a GPU
test on a machine without a GPU, or pytest.skip) counts as skipped, never as
passed. With --targets, a test target that left no XML (it crashed before
writing any) counts as one failed case. Exit status: 0 when something ran and
nothing failed, 1 otherwise.
"""

import argparse
import os
import sys
import xml.etree.ElementTree as ET


def classify(case):
    """'passed', 'failed' or 'skipped' for one <testcase>."""
    if case.find("failure") is not None or case.find("error") is not None:
        return "failed"
    if (case.find("skipped") is not None or case.get("result") == "skipped"
            or case.get("status") == "notrun"):
        return "skipped"
    return "passed"


def count_file(path, counts, notes):
    try:
        root = ET.parse(path).getroot()
    except (ET.ParseError, OSError) as error:
        counts["failed"] += 1
        notes.append(f"FAILED  {path}: unreadable results ({error})")
        return
    cases = list(root.iter("testcase"))
    if not cases and root.iter("testsuite"):
        # A Bazel-written stand-in for a test that produced no XML of its own.
        for suite in root.iter("testsuite"):
            if int(suite.get("failures", "0")) or int(suite.get("errors", "0")):
                counts["failed"] += 1
                notes.append(f"FAILED  {path}: the test binary failed without reporting cases")
    for case in cases:
        outcome = classify(case)
        counts[outcome] += 1
        name = f"{case.get('classname', '')}.{case.get('name', '')}"
        if outcome == "failed":
            notes.append(f"FAILED  {name} ({path})")
        elif outcome == "skipped":
            node = case.find("skipped")
            why = (node.get("message") or node.text or "") if node is not None else ""
            why = " ".join(why.split())[:160]
            notes.append(f"skipped {name}: {why}")


def xml_for_label(testlogs, label):
    # //tests/engine:shape_test -> <testlogs>/tests/engine/shape_test/test.xml
    package, _, name = label.lstrip("/").partition(":")
    return os.path.join(testlogs, package, name, "test.xml")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("xml", nargs="*", help="JUnit XML files")
    parser.add_argument("--testlogs", help="bazel-testlogs directory")
    parser.add_argument("--targets", help="file with one test label per line")
    parser.add_argument("--quiet-skips", action="store_true", help="do not list skipped cases")
    args = parser.parse_args()

    counts = {"passed": 0, "failed": 0, "skipped": 0}
    notes = []
    paths = list(args.xml)
    if args.targets:
        with open(args.targets) as targets:
            for label in (line.strip() for line in targets):
                if not label:
                    continue
                path = xml_for_label(args.testlogs or "bazel-testlogs", label)
                if os.path.exists(path):
                    paths.append(path)
                else:
                    counts["failed"] += 1
                    notes.append(f"FAILED  {label}: no test results (it did not build or did not run)")
    for path in paths:
        count_file(path, counts, notes)

    for note in notes:
        if not (args.quiet_skips and note.startswith("skipped")):
            print(note)
    print(f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    ran = sum(counts.values())
    return 0 if ran > 0 and counts["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
