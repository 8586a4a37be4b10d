"""For the GPU tests: skip, saying why, where torch or a CUDA device is missing; and
a runner so a test file also works as a plain script (`python3 file.py`) where the
machine has no pytest."""

import sys
import unittest

import stepgraph as sg


def require_cuda():
    """A cuda Context, or unittest.SkipTest (pytest reports it as a skip) with the reason."""
    count, reason = sg.cuda_device_count()
    if count == 0:
        raise unittest.SkipTest(f"StepGraph sees no CUDA device: {reason}")
    return sg.Context("cuda")


def require_torch():
    """torch with a CUDA device, or unittest.SkipTest saying which is missing."""
    try:
        import torch
    except ImportError as error:
        raise unittest.SkipTest(f"torch is not installed: {error}")
    if not torch.cuda.is_available():
        raise unittest.SkipTest("torch sees no CUDA device")
    return torch


def run_as_script(namespace, name):
    """Runs every test_* function of a module without pytest; exits 1 if any failed."""
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for test_name, function in sorted(namespace.items()):
        if not test_name.startswith("test_") or not callable(function):
            continue
        try:
            function()
        except unittest.SkipTest as skip:
            counts["skipped"] += 1
            print(f"SKIP {test_name}: {skip}")
        except Exception as error:  # noqa: BLE001 - report every failure, then exit 1
            counts["failed"] += 1
            print(f"FAIL {test_name}: {type(error).__name__}: {error}")
        else:
            counts["passed"] += 1
            print(f"PASS {test_name}")
    print(f"{name}: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    sys.exit(1 if counts["failed"] else 0)
