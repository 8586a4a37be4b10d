"""FP8 recipes from Python on the host: recipes as values (equal, hashable,
the engine's defaults), FP8 layers within FP8's error of their bf16 twins of
the same seed, and bad recipes as clear errors."""

import numpy as np
import pytest

import stepgraph as sg

TOKENS, HIDDEN, OUT = 32, 64, 48


@pytest.fixture
def ctx():
    with sg.Context("host") as context:
        yield context


def test_recipes_are_values_with_the_engines_defaults():
    assert sg.Fp8Recipe.delayed() == sg.Fp8Recipe.delayed()
    assert hash(sg.Fp8Recipe.delayed(margin=1)) == hash(sg.Fp8Recipe.delayed(margin=1))
    assert sg.Fp8Recipe.delayed() != sg.Fp8Recipe.current()
    assert sg.Fp8Recipe.delayed(amax_history_len=16) != sg.Fp8Recipe.delayed()
    delayed = sg.Fp8Recipe.delayed()
    assert (delayed.amax_history_len, delayed.amax_reduction, delayed.formats) == (1024, "max", "hybrid")
    block = sg.Fp8Recipe.block()
    assert (block.formats, block.fast_accumulation_forward, block.power_of_two_scales) == ("e4m3", False, True)


def relative(got, want):
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def run_linear(ctx, rng_seed, fp8):
    rng = np.random.default_rng(rng_seed)
    layer = sg.Linear(ctx, HIDDEN, OUT, dtype="float32", name="fc", seed=3, fp8=fp8)
    x = ctx.wrap(rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32), name="x")
    dy = ctx.wrap((0.01 * rng.standard_normal((TOKENS, OUT))).astype(np.float32), name="dy")
    y, saved = layer.forward(x)
    dx = layer.backward(saved, dy)
    return y.numpy(), dx.numpy(), layer.parameters()[0].grad.numpy()


@pytest.mark.parametrize("recipe", [sg.Fp8Recipe.current(), sg.Fp8Recipe.delayed(amax_history_len=4)],
                         ids=["current", "delayed"])
def test_fp8_linear_stays_within_fp8_error_of_the_16_bit_layer(ctx, recipe):
    want = run_linear(ctx, 5, None)
    got = run_linear(ctx, 5, recipe)
    # E4M3 rounds by up to 1/16, the E5M2 gradients by up to 1/8.
    assert relative(got[0], want[0]) < 0.06
    assert relative(got[0], want[0]) > 1e-4, "the FP8 path ran"
    assert relative(got[1], want[1]) < 0.15
    assert relative(got[2], want[2]) < 0.15


def test_fp8_layernorm_mlp_and_layernorm_linear_train_a_step(ctx):
    rng = np.random.default_rng(7)
    x = ctx.wrap(rng.standard_normal((128, 128)).astype(np.float32), name="x")
    for layer in (sg.LayerNormMLP(ctx, 128, 256, dtype="float32", name="mlp", fp8=sg.Fp8Recipe.block()),
                  sg.LayerNormLinear(ctx, 128, 128, dtype="float32", name="lnl", fp8=sg.Fp8Recipe.current())):
        y, saved = layer.forward(x)
        dx = layer.backward(saved, y)
        assert np.isfinite(dx.numpy()).all()
        assert all(np.isfinite(p.grad.numpy()).all() for p in layer.parameters())


def test_bad_recipes_are_clear_errors(ctx):
    with pytest.raises(sg.StepGraphError, match="margin must be in"):
        sg.Linear(ctx, HIDDEN, OUT, fp8=sg.Fp8Recipe.delayed(margin=99))
    with pytest.raises(sg.ArgumentError, match="fp8.scaling must be one of"):
        sg.Linear(ctx, HIDDEN, OUT, fp8=sg.Fp8Recipe(scaling="tensorwise"))
    with pytest.raises(TypeError, match="sg.Fp8Recipe or None"):
        sg.Linear(ctx, HIDDEN, OUT, fp8="delayed")
    with pytest.raises(sg.StepGraphError, match="divisible by 128"):
        sg.Linear(ctx, 128, 96, fp8=sg.Fp8Recipe.block())
    with pytest.raises(sg.StepGraphError, match="block scaling has no fast accumulation"):
        sg.Linear(ctx, 128, 128, fp8=sg.Fp8Recipe.block(fast_accumulation_forward=True))
