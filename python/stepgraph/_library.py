"""Locating and loading the native StepGraph library that the binding uses with ctypes.

Search order: the STEPGRAPH_LIBRARY environment variable (a path to the
shared library), then the package directory itself, where the GPU bundle and
the Bazel targets place it.
"""

import os
from pathlib import Path

LIBRARY_NAME = "libstepgraph_c.so"
ENVIRONMENT_VARIABLE = "STEPGRAPH_LIBRARY"

# sg_result values (capi/stepgraph.h, mirroring stepgraph::ErrorCode).
RESULT_NAMES = {
    1: "invalid_argument",
    2: "invalid_state",
    3: "unsupported",
    4: "no_device",
    5: "out_of_memory",
    6: "cuda",
    7: "cublas",
    8: "nccl",
    9: "io",
    10: "internal",
}


class StepGraphError(RuntimeError):
    """An error from StepGraph, carrying the engine's message and result code.

    `code` is the C API's sg_result (None for errors raised by the binding
    itself before any call, except ArgumentError), `code_name` its stable name
    ("invalid_argument", "cuda", ...), `message` the engine's full message.
    """

    def __init__(self, message, code=None):
        super().__init__(message)
        self.message = message
        self.code = code
        self.code_name = RESULT_NAMES.get(code, "unknown") if code is not None else None


class ArgumentError(StepGraphError, ValueError):
    """An argument the binding refuses before it reaches ctypes (an integer out of its C type's
    range, a shape or dtype that does not match the tensor, a label outside [0, vocab)): code
    "invalid_argument" like the engine's own checks, and a ValueError too."""

    def __init__(self, message):
        super().__init__(message, 1)


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
