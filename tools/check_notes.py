#!/usr/bin/env python3
"""Checks that every cited named note exists (STYLE.md: named notes).

A note is defined by a comment line holding its heading alone, `// Note [Title]`
or `# Note [Title]`, with the text below it. Everything else that names a note is
a citation: `See Note [Title]`, `(Note [Title])`, `Note [Title] in path/file.h`,
in code comments, docs and READMEs alike; a citation may wrap across comment
lines. This fails, naming file and line, for each citation whose title no file
defines, and for each citation that names a file (`... in some/file.h`) where
that file does not exist or does not define the note. A file named without a
folder (`in linear.h`) is looked up beside the citing file first.

    tools/check_notes.py                 # the tracked files of this checkout
    tools/check_notes.py --root DIR      # DIR's tracked files, or every file where DIR is no checkout

benchmarks/results/ is skipped (measurement records of their day), and so is a
file containing the marker `check_notes: skip this file` (this script and its
test, whose examples are not notes). Exit status 0 when every citation
resolves, 1 otherwise.
"""

import argparse
import bisect
import os
import re
import subprocess
import sys
from collections import defaultdict

SKIP_MARKER = "check_notes: " + "skip this file"
SKIPPED_PREFIXES = ("benchmarks/results/",)

# A comment line's marker: //, #, or a block comment's leading * (or /*).
COMMENT_LEAD = re.compile(r"^\s*(?://+!?|#+|/\*+|\*+(?!/))?\s?")
DEFINITION = re.compile(r"^\s*(?://+|#+)\s*Note \[([^\[\]]+)\]\s*$")
CITATION = re.compile(r"Note\s+\[([^\[\]]+)\]")
# `... ] in path/file.ext`, the path possibly in backticks.
NAMED_FILE = re.compile(r"\]\s+in\s+`?([A-Za-z0-9_./-]+\.(?:h|hpp|cc|cpp|c|cu|cuh|py|sh|bzl|bazel|md))\b")


def normalize(title):
    return " ".join(title.split())


def tracked_files(root):
    """Paths relative to root: git's tracked files where root is a checkout's top, else every file."""
    if not os.path.exists(os.path.join(root, ".git")):
        return walk(root)
    try:
        out = subprocess.run(["git", "-C", root, "ls-files", "-z"], check=True, capture_output=True).stdout
        return [p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"check_notes: git ls-files failed in {root} ({e}); pass --root a checkout or a plain folder")


def walk(root):
    paths = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith((".", "bazel-"))]
        paths += [os.path.relpath(os.path.join(folder, f), root) for f in files]
    return sorted(paths)


def read_text(path):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def scan(text):
    """(definitions, citations): [(title, line)] and [(title, line, named file or None)]."""
    lines = text.split("\n")
    definitions = []
    definition_lines = set()
    for number, line in enumerate(lines, 1):
        m = DEFINITION.match(line)
        if m:
            definitions.append((normalize(m.group(1)), number))
            definition_lines.add(number)
    # Comment markers stripped and lines joined, so a citation that wraps
    # ("(Note\n// [Title])", "Note [Two\n// words]") reads as one.
    starts, parts, offset = [], [], 0
    for line in lines:
        stripped = COMMENT_LEAD.sub("", line, count=1)
        starts.append(offset)
        parts.append(stripped)
        offset += len(stripped) + 1
    joined = " ".join(parts)
    citations = []
    for m in CITATION.finditer(joined):
        number = bisect.bisect_right(starts, m.start())
        if number in definition_lines:
            continue
        after = NAMED_FILE.match(joined, m.end() - 1)
        citations.append((normalize(m.group(1)), number, after.group(1) if after else None))
    return definitions, citations


def resolve(root, citing, named):
    """The repository path a citation's named file means, or None if there is none."""
    beside = os.path.normpath(os.path.join(os.path.dirname(citing), named))
    for candidate in (beside, os.path.normpath(named)):
        if os.path.isfile(os.path.join(root, candidate)):
            return candidate
    return None


def check(root):
    """The failure lines for the files under root."""
    defined = defaultdict(set)  # title -> files defining it
    all_citations = []
    for rel in tracked_files(root):
        if rel.startswith(SKIPPED_PREFIXES):
            continue
        text = read_text(os.path.join(root, rel))
        if text is None or SKIP_MARKER in text:
            continue
        definitions, citations = scan(text)
        for title, _ in definitions:
            defined[title].add(rel)
        all_citations += [(rel, line, title, named) for title, line, named in citations]
    failures = []
    for rel, line, title, named in all_citations:
        where = f"{rel}:{line}"
        if title not in defined:
            failures.append(f"{where}: cites Note [{title}], which no file defines "
                            f"(define it with a line '// Note [{title}]' above its text, or fix the title)")
            continue
        if named is None:
            continue
        path = resolve(root, rel, named)
        if path is None:
            failures.append(f"{where}: cites Note [{title}] in {named}, a file that does not exist "
                            f"(it is defined in {', '.join(sorted(defined[title]))})")
        elif path not in defined[title]:
            failures.append(f"{where}: cites Note [{title}] in {named}, which does not define it "
                            f"(it is defined in {', '.join(sorted(defined[title]))})")
    return failures, len(all_citations), len(defined)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        help="the checkout to check (default: the one holding this script)")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.root):
        print(f"check_notes: --root {args.root} is not a directory", file=sys.stderr)
        return 2
    failures, citations, notes = check(args.root)
    for failure in failures:
        print(failure)
    if failures:
        print(f"check_notes: {len(failures)} of {citations} citations do not resolve ({notes} notes defined)")
        return 1
    print(f"check_notes: all {citations} citations resolve ({notes} notes defined)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
