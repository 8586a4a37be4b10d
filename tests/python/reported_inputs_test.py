"""Inputs a new user tried that were silent, unclear or crashed, each now a clear error naming
the argument or correct behaviour: LrSchedule's integers, eps beyond float32 or as a string,
tensor_parallel of the wrong kind, FP8 on_non_finite="stop", Tensor.torch() on a torch without
float8 types, from_numpy of a 0-d array, a zero-token Linear, a step returning its input."""

import sys
import types

import numpy as np
import pytest

import stepgraph as sg
from host_models import ctx, tiny_model  # noqa: F401 (ctx is a fixture)


# --- LrSchedule ----------------------------------------------------------------------------


@pytest.mark.parametrize("value, error, words", [
    (2.9, TypeError, r"LrSchedule: warmup must be an integer .* got float 2.9"),
    (2**64 + 3, sg.ArgumentError,
     r"LrSchedule: warmup must be in \[0, 9223372036854775807\], got 18446744073709551619"),
    (True, TypeError, r"LrSchedule: warmup must be an integer .* got the bool True"),
    ("3", TypeError, r"LrSchedule: warmup must be an integer .* got str '3'"),
    (-1, sg.ArgumentError, r"LrSchedule: warmup must be in \[0, "),
])
def test_schedule_warmup_is_an_int64_step_count(value, error, words):
    with pytest.raises(error, match=words):
        sg.LrSchedule("cosine", warmup=value, total=100)


def test_schedule_total_past_int64_is_refused_not_wrapped():
    with pytest.raises(sg.ArgumentError, match=r"LrSchedule: total must be in \[0, 9223372036854775807\], "
                                               r"got 9223372036854775808"):
        sg.LrSchedule("cosine", total=2**63)
    with pytest.raises(TypeError, match="LrSchedule: total must be an integer"):
        sg.LrSchedule("linear", total=10.0)


def test_schedule_rates_and_kind(ctx):
    with pytest.raises(sg.ArgumentError, match=r"LrSchedule: base must be finite .* \(stored as float32: inf\)"):
        sg.LrSchedule(base=1e40)
    with pytest.raises(TypeError, match="LrSchedule: min_lr must be a real number"):
        sg.LrSchedule(min_lr="0.1")
    with pytest.raises(TypeError, match="LrSchedule: kind must be one of 'constant', 'cosine', 'linear'"):
        sg.LrSchedule(None)
    with pytest.raises(sg.ArgumentError, match="LrSchedule: kind must be one of .* got 'step'"):
        sg.LrSchedule("step")


def test_schedule_changed_after_it_was_made_is_checked_by_adamw(ctx):
    schedule = sg.LrSchedule("cosine", warmup=2, total=10)
    schedule.warmup = 2.9
    model = tiny_model(ctx)
    with pytest.raises(TypeError, match="AdamW: schedule: warmup must be an integer"):
        sg.AdamW(ctx, model, schedule=schedule)
    schedule.warmup = 2
    sg.AdamW(ctx, model, schedule=schedule)


# --- eps --------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [
    lambda ctx, eps: tiny_model(ctx, eps=eps),
    lambda ctx, eps: sg.LayerNorm(ctx, 8, eps=eps, dtype="float32"),
    lambda ctx, eps: sg.RMSNorm(ctx, 8, eps=eps, dtype="float32"),
    lambda ctx, eps: sg.LayerNormLinear(ctx, 8, 8, eps=eps, dtype="float32"),
    lambda ctx, eps: sg.LayerNormMLP(ctx, 8, 16, eps=eps, dtype="float32"),
])
def test_eps_that_overflows_float32_or_is_not_a_number_is_refused(ctx, make):
    with pytest.raises(sg.ArgumentError, match=r"eps must be finite and >= 0.0, got 1e\+40 \(stored as float32: inf\)"):
        make(ctx, 1e40)
    with pytest.raises(TypeError, match=r"eps must be a real number >= 0.0, got str '1e-5'"):
        make(ctx, "1e-5")
    with pytest.raises(sg.ArgumentError, match="eps must be finite"):
        make(ctx, float("nan"))
    with pytest.raises(sg.ArgumentError, match="eps must be finite and >= 0.0, got -1"):
        make(ctx, -1e-5)
    make(ctx, 1e-6)


# --- tensor_parallel and overlap --------------------------------------------------------------


@pytest.mark.parametrize("value", [3, "world", object()])
def test_tensor_parallel_must_be_a_world(ctx, value):
    with pytest.raises(TypeError, match="ResidualStack: tensor_parallel must be a stepgraph World"):
        tiny_model(ctx, tensor_parallel=value)


def test_overlap_without_tensor_parallel_is_refused_not_ignored(ctx):
    with pytest.raises(sg.ArgumentError, match="ResidualStack: overlap='none' applies to a tensor-parallel stack only"):
        tiny_model(ctx, overlap="none")


def test_tensor_parallel_world_of_one_and_a_bad_overlap(ctx):
    world = sg.init_distributed("host")
    assert tiny_model(ctx, tensor_parallel=world).kind == "residual_stack"
    with pytest.raises(TypeError, match="ResidualStack: overlap must be a str"):
        tiny_model(ctx, tensor_parallel=world, overlap=2)
    world.close()
    with pytest.raises(sg.StepGraphError, match="this World is closed"):
        tiny_model(ctx, tensor_parallel=world)


# --- FP8 on_non_finite ----------------------------------------------------------------------


def nan_input(ctx, tokens=16, features=16):
    x = np.full((tokens, features), 0.5, np.float32)
    x[0, 3] = np.nan
    return ctx.from_numpy(x)


@pytest.mark.parametrize("make", [
    lambda ctx, recipe: sg.Linear(ctx, 16, 16, dtype="float32", fp8=recipe),
    lambda ctx, recipe: sg.LayerNormLinear(ctx, 16, 16, dtype="float32", fp8=recipe),
    lambda ctx, recipe: sg.LayerNormMLP(ctx, 16, 32, dtype="float32", fp8=recipe),
])
def test_fp8_stop_stops_at_the_eager_forward_that_met_a_nan(ctx, make):
    layer = make(ctx, sg.Fp8Recipe.current(on_non_finite="stop"))
    with pytest.raises(sg.StepGraphError, match="met a non-finite amax.*on_non_finite is stop"):
        layer.forward(nan_input(ctx))
    with pytest.raises(sg.StepGraphError, match="on_non_finite is stop"):
        layer.check_errors()


def test_fp8_skip_step_goes_on(ctx):
    layer = sg.Linear(ctx, 16, 16, dtype="float32", fp8=sg.Fp8Recipe.current())
    y, saved = layer.forward(nan_input(ctx))
    layer.backward(saved, ctx.from_numpy(np.ones((16, 16), np.float32)))
    layer.check_errors()  # skip_step: counted, not an error


def test_fp8_stop_in_a_captured_step_is_reported_by_check_errors_after_replay(ctx):
    layer = sg.Linear(ctx, 16, 16, dtype="float32", fp8=sg.Fp8Recipe.current(on_non_finite="stop"))
    x = ctx.tensor((16, 16))
    graph = sg.capture(ctx, lambda: [layer(x)], policy="error")  # tracing: no check inside
    graph.replay()
    layer.check_errors()
    graph.replay({x: nan_input(ctx)})
    with pytest.raises(sg.StepGraphError, match="on_non_finite is stop"):
        layer.check_errors()


def test_check_errors_inside_a_capture_is_an_error(ctx):
    layer = sg.Linear(ctx, 16, 16, dtype="float32")
    x = ctx.tensor((16, 16))

    def step():
        y = layer(x)
        layer.check_errors()
        return [y]

    with pytest.raises(sg.StepGraphError, match="sg_layer_check_errors: called while a step is being captured"):
        sg.capture(ctx, step)


def test_fp8_recipe_fields_are_checked_when_the_recipe_is_made():
    with pytest.raises(sg.ArgumentError, match=r"Fp8Recipe: fp8.on_non_finite must be one of 'skip_step', 'stop'"):
        sg.Fp8Recipe.current(on_non_finite="halt")
    with pytest.raises(TypeError, match="Fp8Recipe: fp8.margin must be an integer"):
        sg.Fp8Recipe.delayed(margin=1.5)
    with pytest.raises(TypeError, match="Fp8Recipe: fp8.power_of_two_scales must be an integer .* got str"):
        sg.Fp8Recipe.block(power_of_two_scales="yes")


# --- Tensor.torch() on an old torch ------------------------------------------------------------


class _OldTorch(types.ModuleType):
    """Just enough of torch 2.0 for Tensor.torch() on the host: from_numpy and a dtype table
    without float8 types."""

    __version__ = "2.0.1"
    bfloat16 = "bf16-view"

    class _Raw:
        def __init__(self, array):
            self.array = array

        def view(self, dtype):
            return ("viewed", dtype, self.array)

    def from_numpy(self, array):
        return self._Raw(array)


@pytest.fixture
def old_torch(monkeypatch):
    module = _OldTorch("torch")
    monkeypatch.setitem(sys.modules, "torch", module)
    return module


def test_torch_without_float8_still_converts_other_dtypes(ctx, old_torch):
    raw = ctx.from_numpy(np.arange(4, dtype=np.float32)).torch()
    assert isinstance(raw, _OldTorch._Raw) and list(raw.array) == [0, 1, 2, 3]
    assert ctx.tensor((2,), "bf16").torch()[:2] == ("viewed", "bf16-view")
    with pytest.raises(sg.StepGraphError, match=r"torch 2.0.1 has no torch.float8_e4m3fn .* torch 2.1"):
        ctx.tensor((2,), "fp8_e4m3").torch()


# --- from_numpy of a 0-d array -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bf16", "fp16", "int32", "int64"])
def test_from_numpy_of_a_0d_array(ctx, dtype):
    value = np.array(3, np.int32) if dtype.startswith("int") else np.array(2.5, np.float32)
    tensor = ctx.from_numpy(value, dtype=dtype)
    assert tensor.shape == () and tensor.numel == 1
    assert tensor.item() == float(value)


def test_copy_from_a_0d_array_and_a_numpy_scalar(ctx):
    tensor = ctx.tensor(())
    tensor.copy_from(np.float32(4.0))
    assert tensor.item() == 4.0


# --- zero tokens ---------------------------------------------------------------------------------


def test_zero_token_linear_forward_names_the_layer(ctx):
    layer = sg.Linear(ctx, 8, 4, dtype="float32", name="proj")
    with pytest.raises(sg.StepGraphError, match=r"Linear 'proj' forward: the input has 0 tokens") as error:
        layer.forward(ctx.tensor((0, 8)))
    assert "gemm" not in error.value.message


# --- a step returning a persistent tensor unchanged ------------------------------------------------


def test_capture_of_a_step_returning_its_input_unchanged(ctx):
    x = ctx.from_numpy(np.array([1.0, 2.0, 3.0], np.float32))
    graph = sg.capture(ctx, lambda: x, policy="error")
    graph.replay()
    assert graph.outputs[0].numpy().tolist() == [1.0, 2.0, 3.0]
    x.copy_from(np.array([4.0, 5.0, 6.0], np.float32))
    graph.replay()
    assert graph.outputs[0].numpy().tolist() == [4.0, 5.0, 6.0]


def test_capture_of_a_step_returning_an_unread_parameter_beside_its_output(ctx):
    layer = sg.Linear(ctx, 4, 4, dtype="float32", bias=False)
    w = ctx.from_numpy(np.arange(4, dtype=np.float32))  # read by no op of the step
    x = ctx.from_numpy(np.ones((2, 4), np.float32))
    graph = sg.capture(ctx, lambda: [layer(x), w], policy="error")
    graph.replay()
    y, w_out = graph.outputs
    assert y.shape == (2, 4)
    assert w_out.numpy().tolist() == [0.0, 1.0, 2.0, 3.0]


# --- array values past the tensor's range ------------------------------------------------------


@pytest.mark.parametrize("dtype, value", [("float32", 1e39), ("bf16", 3.4e38), ("fp16", 70000.0), ("fp16", 10**6)])
def test_finite_values_that_would_become_infinities_are_refused(ctx, dtype, value):
    array = np.array([1.0, value, 2.0], np.float64) if isinstance(value, float) else np.array([1, value, 2])
    with pytest.raises(sg.ArgumentError, match=r"from_numpy: array: .* at index 1 overflows"):
        ctx.from_numpy(array, dtype=dtype)
    # Infinities and NaN in the data are values, not overflows: they go through.
    values = ctx.from_numpy(np.array([1.0, np.inf, np.nan]), dtype=dtype).to_float32()
    assert values[0] == 1.0 and np.isinf(values[1]) and np.isnan(values[2])


def test_bits_helpers_refuse_values_outside_their_types():
    with pytest.raises(sg.ArgumentError, match=r"bf16_bits_to_float32: bits must hold values in \[0, 65535\], got -1"):
        sg.bf16_bits_to_float32(np.array([-1, 16256]))
    with pytest.raises(TypeError, match="bits must be an integer array"):
        sg.bf16_bits_to_float32(np.array([1.5]))
    with pytest.raises(sg.ArgumentError, match="float32_to_bf16_bits: values: .* overflows float32"):
        sg.float32_to_bf16_bits(np.array([1e39]))
    assert sg.float32_to_bf16_bits(np.float32(1.0)).shape == ()
