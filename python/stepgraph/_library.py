"""Locating the native StepGraph library that the binding loads with ctypes.

Search order: the STEPGRAPH_LIBRARY environment variable (a path to the
shared library), then the package directory itself, where the GPU bundle and
the Bazel targets place it.
"""

import os
from pathlib import Path

LIBRARY_NAME = "libstepgraph_c.so"
ENVIRONMENT_VARIABLE = "STEPGRAPH_LIBRARY"


class StepGraphError(RuntimeError):
    """An error from StepGraph, carrying the engine's message."""


def library_path() -> Path:
    """The path of the native library; StepGraphError says where it looked."""
    override = os.environ.get(ENVIRONMENT_VARIABLE)
    if override:
        path = Path(override)
        if not path.is_file():
            raise StepGraphError(
                f"{ENVIRONMENT_VARIABLE}={override} does not name a file; point it at {LIBRARY_NAME}"
            )
        return path
    beside = Path(__file__).resolve().parent / LIBRARY_NAME
    if beside.is_file():
        return beside
    raise StepGraphError(
        f"{LIBRARY_NAME} not found: set {ENVIRONMENT_VARIABLE} to its path, or place it in {beside.parent}"
    )
