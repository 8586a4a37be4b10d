#!/usr/bin/env python3
"""Finds code that branches on a Device outside the files allowed to.

    check_device_branches.py              # the tree this file lives in
    check_device_branches.py --root DIR   # another copy of it

The backend seam (engine/backend.h: Backend, Communicator) is where the host
and cuda paths part; code above it asks its Context or Communicator and
never asks which device it runs on. A branch is a `switch` on a device with
`case Device::k...:` labels, `==` / `!=` against a `Device::k...` value
(in an `if`, a ternary or a bool), a comparison of `device()`, of
`device_name(...)`, or `using enum Device`; comments and string literals are
skipped. Every C++ source under the root is read (git's tracked and
untracked-not-ignored files when the root is a work tree), tests/ included.

ALLOWED lists the files (or folders) that may branch, each with its reason.
An entry that does not exist, or that no longer branches, is an error too,
so the list cannot rot. Exit status: 0 clean, 1 a finding, 2 bad usage.
"""

import argparse
import os
import re
import subprocess
import sys

# Path relative to the root (a folder ends with "/") -> why it may branch.
ALLOWED = {
    # The seam itself.
    "engine/backend_factory.cc": "the seam: makes the Backend (CudaBackend or HostBackend) for a Device",
    "engine/communicator.cc": "the collectives' seam: a Communicator checks that a tensor is on its own device",
    "engine/device_kind.cc": "the enum's own names (device_name)",
    "launch/join.cc": "the communicators' factory for a launched world: the rendezvous's host "
                      "communicator on host, NCCL on cuda (as backend_factory.cc is the backends')",
    # The C API's edge.
    "capi/edge.cc": "converts between the C API's sg_device and Device",
    # Programs on the top floor, which choose and describe the device for their user.
    "trainer/options.cc": "picks the defaults of the chosen device, and refuses a head width the CUDA "
                          "attention kernels do not take",
    "trainer/memory_budget.cc": "reads the chosen device's memory size (the GPU's, or the host's and its cgroup's)",
    "trainer/main.cc": "prints which device the run uses (the GPU's properties on cuda)",
    "trainer/train_loop.cc": "reports cuBLASLt's identity and starts the collectives' watchdog on cuda only "
                             "(a host rank's collectives time out by themselves)",
    "benchmarks/step_bench.cc": "parses --device, describes the device and joins the benchmark's world per device",
    "benchmarks/step_runner.cc": "measures GPU memory and primes NCCL on cuda only",
    "benchmarks/pipeline_step_runner.cc": "measures GPU memory and primes on cuda only, and makes the pp1 rows' "
                                          "one-rank pipeline per device (NCCL of one rank, or a thread world of one)",
    # Tests run a case on each device and skip cuda where there is no GPU.
    "tests/": "tests pick the device of each case and skip the cuda ones without a GPU",
}

SOURCE_SUFFIXES = (".cc", ".h", ".cu", ".cuh", ".cpp", ".hpp", ".cxx", ".hh")

_QUALIFIED = r"(?:\b\w+\s*::\s*)*"          # stepgraph:: and the like
_MEMBER = r"(?:\b[A-Za-z_]\w*\s*(?:\.|->)\s*)*"  # ctx. / options-> chains
BRANCH_PATTERNS = [
    re.compile(p) for p in (
        r"\bcase\s+" + _QUALIFIED + r"Device\s*::\s*k\w+",
        r"[!=]=\s*" + _QUALIFIED + r"Device\s*::\s*k\w+",
        r"\bDevice\s*::\s*k\w+\s*[!=]=",
        r"\bswitch\s*\(\s*" + _MEMBER + r"device_?\s*(?:\(\s*\))?\s*\)",
        r"\bdevice\s*\(\s*\)\s*[!=]=",
        r"[!=]=\s*" + _MEMBER + r"device\s*\(\s*\)",
        r"\bdevice_name\s*\([^()]*\)\s*[!=]=",
        r"[!=]=\s*" + _QUALIFIED + r"device_name\s*\(",
        r"\busing\s+enum\s+" + _QUALIFIED + r"Device\b",
        r"\busing\s+" + _QUALIFIED + r"Device\s*::\s*k\w+",
    )
]

# Comments and literals, in the order C++ reads them: a "//" inside a string
# is no comment, and a quote inside a comment opens no string.
_SKIPPED = re.compile(
    r'//[^\n]*|/\*.*?\*/|R"([^(\s]*)\(.*?\)\1"|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'',
    re.S,
)


def blank_comments_and_strings(text):
    """The text with comments and literals turned into spaces (newlines kept)."""
    def blank(match):
        return re.sub(r"[^\n]", " ", match.group(0))
    return _SKIPPED.sub(blank, text)


def source_files(root):
    """The C++ sources under root, as sorted paths relative to it."""
    try:
        listed = subprocess.run(
            ["git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            check=True, capture_output=True).stdout.decode()
        # A git work tree whose top is root (not a tree that merely contains it).
        top = subprocess.run(["git", "-C", root, "rev-parse", "--show-toplevel"],
                             check=True, capture_output=True, text=True).stdout.strip()
        if os.path.realpath(top) == os.path.realpath(root):
            return sorted(p for p in set(listed.split("\0"))
                          if p.endswith(SOURCE_SUFFIXES) and os.path.isfile(os.path.join(root, p)))
    except (OSError, subprocess.CalledProcessError):
        pass
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith((".", "bazel-"))]
        for name in files:
            if name.endswith(SOURCE_SUFFIXES):
                found.append(os.path.relpath(os.path.join(folder, name), root))
    return sorted(found)


def branches(text):
    """(line number, source line) of every device branch in a file's text."""
    code = blank_comments_and_strings(text)
    lines = text.split("\n")
    hits = set()
    for pattern in BRANCH_PATTERNS:
        for match in pattern.finditer(code):
            hits.add(code.count("\n", 0, match.start()) + 1)
    return [(n, lines[n - 1].strip()) for n in sorted(hits)]


def allowed_by(path):
    """The ALLOWED entry that covers path, or None."""
    for entry in ALLOWED:
        if path == entry or (entry.endswith("/") and path.startswith(entry)):
            return entry
    return None


def check(root):
    """The problems found under root, one message each (empty when clean)."""
    problems = []
    for entry in ALLOWED:
        target = os.path.join(root, entry)
        if not (os.path.isdir(target) if entry.endswith("/") else os.path.isfile(target)):
            problems.append(f"ALLOWED names {entry}, which does not exist under {root}: "
                            f"remove or rename it in tools/layering/check_device_branches.py")
    used = set()
    found = []
    for path in source_files(root):
        with open(os.path.join(root, path), encoding="utf-8", errors="replace") as f:
            hits = branches(f.read())
        if not hits:
            continue
        entry = allowed_by(path)
        if entry is not None:
            used.add(entry)
            continue
        found += [f"  {path}:{n}: {line}" for n, line in hits]
    if found:
        problems.append(
            "device branches outside the backends:\n" + "\n".join(found) + "\n"
            "  Ask the Context's Backend or the Communicator instead (engine/backend.h); a program or converter "
            "that must branch goes into ALLOWED in tools/layering/check_device_branches.py with its reason")
    for entry in ALLOWED:
        if entry not in used and os.path.exists(os.path.join(root, entry)):
            problems.append(f"ALLOWED names {entry}, which no longer branches on a Device: "
                            f"remove it from tools/layering/check_device_branches.py")
    return problems


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."),
                        help="the tree to check (default: the one this script is in)")
    args = parser.parse_args(argv)
    root = os.path.normpath(args.root)
    if not os.path.isdir(root):
        print(f"check_device_branches: --root {root} is not a folder", file=sys.stderr)
        return 2
    problems = check(root)
    for problem in problems:
        print(f"check_device_branches: FAIL: {problem}", file=sys.stderr)
    if problems:
        return 1
    print(f"check_device_branches: no device branch outside the backends "
          f"({len(ALLOWED)} allowed entries, each with its reason)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
