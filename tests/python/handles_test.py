"""Misused C API handles through the raw ctypes calls (python/stepgraph/_capi.py):
each is an error code and a message naming the call, and the process lives on."""

import ctypes
import random

import pytest

from stepgraph import _capi

INVALID_ARGUMENT = 1
SG_DEVICE_HOST = 1
SG_DTYPE_FLOAT32 = 0


def raw(name, *args):
    """Calls sg_<name> without the wrapper: the result code and the last error."""
    result = getattr(_capi.lib(), name)(*args)
    return result, _capi.lib().sg_last_error().decode()


def handle(value):
    return ctypes.c_void_p(value)


@pytest.fixture
def ctx():
    context = _capi.new_handle()
    _capi.call("sg_context_create", SG_DEVICE_HOST, 0, ctypes.byref(context))
    yield context
    raw("sg_context_destroy", context)  # the tests may have destroyed it already


def new_tensor(ctx, *dims):
    tensor = _capi.new_handle()
    shape = (ctypes.c_int64 * len(dims))(*dims)
    _capi.call("sg_tensor_create", ctx, b"t", SG_DTYPE_FLOAT32, len(dims), shape, ctypes.byref(tensor))
    return tensor


def expect_error(outcome, function, problem):
    result, message = outcome
    assert result == INVALID_ARGUMENT, message
    assert f"{function}: " in message and problem in message, message


def test_double_destroy_is_an_error(ctx):
    tensor = new_tensor(ctx, 2, 3)
    assert raw("sg_tensor_destroy", tensor)[0] == 0
    expect_error(raw("sg_tensor_destroy", tensor), "sg_tensor_destroy", "was already destroyed")
    assert raw("sg_context_destroy", ctx)[0] == 0
    expect_error(raw("sg_context_destroy", ctx), "sg_context_destroy", "context handle")


def test_use_after_destroy_is_an_error(ctx):
    tensor = new_tensor(ctx, 2, 3)
    _capi.call("sg_tensor_destroy", tensor)
    rank = ctypes.c_int()
    expect_error(raw("sg_tensor_rank", tensor, ctypes.byref(rank)), "sg_tensor_rank", "(tensor) was destroyed")
    with pytest.raises(_capi.StepGraphError, match="sg_tensor_rank: tensor handle 0x[0-9a-f]+ .* was destroyed"):
        _capi.call("sg_tensor_rank", tensor, ctypes.byref(rank))


def test_wrong_type_handle_is_an_error(ctx):
    tensor = new_tensor(ctx, 2, 3)
    expect_error(raw("sg_graph_replay", tensor, None, None, 0), "sg_graph_replay",
                 "is a tensor handle, not a graph handle")
    expect_error(raw("sg_layer_destroy", ctx), "sg_layer_destroy", "is a context handle, not a layer handle")
    _capi.call("sg_tensor_destroy", tensor)


def test_garbage_handles_are_not_handles_the_library_issued(ctx):
    rank = ctypes.c_int()
    expect_error(raw("sg_tensor_rank", handle(0xDEADBEEF), ctypes.byref(rank)), "sg_tensor_rank",
                 "0x00000000deadbeef is not a handle this library issued")
    generator = random.Random(12)
    for _ in range(200):
        garbage = handle(generator.getrandbits(64))
        expect_error(raw("sg_graph_replay", garbage, None, None, 0), "sg_graph_replay",
                     "is not a handle this library issued")
        expect_error(raw("sg_graph_destroy", garbage), "sg_graph_destroy", "is not a handle this library issued")


def test_a_tensor_keeps_its_context_alive(ctx):
    tensor = new_tensor(ctx, 4)
    _capi.call("sg_context_destroy", ctx)
    values = (ctypes.c_float * 4)(1, 2, 3, 4)
    back = (ctypes.c_float * 4)()
    _capi.call("sg_tensor_copy_from_host", tensor, values, 16)
    _capi.call("sg_tensor_copy_to_host", tensor, back, 16)
    assert list(back) == [1, 2, 3, 4]
    _capi.call("sg_tensor_destroy", tensor)
