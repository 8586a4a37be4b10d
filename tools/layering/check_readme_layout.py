#!/usr/bin/env python3
"""Checks that the README's layout table matches the tree.

    check_readme_layout.py [--root DIR]

The table under "## Layout" in README.md names each floor's folders in its
second column (`engine/`, `launch/`, ...) and, in its third, sub-folders of
them (`build_defs/`, `demo/`). Every folder named must exist; every
top-level folder git tracks must be named in the table or in the text of the
section (tests/, third_party/, docs/ are described below the table). Exit
status: 0 matches, 1 a mismatch (each printed), 2 bad usage.
"""

import argparse
import os
import re
import subprocess
import sys


def layout_section(readme):
    match = re.search(r"^## Layout\n(.*?)(?=^## |\Z)", readme, re.M | re.S)
    if not match:
        raise SystemExit("check_readme_layout: README.md has no '## Layout' section")
    return match.group(1)


def tracked_top_folders(root):
    files = subprocess.run(["git", "-C", root, "ls-files"], check=True, capture_output=True, text=True).stdout
    return {line.split("/", 1)[0] for line in files.splitlines() if "/" in line and not line.startswith(".")}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    args = parser.parse_args()
    with open(os.path.join(args.root, "README.md"), encoding="utf-8") as f:
        section = layout_section(f.read())
    problems = []
    named_top = set()
    for row in (line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| floor")):
        cells = [c.strip() for c in row.strip("|").split("|")]
        if len(cells) < 3 or set(cells[0]) <= {"-"}:
            continue
        folders = re.findall(r"`([\w.-]+)/`", cells[1])
        for folder in folders:
            named_top.add(folder)
            if not os.path.isdir(os.path.join(args.root, folder)):
                problems.append(f"the layout table names `{folder}/`, which does not exist")
        for sub in re.findall(r"`([\w.-]+)/`", cells[2]):
            if not any(os.path.isdir(os.path.join(args.root, folder, sub)) for folder in folders):
                problems.append(f"the layout table names `{sub}/` under {', '.join(folders)}, which is in none of them")
    mentioned = set(re.findall(r"`([\w.-]+)/`", section))
    for folder in sorted(tracked_top_folders(args.root) - mentioned - named_top):
        problems.append(f"`{folder}/` is in the tree but not in the README's layout section")
    for problem in problems:
        print(f"check_readme_layout: {problem}")
    if problems:
        return 1
    print(f"check_readme_layout: the layout table names {len(named_top)} folders, all present; every top-level folder is named")
    return 0


if __name__ == "__main__":
    sys.exit(main())
