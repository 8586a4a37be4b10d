"""The binding checks every integer, float and array argument before it reaches ctypes
(python/stepgraph/_checks.py): ctypes would wrap 2**64 + 32 into 32 and NumPy would wrap or
truncate labels. Each case asserts the error type and words, and that the valid neighbour works."""

import numpy as np
import pytest

import stepgraph as sg
from host_models import ctx, tiny_model  # noqa: F401 (ctx is a fixture)
from stepgraph import _checks

HUGE = 2**64 + 32  # ctypes would pass 32


# --- integers -------------------------------------------------------------------------


def test_argument_error_is_a_stepgraph_error_and_a_value_error():
    with pytest.raises(sg.ArgumentError) as error:
        _checks.check_int("n", -1, 0, 10)
    assert isinstance(error.value, sg.StepGraphError) and isinstance(error.value, ValueError)
    assert error.value.code_name == "invalid_argument"
    assert _checks.check_int("n", np.int64(10), 0, 10) == 10  # numpy integers are integers


@pytest.mark.parametrize("field", ["hidden", "ffn", "vocab"])
def test_model_sizes_out_of_int64_are_refused_not_wrapped(ctx, field):
    with pytest.raises(sg.ArgumentError, match=rf"ResidualStack: {field} must be in \[1, 9223372036854775807\], "
                                               rf"got {HUGE}"):
        tiny_model(ctx, **{field: HUGE})
    with pytest.raises(sg.ArgumentError, match=rf"{field} must be in \[1, .*got 0"):
        tiny_model(ctx, **{field: 0})
    assert tiny_model(ctx, **{field: 32}).config[field] == 32


def test_model_counts_seed_and_experts_are_range_checked(ctx):
    with pytest.raises(sg.ArgumentError, match=r"layers must be in \[0, 9223372036854775807\], got -1"):
        tiny_model(ctx, layers=-1)
    with pytest.raises(sg.ArgumentError, match=r"seed must be in \[0, 4294967295\], got 4294967296"):
        tiny_model(ctx, seed=2**32)
    with pytest.raises(sg.ArgumentError, match=r"experts must be in \[0, .*got -2"):
        tiny_model(ctx, experts=-2)
    with pytest.raises(sg.ArgumentError, match=r"topk must be in \[-9223372036854775808, 9223372036854775807\]"):
        tiny_model(ctx, experts=2, topk=HUGE + 1)  # would wrap to 33
    assert tiny_model(ctx, layers=0, seed=2**32 - 1).config["seed"] == 2**32 - 1


def test_floats_and_bools_are_not_integers(ctx):
    with pytest.raises(TypeError, match=r"ResidualStack: hidden must be an integer .*got float 64.0 \(use 64\)"):
        tiny_model(ctx, hidden=64.0)
    with pytest.raises(TypeError, match="hidden must be an integer .*got the bool True"):
        tiny_model(ctx, hidden=True)
    with pytest.raises(TypeError, match="tokens must be an integer .*got str '4'"):
        sg.TrainStep(tiny_model(ctx), sg.AdamW(ctx, tiny_model(ctx)), tokens="4")
    assert tiny_model(ctx, hidden=np.int32(64)).config["hidden"] == 64


def test_layer_sizes_seeds_and_flags(ctx):
    with pytest.raises(sg.ArgumentError, match=r"Linear: in_features must be in \[1, .*got 0"):
        sg.Linear(ctx, 0, 4, dtype="float32")
    with pytest.raises(sg.ArgumentError, match=rf"Linear: out_features must be in \[1, .*got {HUGE}"):
        sg.Linear(ctx, 4, HUGE, dtype="float32")
    with pytest.raises(sg.ArgumentError, match=r"Linear: seed must be in \[0, 4294967295\], got -1"):
        sg.Linear(ctx, 4, 4, dtype="float32", seed=-1)
    with pytest.raises(TypeError, match=r"Linear: bias must be an integer in \[0, 1\], got str 'no'"):
        sg.Linear(ctx, 4, 4, dtype="float32", bias="no")
    with pytest.raises(sg.ArgumentError, match=r"LayerNormLinear: dgrad must be in \[0, 1\], got 2"):
        sg.LayerNormLinear(ctx, 4, 4, dtype="float32", dgrad=2)
    with pytest.raises(sg.ArgumentError, match=r"Norm: hidden must be in \[1, .*got -8"):
        sg.LayerNorm(ctx, -8, dtype="float32")
    with pytest.raises(TypeError, match=r"LayerNormMLP: ffn must be an integer .*got float 16.5"):
        sg.LayerNormMLP(ctx, 8, 16.5, dtype="float32")
    assert sg.Linear(ctx, 4, 4, dtype="float32", bias=0, seed=2**32 - 1)(ctx.tensor((2, 4))).shape == (2, 4)
    assert sg.LayerNormMLP(ctx, 8, 16, dtype="float32").kind == "layernorm_mlp"


def test_context_streams_and_cache(ctx):
    with pytest.raises(sg.ArgumentError, match=r"Context: side_streams must be in \[0, 2147483647\], got 4294967297"):
        sg.Context("host", side_streams=2**32 + 1)  # would wrap to 1
    with pytest.raises(sg.ArgumentError, match=r"stream: index must be in \[0, 2147483647\], got 4294967296"):
        with ctx.stream(2**32):  # would wrap to 0
            pass
    with pytest.raises(TypeError, match="cuda_stream: index must be an integer"):
        ctx.cuda_stream(0.0)
    with pytest.raises(sg.ArgumentError, match=r"GraphCache: max_pool_bytes must be in \[1, .*got 0"):
        sg.GraphCache(0)
    with ctx.stream(1):
        pass
    assert sg.GraphCache(1 << 20).stats["entries"] == 0


def test_tensor_shapes(ctx):
    with pytest.raises(sg.ArgumentError,
                       match=rf"tensor: shape\[0\] must be in \[0, 9223372036854775807\], got {HUGE}"):
        ctx.tensor((HUGE, 2))
    with pytest.raises(sg.ArgumentError, match=r"shape\[1\] must be in \[0, .*got -3"):
        ctx.tensor((2, -3))
    with pytest.raises(TypeError, match=r"tensor: shape\[0\] must be an integer .*got float 2.0"):
        ctx.tensor((2.0, 3))
    with pytest.raises(TypeError, match=r"shape must be a sequence of dimensions such as \(4, 8\), got int 5"):
        ctx.tensor(5)
    assert ctx.tensor([np.int64(2), 3]).shape == (2, 3)


def test_train_step_tokens(ctx):
    model = tiny_model(ctx)
    with pytest.raises(sg.ArgumentError, match=rf"TrainStep: tokens must be in \[1, 9223372036854775807\], got {HUGE}"):
        sg.TrainStep(model, sg.AdamW(ctx, model), tokens=HUGE)
    with pytest.raises(TypeError, match="TrainStep: optimizer must be a stepgraph AdamW, got NoneType None"):
        sg.TrainStep(model, None, tokens=4)
    assert sg.TrainStep(model, sg.AdamW(ctx, model), tokens=4).x.shape == (4, 8)


# --- labels, shapes and dtypes of arrays ---------------------------------------------------


@pytest.fixture
def step(ctx):
    model = tiny_model(ctx)
    return sg.TrainStep(model, sg.AdamW(ctx, model), tokens=4)


X = np.arange(32, dtype=np.float32).reshape(4, 8) / 32


def test_labels_over_int32_or_outside_vocab_are_refused(step):
    with pytest.raises(sg.ArgumentError, match=r"TrainStep.load: labels must hold values in \[0, 15\] or -100, "
                                               r"got 2147483649 at index 3 .*vocab = 16"):
        step.load(X, np.array([1, 2, 3, 2**31 + 1], np.int64))  # would wrap to -2147483647
    with pytest.raises(sg.ArgumentError, match=r"got 16 at index 0"):
        step.load(X, [16, 0, 0, 0])
    with pytest.raises(sg.ArgumentError, match=r"got -1 at index 2"):
        step.load(X, [0, 0, -1, 0])
    with pytest.raises(sg.ArgumentError, match=r"got 9223372036854775808 at index 1"):
        step.load(X, np.array([0, 2**63, 0, 0], np.uint64))
    step.load(X, np.array([15, 0, -100, 3], np.int64))  # -100: the ignore index
    np.testing.assert_array_equal(step.labels.numpy(), [15, 0, -100, 3])
    step.load(X, np.array([1, 2, 3, 4], np.uint8))
    assert np.isfinite(step().item())


def test_float_labels_are_refused(step):
    with pytest.raises(TypeError, match="TrainStep.load: labels must be an integer array .*got float64"):
        step.load(X, [1.0, 2.0, 3.0, 4.5])
    with pytest.raises(TypeError, match="labels must be an integer array .*got bool"):
        step.load(X, np.array([True, False, True, False]))


def test_load_refuses_a_transposed_batch_and_a_wrong_label_shape(step):
    with pytest.raises(sg.ArgumentError, match=r"TrainStep.load: x must have shape \[4, 8\] \(fp32\), got an array "
                                               r"of shape \[8, 4\] float32"):
        step.load(X.T.copy(), [0, 1, 2, 3])  # the same element count, rows scrambled
    with pytest.raises(sg.ArgumentError,
                       match=r"labels must have shape \[4\] \(int32\), got an array of shape \[4, 1\]"):
        step.load(X, [[0], [1], [2], [3]])
    before = step.x.numpy().copy()
    with pytest.raises(sg.ArgumentError, match="labels"):
        step.load(X, [0, 1, 2, 99])
    np.testing.assert_array_equal(step.x.numpy(), before)  # nothing copied when the labels are refused
    step.load(X.astype(np.float64), [0, 1, 2, 3])  # float64 rounds to the model dtype
    np.testing.assert_array_equal(step.x.numpy(), X)


def test_copy_from_needs_the_exact_shape(ctx):
    t = ctx.tensor((2, 3))
    with pytest.raises(sg.ArgumentError, match=r"copy_from: array must have shape \[2, 3\] \(fp32\), got an array of "
                                               r"shape \[3, 2\] float64"):
        t.copy_from(np.ones((3, 2)))
    with pytest.raises(sg.ArgumentError, match=r"shape \[2, 3\] \(fp32\), got an array of shape \[6\]"):
        t.copy_from(np.ones(6, np.float32))
    t.copy_from(np.arange(6).reshape(2, 3))  # integers into a float tensor: converted
    np.testing.assert_array_equal(t.numpy(), np.arange(6).reshape(2, 3))
    v = ctx.tensor((3,))
    v.copy_from([1.0, 2.0, 3.0])  # a 1-D array for a [n] tensor
    np.testing.assert_array_equal(v.numpy(), [1, 2, 3])


def test_copy_from_dtype_rules(ctx):
    ints = ctx.tensor((3,), "int32")
    with pytest.raises(TypeError, match=r"copy_from: array must be an integer array for a int32 tensor, got float64 "
                                        r"\(floats would be truncated"):
        ints.copy_from([1.5, 2.0, 3.0])
    with pytest.raises(sg.ArgumentError, match=r"must hold values in \[-2147483648, 2147483647\], got 1099511627776 "
                                               r"at index 2"):
        ints.copy_from(np.array([1, 2, 2**40]))
    with pytest.raises(TypeError, match="must be a real .*got complex128"):
        ctx.tensor((2,)).copy_from(np.ones(2, complex))
    with pytest.raises(TypeError, match="fp8 tensors take their raw bits .*got float64"):
        ctx.tensor((2,), "fp8_e4m3").copy_from(np.ones(2))
    with pytest.raises(sg.ArgumentError, match="from_numpy: array must hold values in"):
        ctx.from_numpy(np.array([2**40]), "int32")
    ints.copy_from(np.array([1, 2, 2**31 - 1], np.int64))
    np.testing.assert_array_equal(ints.numpy(), [1, 2, 2**31 - 1])
    bf16 = ctx.tensor((2,), "bf16")
    bf16.copy_from([1.0, -2.0])  # floats round to bf16 bits
    np.testing.assert_array_equal(bf16.to_float32(), [1.0, -2.0])
    ctx.tensor((2,), "fp8_e4m3").copy_from(np.zeros(2, np.uint8))


# --- zero-size tensors ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bf16", "int32", "fp8_e5m2"])
def test_zero_size_tensors_read_as_empty_arrays(ctx, dtype):
    t = ctx.tensor((0, 4), dtype)
    assert t.numel == 0
    assert t.numpy().shape == (0, 4) and t.numpy().dtype == sg.dtypes.numpy_storage(dtype)
    assert t.to_float32().shape == (0, 4) and t.to_float32().dtype == np.float32
    t.copy_from(np.zeros((0, 4), sg.dtypes.numpy_storage(dtype)))
    with pytest.raises(sg.ArgumentError, match=r"must have shape \[0, 4\]"):
        t.copy_from(np.zeros((4, 0), sg.dtypes.numpy_storage(dtype)))


def test_zero_size_tensor_to_torch():
    torch = pytest.importorskip("torch")
    with sg.Context("host") as context:
        t = context.tensor((0, 3), "bf16")
        assert t.torch().shape == (0, 3) and t.torch().dtype == torch.bfloat16


# --- AdamW ---------------------------------------------------------------------------------


@pytest.mark.parametrize("settings, words", [
    (dict(lr=-1e-3), r"AdamW: lr must be finite and >= 0.0, got -0.001"),
    (dict(lr=float("nan")), r"lr must be finite and >= 0.0, got nan"),
    (dict(lr=1e39), r"lr must be finite .*got 1e\+39 \(stored as float32: inf\)"),
    (dict(betas=(1.0, 0.999)), r"beta1 must be finite and in \[0.0, 1.0\), got 1.0"),
    (dict(betas=(-0.1, 0.999)), r"beta1 must be finite and in \[0.0, 1.0\), got -0.1"),
    (dict(betas=(0.9, 1.5)), r"beta2 must be finite and in \[0.0, 1.0\), got 1.5"),
    (dict(betas=(0.9, 0.99999999)), r"beta2 .*got 0.99999999 \(stored as float32: 1.0\)"),
    (dict(eps=-1e-8), r"eps must be finite and >= 0.0"),
    (dict(eps=float("nan")), r"eps must be finite and >= 0.0, got nan"),
    (dict(weight_decay=-0.01), r"weight_decay must be finite and >= 0.0, got -0.01"),
    (dict(weight_decay=float("nan")), r"weight_decay must be finite and >= 0.0, got nan"),
])
def test_bad_adamw_settings_are_refused_at_construction(ctx, settings, words):
    model = tiny_model(ctx)
    with pytest.raises(sg.ArgumentError, match=words):
        sg.AdamW(ctx, model, **settings)


def test_adamw_types_and_edge_values(ctx):
    model = tiny_model(ctx)
    with pytest.raises(TypeError, match="AdamW: lr must be a real number >= 0.0, got str"):
        sg.AdamW(ctx, model, lr="0.1")
    with pytest.raises(TypeError, match=r"AdamW: betas must hold exactly 2 items, got 1: \(0.9,\)"):
        sg.AdamW(ctx, model, betas=(0.9,))
    with pytest.raises(TypeError, match=r"AdamW: layers\[1\] must be a stepgraph layer .*got int 3"):
        sg.AdamW(ctx, [model, 3])
    optimizer = sg.AdamW(ctx, model, lr=0.0, betas=(0.0, 0.9999), eps=0.0, weight_decay=0.0)
    optimizer.step()
    assert optimizer.steps_taken == 1
