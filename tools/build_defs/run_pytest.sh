#!/usr/bin/env bash
# Runs pytest on the given files for py_pytest (see pytest.bzl), writing JUnit
# XML where Bazel asks for it.
set -euo pipefail
export PYTHONPATH="${TEST_SRCDIR}/${TEST_WORKSPACE}/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
xml=()
[ -n "${XML_OUTPUT_FILE:-}" ] && xml=("--junitxml=${XML_OUTPUT_FILE}")
exec /usr/bin/python3 -m pytest -q -p no:cacheprovider "${xml[@]}" "$@"
