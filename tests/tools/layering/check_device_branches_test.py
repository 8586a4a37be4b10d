"""tools/layering/check_device_branches.py: the tree passes; a device branch
planted in a copy of a file outside the backends fails, naming the file and
line; the allow-list's entries must exist and must still branch."""

import os
import shutil
import subprocess
import sys

import pytest

from script_under_test import locate  # beside this file

SCRIPT, TREE = locate("check_device_branches.py")
sys.path.insert(0, os.path.dirname(SCRIPT))

import check_device_branches as checker  # noqa: E402

PLANTS = {
    "case label": ("  switch (kind) {\n"
                   "    case Device::kCuda: return 1;\n"
                   "    default: return 0;\n"
                   "  }\n", "case Device::kCuda:"),
    "qualified case label": ("  switch (kind) {\n"
                             "    case stepgraph::Device::kHost: return 1;\n"
                             "    default: return 0;\n"
                             "  }\n", "case stepgraph::Device::kHost:"),
    "switch on device()": ("  switch (ctx.device()) {\n"
                           "    default: return 0;\n"
                           "  }\n", "switch (ctx.device())"),
    "switch on a device variable": ("  switch (device) {\n"
                                    "    default: return 0;\n"
                                    "  }\n", "switch (device)"),
    "if ==": ("  if (device == Device::kCuda) return 1;\n", "if (device =="),
    "!= in a bool": ("  const bool gpu = ctx.device() != Device::kHost;\n", "const bool gpu"),
    "ternary": ("  return Device::kCuda == device ? 1 : 0;\n", "return Device::kCuda =="),
    "split over lines": ("  return device ==\n"
                         "         Device::kHost;\n", "return device =="),
    "device() compared": ("  return ctx->device() == other;\n", "ctx->device() =="),
    "by name": ('  if (device_name(device) == "cuda") return 1;\n', "device_name(device) =="),
    "using enum": ("  using enum Device;\n", "using enum Device"),
}

HARMLESS = ("// case Device::kCuda: in a comment\n"
            "/* if (device == Device::kHost)\n"
            "   switch (device) { case Device::kCuda: } */\n"
            'const char* kText = "device == Device::kCuda // case Device::kHost:";\n'
            "const char kQuote = '\"';  // a quote opens no string: device == Device::kHost\n"
            "Context ctx(Device::kCuda);\n"
            "const Device chosen = gpu ? Device::kCuda : Device::kHost;\n"
            "ErrorCode code = ErrorCode::kCuda;\n"
            "switch (code) { case ErrorCode::kCuda: break; }\n")


@pytest.fixture(scope="module")
def sources():
    return checker.source_files(TREE)


@pytest.fixture
def copy(tmp_path, sources):
    root = tmp_path / "tree"
    for path in sources:
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(os.path.join(TREE, path), target)
    return root


@pytest.fixture(scope="module")
def plain_file(sources):
    """A source on a library floor that may not branch (a copy of it gets the plants)."""
    for path in sources:
        if path.startswith(("ops/", "layers/", "graphs/", "kernels/")) and path.endswith(".cc") \
                and checker.allowed_by(path) is None:
            return path
    pytest.fail("no .cc file under ops/, layers/, graphs/ or kernels/ to plant a branch in")


def plant(root, path, text):
    """Appends text to root/path; returns the line number its first line gets."""
    with open(root / path) as f:
        first = f.read().count("\n") + 1
    with open(root / path, "a") as f:
        f.write(text)
    return first


def run(root):
    return subprocess.run([sys.executable, SCRIPT, "--root", str(root)], capture_output=True, text=True)


def test_the_tree_has_no_device_branch_outside_the_allowed_files():
    result = run(TREE)
    assert result.returncode == 0, result.stderr
    assert "no device branch outside the backends" in result.stdout


def test_a_planted_case_label_fails_naming_the_file_and_line(copy, plain_file):
    text, marker = PLANTS["case label"]
    first = plant(copy, plain_file, text)
    result = run(copy)
    assert result.returncode == 1, result.stdout + result.stderr
    line = first + text.split("\n").index(next(l for l in text.split("\n") if marker in l))
    assert f"{plain_file}:{line}: case Device::kCuda: return 1;" in result.stderr
    assert "device branches outside the backends" in result.stderr
    assert "ALLOWED" in result.stderr  # says where a reasoned exception goes


@pytest.mark.parametrize("name", sorted(PLANTS))
def test_every_kind_of_device_branch_is_found(copy, plain_file, name):
    text, marker = PLANTS[name]
    first = plant(copy, plain_file, text)
    lines = text.split("\n")
    line = first + next(i for i, l in enumerate(lines) if marker in l)
    problems = checker.check(str(copy))
    assert len(problems) == 1, problems
    assert f"  {plain_file}:{line}: " in problems[0]


def test_comments_strings_and_device_values_are_not_branches(copy, plain_file):
    plant(copy, plain_file, HARMLESS)
    assert checker.check(str(copy)) == []


def test_branches_in_allowed_files_and_folders_pass(copy, sources):
    allowed_file = next(entry for entry in checker.ALLOWED if not entry.endswith("/"))
    plant(copy, allowed_file, PLANTS["if =="][0])
    test_file = next(p for p in sources if p.startswith("tests/") and p.endswith(".cc"))
    plant(copy, test_file, PLANTS["case label"][0])
    assert checker.check(str(copy)) == []


def test_every_allowed_entry_has_a_reason_and_exists_in_the_tree():
    for entry, reason in checker.ALLOWED.items():
        assert len(reason) > 10, entry
        assert os.path.exists(os.path.join(TREE, entry)), entry


def test_an_allowed_path_that_does_not_exist_fails_naming_it(copy):
    missing = next(entry for entry in checker.ALLOWED if not entry.endswith("/"))
    os.remove(copy / missing)
    result = run(copy)
    assert result.returncode == 1
    assert f"ALLOWED names {missing}, which does not exist" in result.stderr


def test_an_allowed_file_that_no_longer_branches_fails_naming_it(copy):
    stale = next(entry for entry in checker.ALLOWED if not entry.endswith("/"))
    (copy / stale).write_text("// no branch left\n")
    problems = checker.check(str(copy))
    assert problems == [f"ALLOWED names {stale}, which no longer branches on a Device: "
                        f"remove it from tools/layering/check_device_branches.py"]


def test_a_root_that_is_not_a_folder_is_refused(tmp_path):
    result = run(tmp_path / "absent")
    assert result.returncode == 2
    assert "--root" in result.stderr
