"""py_pytest: runs test files with Debian's pytest under Bazel.

    py_pytest(name = "library_test", srcs = ["library_test.py"])

The tests import `stepgraph` from python/ (on PYTHONPATH). Results go to the
JUnit XML file Bazel asks for, so .ci/run counts pytest cases like GoogleTest
ones. Debian's /usr/bin/python3 is used on purpose: it has python3-pytest and
python3-numpy (installed by ./bazelw), whatever python3 comes first on PATH.
"""

def py_pytest(name, srcs, data = [], **kwargs):
    native.sh_test(
        name = name,
        srcs = ["//tools/build_defs:run_pytest.sh"],
        args = ["$(location %s)" % src for src in srcs],
        data = srcs + data + ["//python:stepgraph_package"],
        **kwargs
    )
