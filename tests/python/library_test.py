"""The package imports with no native library present and says where to put it."""

import pytest

import stepgraph
from stepgraph import StepGraphError, library_path


def test_version_is_set():
    assert stepgraph.__version__.count(".") == 2


def test_missing_override_names_the_variable(monkeypatch, tmp_path):
    missing = tmp_path / "nothing.so"
    monkeypatch.setenv("STEPGRAPH_LIBRARY", str(missing))
    with pytest.raises(StepGraphError, match="STEPGRAPH_LIBRARY=.*nothing.so does not name a file"):
        library_path()


def test_override_that_exists_is_used(monkeypatch, tmp_path):
    fake = tmp_path / "libstepgraph_c.so"
    fake.write_bytes(b"")
    monkeypatch.setenv("STEPGRAPH_LIBRARY", str(fake))
    assert library_path() == fake


def test_error_is_a_runtime_error():
    assert issubclass(StepGraphError, RuntimeError)
