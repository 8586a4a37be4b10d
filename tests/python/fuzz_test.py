"""Fuzz test of bad input (issue 12 part 6): every case of fuzz_cases.py runs in its own
subprocess, through the raw C API (stepgraph._capi, ctypes) or the Python binding, on the
device this machine has (cuda in the GPU bundle, host in CI). Each outcome is one of

    clear error  the bad call raised the expected exception type with the expected words
    silent       the bad call returned normally
    unclear      it raised, but another type or a message without the expected words
    crash        the process died (a signal: SIGSEGV, SIGABRT, ...), timed out, or printed no marker

and the test fails on anything but a clear error (known failures: xfail(strict=True))."""

import concurrent.futures
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import stepgraph as sg

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fuzz_cases  # noqa: E402

DEVICE = "cuda" if sg.cuda_device_count()[0] > 0 else "host"
TIMEOUT_S = 30

# Wraps a case body: the snippet reports the outcome itself with a marker line.
_WRAPPER = """{prelude}
_expected = ({errors},)
_words = {words!r}
try:
{body}
except _expected as _error:
    _message = str(_error)
    if all(_word in _message for _word in _words):
        print("CLEAR: " + type(_error).__name__ + ": " + _message.replace("\\n", " "), flush=True)
    else:
        print("UNCLEAR: " + type(_error).__name__ + ": " + _message.replace("\\n", " "), flush=True)
    sys.exit(0)
except BaseException as _error:
    print("UNCLEAR: " + type(_error).__name__ + ": " + str(_error).replace("\\n", " "), flush=True)
    sys.exit(0)
print("SILENT", flush=True)
"""

_NAMESPACE = {"StepGraphError": "sg.StepGraphError", "ArgumentError": "sg.ArgumentError"}


def snippet(case):
    errors = ", ".join(_NAMESPACE.get(name, name) for name in case.errors)
    return _WRAPPER.format(prelude=fuzz_cases.PRELUDE, errors=errors, words=list(case.words),
                           body=textwrap.indent(case.body, "    "))


def run_case(case):
    """(outcome, detail, seconds): runs the case's snippet with `python3 -c` in a subprocess that
    inherits this environment (PYTHONPATH, STEPGRAPH_LIBRARY)."""
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-c", snippet(case), DEVICE], capture_output=True, text=True,
                              timeout=TIMEOUT_S, env=dict(os.environ), check=False)
    except subprocess.TimeoutExpired:
        return "crash", f"timed out after {TIMEOUT_S} s", time.monotonic() - start
    seconds = time.monotonic() - start
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name
        return "crash", f"killed by {name}; stderr: {done.stderr.strip()[-400:]}", seconds
    lines = done.stdout.strip().splitlines()
    marker = lines[-1] if lines else ""
    if done.returncode == 0 and marker.startswith("CLEAR: "):
        return "clear error", marker[len("CLEAR: "):], seconds
    if done.returncode == 0 and marker == "SILENT":
        return "silent", "the bad call returned normally", seconds
    if done.returncode == 0 and marker.startswith("UNCLEAR: "):
        return "unclear", marker[len("UNCLEAR: "):] + f" (expected {'/'.join(case.errors)} with {list(case.words)})", \
            seconds
    return "crash", f"exit {done.returncode}, no marker; stderr: {done.stderr.strip()[-400:]}", seconds


_RESULTS = {}


def _run_all():
    if not _RESULTS:
        workers = min(16, (os.cpu_count() or 4) * 2)
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            for case, result in zip(fuzz_cases.CASES, pool.map(run_case, fuzz_cases.CASES)):
                _RESULTS[case.area, case.name] = result
    return _RESULTS


def table():
    results = _run_all()
    rows = [f"fuzz on {DEVICE}: {len(fuzz_cases.CASES)} cases"]
    for case in fuzz_cases.CASES:
        outcome, detail, seconds = results[case.area, case.name]
        known = " [known failure]" if case.xfail else ""
        rows.append(f"  {case.area:8} {case.name:40} {outcome:12}{known} {seconds:5.1f}s  {detail[:160]}")
    counts = {}
    for case in fuzz_cases.CASES:
        key = (case.area, results[case.area, case.name][0])
        counts[key] = counts.get(key, 0) + 1
    rows.append("  totals: " + ", ".join(f"{area}/{outcome}: {n}" for (area, outcome), n in sorted(counts.items())))
    return "\n".join(rows)


def test_table_has_enough_cases_in_both_areas():
    areas = [case.area for case in fuzz_cases.CASES]
    assert len(areas) >= 60
    assert areas.count("capi") >= 20 and areas.count("binding") >= 20


def test_summary(record_testsuite_property):
    """Prints the table (pytest -s), records it as a JUnit test-suite property, and fails naming every crash,
    silent or unclear case that is not a known failure, so the JUnit output carries the list."""
    text = table()
    print("\n" + text)
    record_testsuite_property("fuzz_table", text)
    results = _run_all()
    bad = [f"{case.area}/{case.name}" for case in fuzz_cases.CASES
           if not case.xfail and results[case.area, case.name][0] != "clear error"]
    assert not bad, f"{len(bad)} case(s) without a clear error: {bad}\n{text}"


def _params():
    for case in fuzz_cases.CASES:
        marks = [pytest.mark.xfail(strict=True, reason=case.xfail)] if case.xfail else []
        yield pytest.param(case, id=f"{case.area}-{case.name}", marks=marks)


@pytest.mark.parametrize("case", list(_params()))
def test_case(case):
    outcome, detail, _ = _run_all()[case.area, case.name]
    assert outcome == "clear error", f"{case.area}/{case.name}: {outcome}: {detail}\nsnippet:\n{case.body}"
