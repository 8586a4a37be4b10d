"""Errors from the engine surface as StepGraphError with the C++ message and code;
bad input caught by the binding says what to do."""

import numpy as np
import pytest

import stepgraph as sg
from stepgraph import _capi


@pytest.fixture
def ctx():
    with sg.Context("host") as context:
        yield context


def test_shape_mismatch_carries_the_engine_message_code_and_place(ctx):
    layer = sg.Linear(ctx, 8, 4, dtype="float32", name="fc")
    with pytest.raises(sg.StepGraphError) as error:
        layer.forward(ctx.from_numpy(np.ones((3, 7), np.float32)))
    assert error.value.code == 1 and error.value.code_name == "invalid_argument"
    assert "Linear 'fc' forward: input must be [tokens, 8] fp32, got [3, 7] fp32" in error.value.message
    assert "layers/layer_checks.cc" in str(error.value)  # the place the C++ code raised it
    assert _capi.lib().sg_last_error().decode() == error.value.message


def test_non_contiguous_wrap_is_refused_with_the_fix(ctx):
    x = np.ones((4, 6), np.float32).T  # a transposed view
    with pytest.raises(sg.StepGraphError, match="not contiguous row-major.*np.ascontiguousarray"):
        ctx.wrap(x)
    assert ctx.wrap(np.ascontiguousarray(x)).shape == (6, 4)


def test_sliced_rows_wrap_is_refused_but_single_rows_are_fine(ctx):
    x = np.ones((8, 6), np.float32)
    with pytest.raises(sg.StepGraphError, match="not contiguous"):
        ctx.wrap(x[::2])
    assert ctx.wrap(x[2:3]).shape == (1, 6)


def test_read_only_array_is_refused(ctx):
    x = np.ones((2, 2), np.float32)
    x.setflags(write=False)
    with pytest.raises(sg.StepGraphError, match="read-only"):
        ctx.wrap(x)


def test_unsupported_dtype_array_is_refused(ctx):
    with pytest.raises(TypeError, match="no StepGraph dtype"):
        ctx.wrap(np.ones(3, np.float64))


def test_moe_fields_reach_the_engine(ctx):
    """experts/topk/moe_every pass through the C config: MoE blocks hold more parameters
    than dense ones, and a bad combination is refused when the model is built."""
    dense = sg.ResidualStack(ctx, hidden=32, ffn=64, layers=2, vocab=16, dtype="float32")
    moe = sg.ResidualStack(ctx, hidden=32, ffn=64, layers=2, vocab=16, dtype="float32", experts=4, topk=2, moe_every=2)
    with pytest.raises(sg.StepGraphError, match="topk"):
        sg.ResidualStack(ctx, hidden=32, ffn=64, layers=2, vocab=16, dtype="float32", experts=4, topk=3, moe_every=2)
    assert moe.config["experts"] == 4 and moe.config["topk"] == 2 and moe.config["moe_every"] == 2
    assert sum(p.master.numel for p in moe.parameters()) > sum(p.master.numel for p in dense.parameters())


def test_saved_state_of_another_layer_is_refused(ctx):
    a = sg.Linear(ctx, 4, 4, dtype="float32", name="a")
    b = sg.Linear(ctx, 4, 4, dtype="float32", name="b")
    x = ctx.tensor((2, 4))
    _, saved = a.forward(x)
    with pytest.raises(sg.StepGraphError, match="saved state comes from the forward of another linear"):
        b.backward(saved, ctx.tensor((2, 4)))


def test_copy_of_the_wrong_size_is_refused(ctx):
    t = ctx.tensor((2, 3))
    with pytest.raises(sg.StepGraphError, match=r"must have shape \[2, 3\] \(fp32\), got an array of shape \[4\]"):
        t.copy_from(np.ones(4, np.float32))


def test_reading_a_traced_value_is_an_invalid_state_error(ctx):
    layer = sg.Linear(ctx, 4, 4, dtype="float32")
    x = ctx.tensor((2, 4))
    seen = {}

    def step():
        y = layer(x)
        try:
            y.numpy()
        except sg.StepGraphError as error:
            seen["error"] = error
        return y

    sg.capture(ctx, step)
    assert seen["error"].code_name == "invalid_state"
    assert "traced value" in seen["error"].message


def test_step_function_returning_a_non_tensor_is_a_type_error(ctx):
    with pytest.raises(TypeError, match="returns stepgraph Tensors"):
        sg.capture(ctx, lambda: [np.ones(2)])


def test_closed_context_says_so():
    context = sg.Context("host")
    context.close()
    with pytest.raises(sg.StepGraphError, match="closed"):
        context.tensor((2,))


def test_objects_outlive_a_closed_context_handle():
    with sg.Context("host") as context:
        layer = sg.Linear(context, 4, 4, dtype="float32")
        x = context.tensor((2, 4))
    assert layer(x).shape == (2, 4)  # the layer keeps the engine's context alive


def test_bad_names_are_rejected_by_the_binding(ctx):
    with pytest.raises(ValueError, match="unknown dtype"):
        ctx.tensor((2,), "float64")
    with pytest.raises(sg.StepGraphError, match="device must be"):
        sg.Context("tpu")
    with pytest.raises(sg.StepGraphError, match="policy"):
        sg.capture(ctx, lambda: [], policy="sometimes")


def test_cuda_context_without_a_device_is_an_error():
    count, reason = sg.cuda_device_count()
    if count > 0:
        pytest.skip("this machine has a CUDA device")
    assert reason.startswith("no CUDA device")
    with pytest.raises(sg.StepGraphError, match=r"no CUDA device.*create the context on the host") as error:
        sg.Context("cuda")
    assert error.value.code_name == "no_device"
