#!/usr/bin/env python3
"""Compares two trainer checkpoints tensor by tensor, bit for bit: every
tensor of the first must be in the second with the same dtype, shape and
bytes. Prints each tensor that differs (and how many of its elements);
exit 1 when any does. Metadata (the step, the data position, the run's
configuration) is compared too, except keys given with --ignore.

    compare_checkpoints.py whole.safetensors resumed.safetensors
"""
import argparse
import json
import struct
import sys

ELEMENT_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I32": 4, "I64": 8, "U8": 1}


def read(path):
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise SystemExit(f"{path}: {len(data)} bytes, not a checkpoint")
    (header_bytes,) = struct.unpack("<Q", data[:8])
    if header_bytes > len(data) - 8:
        raise SystemExit(f"{path}: its header claims {header_bytes} bytes, more than the file holds")
    header = json.loads(data[8 : 8 + header_bytes])
    body = data[8 + header_bytes :]
    metadata = header.pop("__metadata__", {})
    tensors = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        tensors[name] = (entry["dtype"], tuple(entry["shape"]), body[begin:end])
    return tensors, metadata


def differing_elements(dtype, a, b):
    width = ELEMENT_BYTES.get(dtype, 1)
    return sum(1 for i in range(0, len(a), width) if a[i : i + width] != b[i : i + width])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("reference")
    parser.add_argument("other")
    parser.add_argument("--ignore", action="append", default=[], help="a metadata key not compared")
    args = parser.parse_args()
    want, want_meta = read(args.reference)
    got, got_meta = read(args.other)
    problems = []
    for name, (dtype, shape, data) in sorted(want.items()):
        if name not in got:
            problems.append(f"{name}: missing from {args.other}")
            continue
        other_dtype, other_shape, other_data = got[name]
        if (dtype, shape) != (other_dtype, other_shape):
            problems.append(f"{name}: {dtype} {list(shape)} against {other_dtype} {list(other_shape)}")
        elif data != other_data:
            count = differing_elements(dtype, data, other_data)
            problems.append(f"{name}: {count} of {len(data) // ELEMENT_BYTES.get(dtype, 1)} elements differ")
    problems += [f"{name}: only in {args.other}" for name in sorted(set(got) - set(want))]
    for key in sorted(set(want_meta) | set(got_meta)):
        if key not in args.ignore and want_meta.get(key) != got_meta.get(key):
            problems.append(f"metadata {key}: {want_meta.get(key)!r} against {got_meta.get(key)!r}")
    for line in problems:
        print(line)
    print(f"{len(want)} tensors compared: {'identical' if not problems else f'{len(problems)} difference(s)'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
