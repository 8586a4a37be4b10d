"""tools/check_notes.py on small planted trees (no git): a tree whose citations
all resolve passes; a dangling citation, a citation naming a file that does not
define the note, and one naming a file that does not exist each fail, named by
file and line. (check_notes: skip this file)"""

import os
import subprocess
import sys

import pytest

HERE = os.path.join(os.environ.get("TEST_SRCDIR", ""), os.environ.get("TEST_WORKSPACE", ""))
SCRIPT = os.path.join(HERE, "tools", "check_notes.py")
if not os.path.isfile(SCRIPT):  # run from the checkout, outside Bazel
    SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "check_notes.py")

GOOD = {
    "engine/pool.h": (
        "// Pools.\n"
        "//\n"
        "// Note [Pool lifetimes]\n"
        "// A pool lives until its last graph goes.\n"
        "#pragma once\n"
    ),
    "engine/pool.cc": (
        '#include "engine/pool.h"\n'
        "// Freed with the last graph (Note [Pool lifetimes] in pool.h).\n"
        "// Wrapped: see Note\n"
        "// [Pool\n"
        "// lifetimes] in engine/pool.h.\n"
    ),
    "tools/run.sh": "# Note [Retry rule]\n# Three tries.\nretry() { :; }  # See Note [Retry rule].\n",
    "docs/pools.md": "Pools follow Note [Pool lifetimes] in `engine/pool.h`.\n",
    "benchmarks/results/old.md": "A record: Note [Removed long ago] in gone.h.\n",
}


def plant(root, files):
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)


def run(root):
    return subprocess.run([sys.executable, SCRIPT, "--root", str(root)], capture_output=True, text=True)


def test_resolving_citations_pass(tmp_path):
    plant(tmp_path, GOOD)
    result = run(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    # Four citations: two in pool.cc (one wrapped over three lines), one in
    # run.sh, one in pools.md; benchmarks/results/ is not read.
    assert "all 4 citations resolve (2 notes defined)" in result.stdout


@pytest.mark.parametrize("base, files, messages", [
    pytest.param(GOOD, {"kernels/k.cu": "// one\n// The plan (see Note [Pool\n// lifetime]).\n"},
                 ["kernels/k.cu:2: cites Note [Pool lifetime], which no file defines",
                  "1 of 5 citations do not resolve"],
                 id="dangling_citation_named_by_file_and_line"),
    pytest.param(GOOD, {"ops/op.h": "// Note [Retry rule] in engine/pool.h applies.\n"},
                 ["ops/op.h:1: cites Note [Retry rule] in engine/pool.h, which does not define it "
                  "(it is defined in tools/run.sh)"],
                 id="citation_naming_the_wrong_file"),
    pytest.param(GOOD, {"ops/op.h": "// As in Note [Pool lifetimes] in layers/pool.h.\n"},
                 ["ops/op.h:1: cites Note [Pool lifetimes] in layers/pool.h, a file that does not exist "
                  "(it is defined in engine/pool.h)"],
                 id="citation_naming_a_missing_file"),
    # `// Note [X]: text` does not define X: a definition is the heading alone.
    pytest.param({}, {"a.h": "// Note [Inline]: not a heading.\n"},
                 ["a.h:1: cites Note [Inline], which no file defines"],
                 id="definition_with_text_on_its_line_is_a_citation"),
])
def test_unresolved_citation_fails(tmp_path, base, files, messages):
    plant(tmp_path, base)
    plant(tmp_path, files)
    result = run(tmp_path)
    assert result.returncode == 1
    for message in messages:
        assert message in result.stdout


def test_missing_root_is_an_error(tmp_path):
    result = run(tmp_path / "nope")
    assert result.returncode == 2
    assert "--root" in result.stderr


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
