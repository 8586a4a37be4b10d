"""Reads a checkpoint written by the C++ trainer code with plain Python
(json + numpy), proving the safetensors layout and the checksum's definition
(see Note [Checkpoint integrity] in checkpoint/checkpoint.h)."""

import json
import os
import struct
import subprocess

import numpy as np

WRITER = os.path.join(os.environ["TEST_SRCDIR"], os.environ["TEST_WORKSPACE"], "tests/checkpoint/checkpoint_writer")


def fnv1a64(data, value=0xCBF29CE484222325):
    for byte in data:
        value = ((value ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return value


def write_and_read(tmp_path):
    path = tmp_path / "model.safetensors"
    subprocess.run([WRITER, str(path)], check=True)
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    return raw, length, header, raw[8 + length :]


def tensor(header, data, name):
    entry = header[name]
    begin, end = entry["data_offsets"]
    numpy_dtype = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "I32": "<i4", "I64": "<i8"}[entry["dtype"]]
    array = np.frombuffer(data[begin:end], dtype=numpy_dtype).reshape(entry["shape"])
    if entry["dtype"] == "BF16":  # bf16 is the top half of a float32
        array = (array.astype(np.uint32) << 16).view(np.float32)
    return array


def test_values_read_back(tmp_path):
    _, length, header, data = write_and_read(tmp_path)
    assert length % 8 == 0
    assert header["__metadata__"]["step"] == "42"
    assert header["__metadata__"]["model"] == "read-check"
    np.testing.assert_array_equal(tensor(header, data, "weight"), np.array([[-1.0, -0.5, 0.0], [0.5, 1.0, 1.5]]))
    np.testing.assert_array_equal(tensor(header, data, "bias"), np.array([1.0, -2.0, 0.5], dtype=np.float32))
    np.testing.assert_array_equal(tensor(header, data, "half"), np.array([1.0, -0.5], dtype=np.float16))
    np.testing.assert_array_equal(tensor(header, data, "ids"), np.array([1, 2, 3, -4]))
    step = tensor(header, data, "step")
    assert step.shape == () and step == 42


def test_offsets_tile_the_data(tmp_path):
    _, _, header, data = write_and_read(tmp_path)
    spans = sorted(tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__")
    assert spans[0][0] == 0
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert spans[-1][1] == len(data)


def test_checksum_definition(tmp_path):
    raw, _, header, _ = write_and_read(tmp_path)
    start = b'{"__metadata__":{"stepgraph.checksum":"fnv1a64:'
    assert raw[8 : 8 + len(start)] == start  # the checksum comes first, at fixed bytes
    digits = raw[8 + len(start) : 8 + len(start) + 16]
    assert header["__metadata__"]["stepgraph.checksum"] == "fnv1a64:" + digits.decode()
    # FNV-1a over the whole file with the 16 digits read as '0'.
    zeroed = raw[: 8 + len(start)] + b"0" * 16 + raw[8 + len(start) + 16 :]
    assert int(digits, 16) == fnv1a64(zeroed)
