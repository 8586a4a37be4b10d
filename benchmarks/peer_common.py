"""Shared by the single-GPU PyTorch peers (attention_peer.py, grouped_gemm_peer.py).

Timing: device events around single calls after a warm-up; the median, min and
max of --repeats, in microseconds. The JSON file a peer writes has the keys of
its C++ benchmark's: benchmark, impl, device, torch, repeats, warmup, rows.
tools/gpu_bundle.sh ships this file with the peers (it copies benchmarks/*.py).
"""
import itertools
import json
import statistics
import sys

import torch


def time_call(fn, warmup, repeats):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        samples.append(1000.0 * start.elapsed_time(stop))
    return {"median_us": statistics.median(samples), "min_us": min(samples), "max_us": max(samples)}


def int_list(text):
    """A flag value "1,2,3" as [1, 2, 3]."""
    return [int(v) for v in text.split(",")]


def str_list(text):
    """A flag value "a,b" as ["a", "b"]."""
    return text.split(",")


def add_run_args(parser):
    """--repeats, --warmup and --out, the flags every peer takes."""
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", default="", help="JSON file to write (none: print the table only)")


def cuda_ready(peer, need="CUDA", available=True):
    """Whether CUDA (and `available`, what else `need` names) is there; says
    so on stderr either way (the device and torch version when it is)."""
    if not torch.cuda.is_available() or not available:
        print(f"{peer}: needs {need}", file=sys.stderr)
        return False
    print(f"device: {torch.cuda.get_device_name()} torch {torch.__version__}", file=sys.stderr)
    return True


def run_rows(axes, run_case, line):
    """run_case(*case) for every case of the product of `axes` (the last
    varies fastest); prints line(row) of each row as it comes and returns the
    rows. A run_case that returns None skips its case. Cached memory is freed
    between cases so that one row's tensors do not crowd the next."""
    rows = []
    for case in itertools.product(*axes):
        row = run_case(*case)
        if row is not None:
            print(line(row), flush=True)
            rows.append(row)
        torch.cuda.empty_cache()
    return rows


def write_result(benchmark, impl, args, rows):
    """Writes the rows to args.out (when given) as the C++ benchmark's JSON."""
    if not args.out:
        return
    result = {
        "benchmark": benchmark,
        "impl": impl,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
