"""Fuzz test of bad input: every case of fuzz_cases.py runs in its own subprocess, through the
raw C API (stepgraph._capi, ctypes) or the Python binding, and the sweep of fuzz_sweep.py (every
argument of every public entry point, given each class of fault) runs in batches of cases, one
subprocess a batch, each case with a fresh context; a batch that dies has its unreported cases
rerun one process each, so a crash is still pinned to its case. All on the device this machine
has (cuda in the GPU bundle, host in CI). Each outcome is one of

    clear error  the bad call raised the expected exception type with the expected words
    silent       the bad call returned normally
    unclear      it raised, but another type or a message without the expected words
    crash        the process died (a signal: SIGSEGV, SIGABRT, ...), timed out, or printed no marker

and the test fails on anything but a clear error (known failures: xfail(strict=True)). The
summary prints how many cases ran and the count of each outcome."""

import concurrent.futures
import inspect
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
import fuzz_sweep  # noqa: E402

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


SWEEP = tuple(fuzz_cases.Case("sweep", name, body, tuple(errors), tuple(words), None)
              for name, body, errors, words in fuzz_sweep.cases())
CASES = fuzz_cases.CASES + SWEEP
OUTCOMES = ("clear error", "crash", "silent", "unclear")

# Runs a batch of sweep cases in one process: each with a fresh ctx, reporting "CASE i OUTCOME ..."
# itself; the parent reruns alone every case of a batch that died before reporting it.
_BATCH = """{prelude}
import json as _json
_CASES = _json.loads({cases!r})
_BASE = dict(globals())
for _index, (_body, _errors, _words) in enumerate(_CASES):
    _ns = dict(_BASE)
    _ns["ctx"] = sg.Context(DEVICE)
    _expected = tuple(eval(_e, _ns) for _e in _errors)
    try:
        exec(_body, _ns)
    except _expected as _error:
        _message = str(_error).replace("\\n", " ")
        _mark = "CLEAR" if all(_w in _message for _w in _words) else "UNCLEAR"
        print(f"CASE {{_index}} {{_mark}}: {{type(_error).__name__}}: {{_message}}", flush=True)
    except BaseException as _error:
        print(f"CASE {{_index}} UNCLEAR: {{type(_error).__name__}}: {{str(_error)}}".replace("\\n", " "), flush=True)
    else:
        print(f"CASE {{_index}} SILENT", flush=True)
"""
_BATCH_SIZE = 40


def _errors_source(case):
    return [_NAMESPACE.get(name, name) for name in case.errors]


def run_batch(batch):
    """{case: (outcome, detail, seconds)} for the cases the batch process reported."""
    import json

    payload = json.dumps([[case.body, _errors_source(case), list(case.words)] for case in batch])
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-c", _BATCH.format(prelude=fuzz_cases.PRELUDE, cases=payload),
                               DEVICE], capture_output=True, text=True, timeout=TIMEOUT_S * 4, env=dict(os.environ),
                              check=False)
        stdout = done.stdout
    except subprocess.TimeoutExpired as expired:
        stdout = expired.stdout.decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
    seconds = (time.monotonic() - start) / max(len(batch), 1)
    results = {}
    for line in stdout.splitlines():
        if not line.startswith("CASE "):
            continue
        index_text, _, rest = line[len("CASE "):].partition(" ")
        case = batch[int(index_text)]
        if rest.startswith("CLEAR: "):
            results[case] = ("clear error", rest[len("CLEAR: "):], seconds)
        elif rest.startswith("UNCLEAR: "):
            results[case] = ("unclear", rest[len("UNCLEAR: "):] + f" (expected {'/'.join(case.errors)} with "
                                                                 f"{list(case.words)})", seconds)
        elif rest == "SILENT":
            results[case] = ("silent", "the bad call returned normally", seconds)
    return results


_RESULTS = {}


def _run_all():
    if not _RESULTS:
        workers = min(16, (os.cpu_count() or 4) * 2)
        batches = [SWEEP[i:i + _BATCH_SIZE] for i in range(0, len(SWEEP), _BATCH_SIZE)]
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            batch_results = pool.map(run_batch, batches)
            for case, result in zip(fuzz_cases.CASES, pool.map(run_case, fuzz_cases.CASES)):
                _RESULTS[case.area, case.name] = result
            unreported = []
            for batch, reported in zip(batches, batch_results):
                for case in batch:
                    if case in reported:
                        _RESULTS[case.area, case.name] = reported[case]
                    else:
                        unreported.append(case)
            for case, result in zip(unreported, pool.map(run_case, unreported)):  # alone: crash or not
                _RESULTS[case.area, case.name] = result
    return _RESULTS


def counts():
    """{outcome: cases} over every case, each outcome listed (0 where none)."""
    results = _run_all()
    out = dict.fromkeys(OUTCOMES, 0)
    for case in CASES:
        outcome = results[case.area, case.name][0]
        out[outcome] = out.get(outcome, 0) + 1
    return out


def table():
    results = _run_all()
    rows = [f"fuzz on {DEVICE}: {len(CASES)} cases ({len(fuzz_cases.CASES)} one process each, {len(SWEEP)} in the "
            f"sweep of every public entry point)"]
    for case in CASES:
        outcome, detail, seconds = results[case.area, case.name]
        known = " [known failure]" if case.xfail else ""
        rows.append(f"  {case.area:8} {case.name:56} {outcome:12}{known} {seconds:5.1f}s  {detail[:160]}")
    by_area = {}
    for case in CASES:
        key = (case.area, results[case.area, case.name][0])
        by_area[key] = by_area.get(key, 0) + 1
    rows.append("  by area: " + ", ".join(f"{area}/{outcome}: {n}" for (area, outcome), n in sorted(by_area.items())))
    rows.append(f"  totals: {len(CASES)} cases: " + ", ".join(f"{outcome} {n}" for outcome, n in counts().items()))
    return "\n".join(rows)


def test_table_has_enough_cases_in_every_area():
    areas = [case.area for case in CASES]
    assert len({(case.area, case.name) for case in CASES}) == len(CASES), "case names must be unique in an area"
    assert len(areas) >= 400
    assert areas.count("capi") >= 20 and areas.count("binding") >= 20 and areas.count("sweep") >= 300


# --- every public entry point is in the sweep ---------------------------------------------------

# Not entry points of the binding's own: exceptions, an enum and a namedtuple (Python's behaviour).
_NOT_SWEPT = {"ArgumentError", "StepGraphError", "DType", "Parameter", "IGNORE_INDEX", "__version__"}


def _parameters(function, drop_first):
    params = list(inspect.signature(function).parameters.values())
    return [p.name for p in (params[1:] if drop_first else params)]


def public_entry_points():
    """{entry name: [parameter names]} of every public function, constructor, method and property
    setter of stepgraph (methods under the class that defines them, e.g. Layer.forward)."""
    out = {}
    for name in sg.__all__:
        if name in _NOT_SWEPT:
            continue
        obj = getattr(sg, name)
        if not inspect.isclass(obj):
            out[name] = _parameters(obj, drop_first=False)
            continue
        out[name] = None if name in fuzz_sweep.MADE_BY_THE_LIBRARY else _parameters(obj, drop_first=False)
        for klass in obj.__mro__:
            if klass.__module__.split(".")[0] != "stepgraph":
                continue
            for attr, value in vars(klass).items():
                if attr.startswith("_") and attr != "__call__":
                    continue
                entry = f"{klass.__name__}.{attr}"
                if isinstance(value, property):
                    if value.fset is not None:
                        out[entry] = _parameters(value.fset, drop_first=True)
                elif isinstance(value, (classmethod, staticmethod)):
                    out[entry] = _parameters(value.__func__, drop_first=isinstance(value, classmethod))
                elif inspect.isfunction(value):
                    out[entry] = _parameters(value, drop_first=True)
    return out


def test_every_public_entry_point_is_swept():
    """Each entry point that takes arguments has a sweep entry covering every argument; the others
    take none (checked here), or are made by the library from C handles (their MADE_FROM_OTHER cases)."""
    missing = []
    for entry, params in sorted(public_entry_points().items()):
        if params is None:  # made by the library: sg.Tensor(3) and the like are sweep cases
            assert any(body.startswith(f"sg.{entry}(") for _, body, _, _ in fuzz_sweep.MADE_FROM_OTHER), entry
            continue
        if not params:
            assert entry in fuzz_sweep.NO_ARGUMENTS, f"{entry} takes no argument: list it in NO_ARGUMENTS"
            continue
        swept = fuzz_sweep.ENTRIES.get(entry)
        uncovered = [p for p in params if swept is None or (p not in swept.args and p != "fields")]
        if uncovered:
            missing.append(f"{entry}({', '.join(uncovered)})")
    assert not missing, f"public entry points with arguments the sweep does not fault: {missing}"
    stale = set(fuzz_sweep.ENTRIES) - set(public_entry_points())
    assert not stale, f"sweep entries that are not public entry points: {stale}"


def test_every_sweep_entry_runs_with_its_good_arguments():
    """Each sweep entry's call with every argument good runs without error in one process, so each
    case's error comes from its one bad argument."""
    import json

    bodies = fuzz_sweep.good_bodies()
    script = fuzz_cases.PRELUDE + f"""
import json as _json, traceback as _tb
_BASE = dict(globals())
for _name, _body in _json.loads({json.dumps(bodies)!r}):
    _ns = dict(_BASE)
    _ns["ctx"] = sg.Context(DEVICE)
    try:
        exec(_body, _ns)
    except BaseException as _error:
        print("FAILED", _name, type(_error).__name__, str(_error).replace("\\n", " ")[:300], flush=True)
print("DONE", flush=True)
"""
    done = subprocess.run([sys.executable, "-c", script, DEVICE], capture_output=True, text=True,
                          timeout=TIMEOUT_S * 4, env=dict(os.environ), check=False)
    assert done.stdout.strip().endswith("DONE"), done.stdout + done.stderr[-2000:]
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED")
              and not (DEVICE == "host" and line.startswith("FAILED Context.cuda_stream "))]
    assert not failed, "\n".join(failed)


def test_summary(record_testsuite_property, capsys):
    """Prints the case count and the count of each outcome (always, past pytest's capture; the whole
    table with pytest -s), records the table as a JUnit test-suite property, and fails naming every
    crash, silent or unclear case that is not a known failure, so the JUnit output carries the list."""
    text = table()
    print("\n" + text)
    with capsys.disabled():
        print("\n" + "\n".join(text.splitlines()[:1] + text.splitlines()[-2:]))
    record_testsuite_property("fuzz_table", text)
    record_testsuite_property("fuzz_counts", str(counts()))
    results = _run_all()
    bad = [f"{case.area}/{case.name}" for case in CASES
           if not case.xfail and results[case.area, case.name][0] != "clear error"]
    assert not bad, f"{len(bad)} case(s) without a clear error: {bad}\n{text}"
    totals = counts()
    assert totals["crash"] == totals["silent"] == totals["unclear"] == 0, totals


def _params():
    for case in CASES:
        marks = [pytest.mark.xfail(strict=True, reason=case.xfail)] if case.xfail else []
        yield pytest.param(case, id=f"{case.area}-{case.name}", marks=marks)


@pytest.mark.parametrize("case", list(_params()))
def test_case(case):
    outcome, detail, _ = _run_all()[case.area, case.name]
    assert outcome == "clear error", f"{case.area}/{case.name}: {outcome}: {detail}\nsnippet:\n{case.body}"
