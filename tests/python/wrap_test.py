"""Context.wrap checks what the wrapped object can tell: a view must lie inside the memory
behind it (numpy's base buffer, a torch tensor's storage, a cupy allocation), so an as_strided
view larger than its buffer is refused before StepGraph reads or writes past it. And
sg_tensor_wrap checks the byte count for every address. GPU objects are tested where torch or
cupy and a device are present, and skip saying why otherwise."""

import ctypes
import mmap

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

import stepgraph as sg
from stepgraph import _capi


@pytest.fixture
def ctx():
    with sg.Context("host") as context:
        yield context


def test_wrap_of_a_whole_array_and_of_a_slice_that_fits(ctx):
    base = np.arange(24, dtype=np.float32)
    assert ctx.wrap(base).shape == (24,)
    rows = base.reshape(6, 4)[2:4]  # a contiguous view inside the buffer
    tensor = ctx.wrap(rows)
    assert tensor.numpy().tolist() == rows.tolist()


def test_as_strided_view_larger_than_its_buffer_is_refused(ctx):
    base = np.zeros(1024, np.float32)  # 4 KiB
    view = as_strided(base, shape=(1024, 1024), strides=(4096, 4))  # 4 MiB over 4 KiB
    with pytest.raises(sg.ArgumentError, match=r"wrap: the array's shape \[1024, 1024\] .* reach bytes "
                                               r"\[0, 4194304\) of its buffer, which holds 4096 bytes"):
        ctx.wrap(view)


def test_as_strided_view_past_the_end_of_a_slice_base_is_refused(ctx):
    base = np.zeros(64, np.float32)
    tail = base[60:]  # 4 elements; its base owns 64
    view = as_strided(tail, shape=(8,), strides=(4,))  # runs 4 elements past the end of base
    with pytest.raises(sg.ArgumentError, match="which holds 256 bytes"):
        ctx.wrap(view)
    inside = as_strided(base[8:], shape=(8,), strides=(4,))  # past the slice but inside base: fits
    assert ctx.wrap(inside).shape == (8,)


def test_views_of_bytes_like_buffers_are_checked_against_them(ctx):
    buffer = bytearray(64)
    array = np.frombuffer(buffer, np.float32)
    assert ctx.wrap(array).shape == (16,)
    with pytest.raises(sg.ArgumentError, match="which holds 64 bytes"):
        ctx.wrap(as_strided(array, shape=(32,), strides=(4,)))
    ctypes_buffer = (ctypes.c_float * 8)()
    with pytest.raises(sg.ArgumentError, match="which holds 32 bytes"):
        ctx.wrap(as_strided(np.ctypeslib.as_array(ctypes_buffer), shape=(16,), strides=(4,)))
    with mmap.mmap(-1, 4096) as mapped:
        array = np.frombuffer(mapped, np.float32)
        with pytest.raises(sg.ArgumentError, match="which holds 4096 bytes"):
            ctx.wrap(as_strided(array, shape=(2048,), strides=(4,)))
        del array


class _Interface:
    """An object with only an __array_interface__: nothing tells its buffer's size."""

    def __init__(self, array, shape):
        self._array = array
        self.__array_interface__ = {"data": (array.ctypes.data, False), "typestr": "<f4", "shape": shape,
                                    "strides": None, "version": 3}


def test_an_interface_without_a_buffer_is_trusted_as_documented(ctx):
    array = np.zeros(8, np.float32)
    assert ctx.wrap(_Interface(array, (8,))).shape == (8,)
    assert "Trusted" in sg.Context.wrap.__doc__ and "as_strided" in sg.Context.wrap.__doc__


def test_a_malformed_interface_is_a_clear_error(ctx):
    array = np.zeros(8, np.float32)
    bad = _Interface(array, (8,))
    bad.__array_interface__["shape"] = (-8,)
    with pytest.raises(sg.ArgumentError, match=r"wrap: shape\[0\] must be in \[0, "):
        ctx.wrap(bad)
    bad.__array_interface__ = {"data": array.ctypes.data, "typestr": "<f4", "shape": (8,)}
    with pytest.raises(sg.StepGraphError, match="data is not a \\(pointer, read_only\\) pair"):
        ctx.wrap(bad)
    bad.__array_interface__ = ["not", "a", "dict"]
    with pytest.raises(TypeError, match="array interface is not a dict"):
        ctx.wrap(bad)
    with pytest.raises(TypeError, match="wrap: name must be a str"):
        ctx.wrap(array, name=3)


# --- the C API's byte count ------------------------------------------------------------------


def c_wrap(ctx, dims, address, dtype=0):
    values = (ctypes.c_int64 * len(dims))(*dims)
    handle = _capi.new_handle()
    _capi.call("sg_tensor_wrap", ctx.handle, b"w", dtype, len(dims), values, None, ctypes.c_void_p(address),
               ctypes.byref(handle))
    return handle


@pytest.mark.parametrize("dims, dtype, words", [
    ((2**32, 2**32), 0, "more elements than int64"),
    ((2**31, 2**31), 0, "more bytes than int64"),  # 2^62 elements, 2^64 bytes
    ((2**61, 8), 6, "more"),
])
def test_c_wrap_checks_the_byte_count_for_a_real_address(ctx, dims, dtype, words):
    real = np.zeros(4, np.float32)
    with pytest.raises(sg.StepGraphError, match=rf"sg_tensor_wrap 'w': .*{words}"):
        c_wrap(ctx, dims, real.ctypes.data, dtype)


def test_c_wrap_refuses_a_range_past_the_end_of_the_address_space(ctx):
    with pytest.raises(sg.StepGraphError, match="pass the end of the address space"):
        c_wrap(ctx, (2**40,), 2**64 - 4096)


def test_c_wrap_of_a_fitting_count_works(ctx):
    real = np.arange(4, dtype=np.float32)
    handle = c_wrap(ctx, (4,), real.ctypes.data)
    _capi.call("sg_tensor_destroy", handle)


# --- torch and cupy (GPU machine) ---------------------------------------------------------------


def _cuda_context():
    if sg.cuda_device_count()[0] == 0:
        pytest.skip("no CUDA device: " + sg.cuda_device_count()[1])
    return sg.Context("cuda")


def _shrunk_under_a_view(torch, device):
    """A view of 16 floats whose storage was shrunk to 4 (torch's own as_strided checks the
    storage, but a storage resized under a view escapes that)."""
    base = torch.zeros(16, device=device)
    view = base[:]
    base.untyped_storage().resize_(16)
    return view


def test_torch_view_past_its_storage_is_refused():
    torch = pytest.importorskip("torch", reason="torch is not installed here (the GPU machine has it)")
    with sg.Context("host") as ctx:
        with pytest.raises(sg.ArgumentError, match="which holds 16 bytes"):
            ctx.wrap(_shrunk_under_a_view(torch, "cpu"))
        base = torch.arange(16, dtype=torch.float32)
        assert ctx.wrap(base[4:12]).numpy().tolist() == list(range(4, 12))  # storage_offset 4, fits
    if torch.cuda.is_available() and sg.cuda_device_count()[0] > 0:
        with sg.Context("cuda") as ctx:
            with pytest.raises(sg.ArgumentError, match="which holds 16 bytes"):
                ctx.wrap(_shrunk_under_a_view(torch, "cuda"))


def test_cupy_view_past_its_allocation_is_refused():
    cupy = pytest.importorskip("cupy", reason="cupy is not installed here (the GPU machine has it)")
    ctx = _cuda_context()
    base = cupy.zeros(16, cupy.float32)
    view = cupy.lib.stride_tricks.as_strided(base, shape=(1 << 20,), strides=(4,))
    with pytest.raises(sg.ArgumentError, match="of its buffer, which holds"):
        ctx.wrap(view)
    assert ctx.wrap(base).shape == (16,)
