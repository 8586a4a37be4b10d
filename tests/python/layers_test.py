"""Layers from Python on the host: forward and backward (dx and every parameter
gradient) of Linear, LayerNorm, RMSNorm, LayerNormLinear and LayerNormMLP in fp32
against float64 NumPy references, with wrapped NumPy inputs (no copy)."""

import gc
import weakref

import numpy as np
import pytest

import stepgraph as sg
from references import assert_close, layernorm_mlp, linear, norm

TOKENS, HIDDEN, FFN, OUT = 5, 12, 20, 7  # ragged on purpose (fp32 takes any size)
BF16_FFN = 24  # bf16 fuses GeLU into cuBLASLt's epilogue, which needs ffn % 8 == 0
RTOL, ATOL = 2e-5, 2e-5  # fp32 arithmetic against float64 references


@pytest.fixture
def ctx():
    with sg.Context("host") as context:
        yield context


def randomize(layer, rng):
    """Random masters for every parameter (gammas near 1), so no term is trivially 0 or 1."""
    values = {}
    for p in layer.parameters():
        shape = p.master.shape
        data = rng.uniform(-0.5, 0.5, shape).astype(np.float32)
        if p.name.endswith("gamma"):
            data += 1.0
        p.master.copy_from(data)
        values[p.name] = data.astype(np.float64)
    layer.sync_parameters()
    return values


def grads_by_name(layer):
    return {p.name: p.grad.numpy().astype(np.float64) for p in layer.parameters()}


def inputs(ctx, rng, features, out_features):
    x = rng.standard_normal((TOKENS, features)).astype(np.float32)
    dy = rng.standard_normal((TOKENS, out_features)).astype(np.float32)
    return x, dy, ctx.wrap(x, name="x"), ctx.wrap(dy, name="dy")


@pytest.mark.parametrize("bias", [True, False])
def test_linear_fp32_forward_backward_match_numpy(ctx, bias):
    rng = np.random.default_rng(1)
    layer = sg.Linear(ctx, HIDDEN, OUT, bias=bias, dtype="float32", name="fc")
    params = randomize(layer, rng)
    x, dy, xt, dyt = inputs(ctx, rng, HIDDEN, OUT)
    y, saved = layer.forward(xt)
    dx = layer.backward(saved, dyt)
    ref_y, ref = linear(x.astype(np.float64), params["fc.weight"], params.get("fc.bias"), dy.astype(np.float64))
    assert y.shape == (TOKENS, OUT) and y.storage == "eager"
    assert_close(y.numpy(), ref_y, RTOL, ATOL, "y")
    assert_close(dx.numpy(), ref["dx"], RTOL, ATOL, "dx")
    grads = grads_by_name(layer)
    assert_close(grads["fc.weight"], ref["dw"], RTOL, ATOL, "dweight")
    if bias:
        assert_close(grads["fc.bias"], ref["db"], RTOL, ATOL, "dbias")
    else:
        assert "fc.bias" not in grads


def test_linear_without_dgrad_returns_no_dx(ctx):
    layer = sg.Linear(ctx, HIDDEN, OUT, dtype="float32", dgrad=False)
    rng = np.random.default_rng(2)
    _, _, xt, dyt = inputs(ctx, rng, HIDDEN, OUT)
    y, saved = layer.forward(xt)
    assert layer.backward(saved, dyt) is None


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_norm_fp32_forward_backward_match_numpy(ctx, kind):
    rng = np.random.default_rng(3)
    layer = sg.Norm(ctx, HIDDEN, kind=kind, eps=1e-5, dtype="float32", name="n")
    params = randomize(layer, rng)
    x, dy, xt, dyt = inputs(ctx, rng, HIDDEN, HIDDEN)
    y, saved = layer.forward(xt)
    dx = layer.backward(saved, dyt)
    rms = kind == "rmsnorm"
    ref_y, ref = norm(x.astype(np.float64), params["n.gamma"], params.get("n.beta"), dy.astype(np.float64), 1e-5, rms)
    assert_close(y.numpy(), ref_y, RTOL, ATOL, "y")
    assert_close(dx.numpy(), ref["dx"], 1e-4, 1e-4, "dx")
    grads = grads_by_name(layer)
    assert_close(grads["n.gamma"], ref["dgamma"], RTOL, 1e-4, "dgamma")
    if not rms:
        assert_close(grads["n.beta"], ref["dbeta"], RTOL, 1e-4, "dbeta")


def test_layernorm_linear_fp32_matches_norm_then_linear(ctx):
    rng = np.random.default_rng(4)
    layer = sg.LayerNormLinear(ctx, HIDDEN, OUT, dtype="float32", name="qkv")
    params = randomize(layer, rng)
    x, dy, xt, dyt = inputs(ctx, rng, HIDDEN, OUT)
    y, saved = layer.forward(xt)
    dx = layer.backward(saved, dyt)
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    gamma, beta = params["qkv.norm.gamma"], params["qkv.norm.beta"]
    normed, _ = norm(x64, gamma, beta, np.zeros_like(x64), 1e-5)
    ref_y, lin = linear(normed, params["qkv.linear.weight"], params["qkv.linear.bias"], dy64)
    _, nrm = norm(x64, gamma, beta, lin["dx"], 1e-5)
    assert_close(y.numpy(), ref_y, 1e-4, 1e-4, "y")
    assert_close(dx.numpy(), nrm["dx"], 1e-4, 1e-4, "dx")
    grads = grads_by_name(layer)
    assert_close(grads["qkv.linear.weight"], lin["dw"], 1e-4, 1e-4, "dweight")
    assert_close(grads["qkv.linear.bias"], lin["db"], 1e-4, 1e-4, "dbias")
    assert_close(grads["qkv.norm.gamma"], nrm["dgamma"], 1e-4, 1e-4, "dgamma")
    assert_close(grads["qkv.norm.beta"], nrm["dbeta"], 1e-4, 1e-4, "dbeta")


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_layernorm_mlp_fp32_forward_backward_match_numpy(ctx, kind):
    rng = np.random.default_rng(5)
    layer = sg.LayerNormMLP(ctx, HIDDEN, FFN, norm=kind, dtype="float32", name="mlp")
    raw = randomize(layer, rng)
    params = {"gamma": raw["mlp.norm.gamma"], "beta": raw.get("mlp.norm.beta"), "w1": raw["mlp.fc1.weight"], "b1": raw["mlp.fc1.bias"],
              "w2": raw["mlp.fc2.weight"], "b2": raw["mlp.fc2.bias"]}
    x, dy, xt, dyt = inputs(ctx, rng, HIDDEN, HIDDEN)
    y, saved = layer.forward(xt)
    dx = layer.backward(saved, dyt)
    ref_y, ref = layernorm_mlp(x.astype(np.float64), params, dy.astype(np.float64), 1e-5, kind == "rmsnorm")
    assert_close(y.numpy(), ref_y, 1e-4, 1e-4, "y")
    assert_close(dx.numpy(), ref["dx"], 1e-4, 1e-4, "dx")
    grads = grads_by_name(layer)
    for name, key in (("mlp.fc1.weight", "dw1"), ("mlp.fc1.bias", "db1"), ("mlp.fc2.weight", "dw2"),
                      ("mlp.fc2.bias", "db2"), ("mlp.norm.gamma", "dgamma"), ("mlp.norm.beta", "dbeta")):
        if key in ref:
            assert_close(grads[name], ref[key], 1e-4, 1e-4, name)


def test_wrapped_numpy_input_is_not_copied(ctx):
    x = np.arange(TOKENS * HIDDEN, dtype=np.float32).reshape(TOKENS, HIDDEN)
    xt = ctx.wrap(x, name="x")
    assert xt.data_ptr == x.ctypes.data
    assert xt.storage == "persistent"
    x[0, 0] = 42.0  # the tensor sees the array's own memory
    assert xt.numpy()[0, 0] == 42.0
    view = np.asarray(xt)  # __array_interface__
    assert view.ctypes.data == x.ctypes.data


def test_saved_keeps_a_wrapped_input_alive_until_it_goes(ctx):
    """The backward reads the forward's input again (a saved reference), so the Saved keeps a
    wrapped array alive: dropping the caller's names must not free what the backward reads."""
    layer = sg.Linear(ctx, HIDDEN, OUT, dtype="float32")
    array = np.ones((TOKENS, HIDDEN), np.float32)
    alive = weakref.ref(array)
    _, saved = layer.forward(ctx.wrap(array))
    del array
    gc.collect()
    assert alive() is not None, "the wrapped input went while its Saved still needs it"
    del saved
    gc.collect()
    assert alive() is None, "the Saved kept the wrapped input after it went"


def test_bf16_tensor_round_trips_through_float32(ctx):
    values = np.array([[1.0, -2.5, 3.140625, 1e-3]], dtype=np.float32)
    t = ctx.from_numpy(values, dtype="bf16", name="b")
    assert t.dtype == sg.DType.BFLOAT16 and t.numpy().dtype == np.uint16
    np.testing.assert_array_equal(t.to_float32(), sg.bf16_bits_to_float32(sg.float32_to_bf16_bits(values)))
    assert abs(t.to_float32()[0, 2] - 3.140625) == 0  # exactly representable in bf16


def test_bf16_layernorm_mlp_runs_on_host_close_to_fp32(ctx):
    rng = np.random.default_rng(6)
    fp32 = sg.LayerNormMLP(ctx, HIDDEN, BF16_FFN, dtype="float32", name="a", seed=9)
    bf16 = sg.LayerNormMLP(ctx, HIDDEN, BF16_FFN, dtype="bfloat16", name="b", seed=9)
    x = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    y32 = fp32(ctx.from_numpy(x)).to_float32()
    y16 = bf16(ctx.from_numpy(x, dtype="bf16")).to_float32()
    assert_close(y16, y32, 5e-2, 5e-2, "bf16 y against fp32 y")


def test_memory_counts_created_tensors_but_not_wrapped_ones(ctx):
    before = ctx.memory()["persistent_bytes"]
    kept = ctx.tensor((16, 16), "float32")
    assert ctx.memory()["persistent_bytes"] == before + 1024
    wrapped = ctx.wrap(np.zeros((16, 16), np.float32))
    assert ctx.memory()["persistent_bytes"] == before + 1024, "the caller's memory is not StepGraph's"
    del kept, wrapped
    assert ctx.memory()["persistent_bytes"] == before
