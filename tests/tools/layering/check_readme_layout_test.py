"""tools/layering/check_readme_layout.py: the tree's README matches the tree;
a copy whose table names a missing folder, or that leaves a tracked folder
out, fails and names it."""

import os
import shutil
import subprocess
import sys

from script_under_test import locate  # beside this file

SCRIPT, TREE = locate("check_readme_layout.py")


def run(root):
    return subprocess.run([sys.executable, SCRIPT, "--root", root], capture_output=True, text=True)


def copy_of_tree(tmp_path):
    """README.md and an empty folder per top-level folder, in a fresh git work tree."""
    root = tmp_path / "tree"
    root.mkdir()
    shutil.copy(os.path.join(TREE, "README.md"), root / "README.md")
    tracked = subprocess.run(["git", "-C", TREE, "ls-files"], check=True, capture_output=True, text=True).stdout
    for line in tracked.splitlines():
        if "/" in line and not line.startswith("."):
            parts = line.split("/")
            # The folder, and one level below it (the table names tools/'s sub-folders).
            (root / parts[0]).mkdir(exist_ok=True)
            (root / parts[0] / ".keep").touch()
            if len(parts) > 2:
                (root / parts[0] / parts[1]).mkdir(exist_ok=True)
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run(["git", "-C", str(root), "add", "-A"], check=True)
    return root


def test_the_tree_matches_its_readme():
    result = run(TREE)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all present" in result.stdout


def test_a_copy_matches_too(tmp_path):
    result = run(str(copy_of_tree(tmp_path)))
    assert result.returncode == 0, result.stdout + result.stderr


def expect_fails_naming(root, message):
    """The check of `root` fails, and its report has `message`."""
    result = run(str(root))
    assert result.returncode == 1
    assert message in result.stdout


def test_a_missing_folder_is_named(tmp_path):
    root = copy_of_tree(tmp_path)
    shutil.rmtree(root / "launch")
    subprocess.run(["git", "-C", str(root), "add", "-A"], check=True)
    expect_fails_naming(root, "names `launch/`, which does not exist")


def test_a_folder_left_out_of_the_table_is_named(tmp_path):
    root = copy_of_tree(tmp_path)
    (root / "scheduler").mkdir()
    (root / "scheduler" / "plan.cc").touch()
    subprocess.run(["git", "-C", str(root), "add", "-A"], check=True)
    expect_fails_naming(root, "`scheduler/` is in the tree but not in the README's layout section")


def test_a_sub_folder_that_is_gone_is_named(tmp_path):
    root = copy_of_tree(tmp_path)
    shutil.rmtree(root / "tools" / "demo")
    expect_fails_naming(root, "names `demo/` under trainer, benchmarks, python, tools, which is in none of them")
