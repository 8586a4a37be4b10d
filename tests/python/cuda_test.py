"""The C API's CUDA paths through libstepgraph_c.so: a captured training step equal
to eager steps bit for bit, side streams, wrapped device memory (used in place,
never freed by StepGraph, host memory refused), graph outputs viewed by torch
without a copy. Skips without a CUDA device (and the torch cases without torch).
Runs under pytest or as `python3 cuda_test.py`."""

import ctypes
import gc

import numpy as np

import stepgraph as sg
from gpu_support import require_cuda, require_torch, run_as_script
from stepgraph import _capi

TOKENS = 64


def train_pair(ctx):
    def one():
        model = sg.ResidualStack(ctx, hidden=64, ffn=256, layers=4, vocab=128, dtype="bf16", seed=5)
        return sg.TrainStep(model, sg.AdamW(ctx, model, lr=1e-2), TOKENS)

    return one(), one()


def test_captured_train_step_equals_eager_bit_for_bit_on_cuda():
    ctx = require_cuda()
    eager, graphed = train_pair(ctx)
    graph = graphed.capture(policy="error")
    assert graph.pool_report_count == 0
    losses = []
    for step in range(8):
        rng = np.random.default_rng(100 + step % 2)
        x, labels = rng.standard_normal((TOKENS, 64)).astype(np.float32), rng.integers(0, 128, TOKENS)
        eager.load(x, labels)
        graphed.load(x, labels)
        eager_loss = eager().item()
        graph.replay()
        graph_loss = graph.outputs[0].item()
        assert np.float32(eager_loss).tobytes() == np.float32(graph_loss).tobytes(), (step, eager_loss, graph_loss)
        losses.append(graph_loss)
    graphed.check_errors()
    assert graphed.optimizer.steps_taken == 8
    assert losses[-1] < losses[0], losses


def test_side_stream_step_replays_like_eager_on_cuda():
    ctx = require_cuda()
    a = sg.LayerNormMLP(ctx, 128, 512, dtype="bf16", name="a", seed=1)
    b = sg.LayerNormMLP(ctx, 128, 512, dtype="bf16", name="b", seed=2)
    x = ctx.from_numpy(np.random.default_rng(0).standard_normal((32, 128)).astype(np.float32), dtype="bf16")

    def step():
        ya = a(x)
        with ctx.stream(1):  # overlaps with a's forward
            yb = b(x)
        return [ya, yb]

    eager = [t.to_float32() for t in step()]
    graph = sg.capture(ctx, step, policy="error")
    assert " s1 " in graph.dump()
    for _ in range(3):
        graph.replay()
        for got, want in zip(graph.outputs, eager):
            np.testing.assert_array_equal(got.to_float32(), want)


def test_wrap_refuses_host_memory_on_a_cuda_context():
    ctx = require_cuda()
    host = np.ones(4, np.float32)
    dims = (ctypes.c_int64 * 1)(4)
    handle = _capi.new_handle()
    try:
        _capi.call("sg_tensor_wrap", ctx.handle, b"h", 0, 1, dims, None, ctypes.c_void_p(host.ctypes.data),
                   ctypes.byref(handle))
    except sg.StepGraphError as error:
        assert error.code_name == "invalid_argument" and "not device memory" in error.message, error.message
    else:
        raise AssertionError("wrapping host memory on a cuda context was accepted")


def test_wrapped_torch_memory_is_used_in_place_and_never_freed():
    torch = require_torch()
    ctx = require_cuda()
    x = torch.full((8, 16), 2.0, device="cuda", dtype=torch.float32)
    layer = sg.Linear(ctx, 16, 4, bias=False, dtype="float32", name="fc")
    xt = ctx.wrap(x)
    assert xt.data_ptr == x.data_ptr()
    y = layer(xt)
    ctx.synchronize()
    weight = layer.parameters()[0].master.torch()
    torch.testing.assert_close(y.torch(), x @ weight.T, rtol=1e-4, atol=1e-4)
    del xt, y
    gc.collect()
    x.add_(1.0)  # still torch's memory: a free by StepGraph would make this (or the allocator) fail
    torch.cuda.synchronize()
    assert float(x.sum()) == 3.0 * x.numel()


def test_graph_outputs_are_torch_views_without_a_copy():
    torch = require_torch()
    ctx = require_cuda()
    layer = sg.Linear(ctx, 32, 16, dtype="bf16", name="fc")
    x = ctx.tensor((8, 32), "bf16", name="x")
    graph = sg.capture(ctx, lambda: layer(x))
    source = torch.randn(8, 32, device="cuda", dtype=torch.bfloat16)
    graph.replay({x: ctx.wrap(source)})
    ctx.synchronize()
    (y,) = graph.outputs
    view = y.torch()
    assert view.dtype == torch.bfloat16 and view.data_ptr() == y.data_ptr and view.is_cuda
    weight = layer.parameters()[0].value.torch().float()
    bias = layer.parameters()[1].value.torch().float()
    torch.testing.assert_close(view.float(), source.float() @ weight.T + bias, rtol=2e-2, atol=2e-2)


def test_graphed_layers_from_torch_batches_equal_eager_on_cuda():
    """Per-layer graphs in 1F1B order, fed torch tensors dropped right after each call (the
    copies must read them first), equal the eager schedule bit for bit."""
    ctx = require_cuda()
    torch = require_torch()

    def stage():
        return [sg.LayerNormMLP(ctx, 128, 256, dtype="bf16", name="mlp", seed=4),
                sg.Linear(ctx, 128, 128, dtype="bf16", name="out", seed=5)]

    eager, graphed_layers = stage(), stage()
    order = sg.one_f_one_b(4, 2)
    samples = [ctx.tensor((64, 128), "bf16", name=f"sample{m}") for m in range(4)]
    graphed = sg.make_graphed_layers(graphed_layers, samples, order)
    assert graphed.pool_bytes <= 1.10 * graphed.lower_bound_bytes
    generator = torch.Generator(device="cuda").manual_seed(11)
    saved = {}
    for entry in order:
        m = abs(entry) - 1
        batch = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16, generator=generator)
        if entry > 0:
            h = ctx.wrap(batch.clone())
            saved[m] = []
            for layer in eager:
                h, state = layer.forward(h)
                saved[m].append(state)
            got = graphed.forward(m, ctx.wrap(batch))
        else:
            h = ctx.wrap(batch.clone())
            for layer, state in reversed(list(zip(eager, saved.pop(m)))):
                h = layer.backward(state, h)
            got = graphed.backward(m, ctx.wrap(batch))
        del batch  # torch may hand its memory to the next batch at once
        assert np.array_equal(got.numpy(), h.numpy()), f"pass {entry}"


if __name__ == "__main__":
    run_as_script(globals(), "cuda_test")
