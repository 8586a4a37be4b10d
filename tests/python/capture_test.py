"""Captured steps from Python on the host: a TrainStep captured and replayed equals
eager steps bit for bit; a Python step function (layer forward and backward) is
traced, replayed with input bindings, and reports the pool tensors it keeps; the
graph cache counts hits and misses."""

import gc

import numpy as np
import pytest

import stepgraph as sg
from host_models import TOKENS, batch, ctx, small_model  # noqa: F401 (ctx is a fixture)
from references import assert_close, linear


def test_captured_train_step_replays_like_eager_steps(ctx):
    eager_model, graph_model = small_model(ctx), small_model(ctx)
    eager = sg.TrainStep(eager_model, sg.AdamW(ctx, eager_model, lr=1e-2), TOKENS)
    graphed = sg.TrainStep(graph_model, sg.AdamW(ctx, graph_model, lr=1e-2), TOKENS)
    graph = graphed.capture(policy="error")
    assert graph.pool_report_count == 0 and graph.pool_bytes > 0 and graph.segment_count >= 1
    losses = []
    for step in range(6):
        x, labels = batch(100 + step % 2)
        eager.load(x, labels)
        graphed.load(x, labels)
        eager_loss = eager().item()
        graph.replay()
        graph_loss = graph.outputs[0].item()
        assert eager_loss == graph_loss, f"step {step}: eager {eager_loss}, graph {graph_loss}"
        losses.append(graph_loss)
    graphed.check_errors()
    assert graph.replay_count == 6
    assert graphed.optimizer.steps_taken == 6 and eager.optimizer.steps_taken == 6
    assert losses[-1] < losses[0], "training on two fixed batches did not reduce the loss"


def test_python_step_function_is_traced_then_replayed_with_bindings(ctx):
    layer = sg.Linear(ctx, 16, 8, dtype="float32", name="fc")
    x = ctx.tensor((4, 16), "float32", name="x")  # the step's static input
    dy = ctx.from_numpy(np.ones((4, 8), np.float32), name="dy")
    calls = []

    def step():
        calls.append(1)
        y, saved = layer.forward(x)
        assert y.storage == "traced"  # recorded, not run
        layer.backward(saved, dy)
        return [y]

    graph = sg.capture(ctx, step, policy="error")
    assert len(calls) == 1, "the step function runs once, at capture"
    weight = {p.name: p.master.numpy().astype(np.float64) for p in layer.parameters()}
    for seed in (1, 2):
        data = np.random.default_rng(seed).standard_normal((4, 16)).astype(np.float32)
        graph.replay({x: ctx.from_numpy(data)})
        ref_y, ref = linear(data.astype(np.float64), weight["fc.weight"], weight["fc.bias"], np.ones((4, 8)))
        (y,) = graph.outputs
        assert y.storage == "pool"
        assert_close(y.numpy(), ref_y, 1e-5, 1e-5, "replayed y")
        assert_close(layer.parameters()[0].grad.numpy(), ref["dw"], 1e-5, 1e-5, "replayed dweight")
    assert len(calls) == 1, "replays do not call the step function"


def keeping_step(ctx):
    """A step over a Linear that keeps its output 'h' in `kept` beyond the step without
    returning it (returning a persistent tensor instead): (step, kept)."""
    layer = sg.Linear(ctx, 16, 8, dtype="float32", name="fc")
    x = ctx.tensor((4, 16), "float32", name="x")
    kept = []

    def step():
        h = layer(x)
        h.name = "h"
        kept.append(h)
        return layer.parameters()[0].master

    return step, kept


def test_pool_report_lists_a_kept_tensor_and_error_policy_refuses_it(ctx):
    step, kept = keeping_step(ctx)
    graph = sg.capture(ctx, step, policy="warn")
    assert graph.pool_report_count == 1
    assert "1 tensor(s) in the graph pool not returned as outputs" in graph.pool_report
    assert "'h'" in graph.pool_report
    kept.clear()
    with pytest.raises(sg.StepGraphError, match="not returned as outputs") as error:
        sg.capture(ctx, step, policy="error")
    assert error.value.code_name == "invalid_state" and error.value.code == 2


def test_free_policy_makes_a_kept_tensor_unavailable(ctx):
    step, kept = keeping_step(ctx)
    graph = sg.capture(ctx, step, policy="free")
    assert graph.pool_report_count == 1
    assert kept[0].storage == "unavailable"
    with pytest.raises(sg.StepGraphError, match="pool report policy 'free' released it"):
        kept[0].numpy()


def test_error_in_step_function_surfaces_as_the_python_exception(ctx):
    def step():
        raise ValueError("bad batch")

    with pytest.raises(ValueError, match="bad batch"):
        sg.capture(ctx, step)
    # The context is usable afterwards: the trace was abandoned cleanly.
    layer = sg.Linear(ctx, 4, 4, dtype="float32")
    y = layer(ctx.tensor((2, 4)))
    assert y.shape == (2, 4)


def test_graph_cache_hits_equal_keys_and_counts(ctx):
    layer = sg.Linear(ctx, 16, 8, dtype="float32", name="fc")
    x = ctx.tensor((4, 16), "float32", name="x")
    cache = sg.GraphCache(max_pool_bytes=1 << 30)
    captures = []

    def step():
        captures.append(1)
        return layer(x)

    first = cache.get_or_capture("fc/4x16", ctx, step)
    second = cache.get_or_capture("fc/4x16", ctx, step)
    cache.get_or_capture("fc/other", ctx, step)
    assert len(captures) == 2
    stats = cache.stats
    assert (stats["hits"], stats["misses"], stats["captures"], stats["entries"]) == (1, 2, 2, 2)
    assert stats["pool_bytes"] == first.pool_bytes + cache.get_or_capture("fc/other", ctx, step).pool_bytes
    assert cache.contains("fc/4x16", ctx)
    first.replay()
    second.replay()
    assert second.replay_count == 2, "a hit returns the same captured step"
    cache.erase("fc/4x16", ctx)
    assert not cache.contains("fc/4x16", ctx)
    cache.clear()
    assert cache.stats["entries"] == 0


def test_released_pool_makes_replay_an_error(ctx):
    layer = sg.Linear(ctx, 4, 4, dtype="float32")
    x = ctx.tensor((2, 4))
    graph = sg.capture(ctx, lambda: layer(x))
    graph.release_pool()
    with pytest.raises(sg.StepGraphError, match="cannot replay: the captured step is released") as error:
        graph.replay()
    assert error.value.code_name == "invalid_state"


def test_release_pool_refuses_while_a_view_of_an_output_is_alive(ctx):
    layer = sg.Linear(ctx, 4, 4, dtype="float32")
    x = ctx.tensor((2, 4))
    graph = sg.capture(ctx, lambda: layer(x))
    graph.replay()
    view = graph.outputs[0].numpy()  # on host a view into the pool
    with pytest.raises(sg.StepGraphError, match=r"release_pool: 1 output tensor\(s\).*still in use.*drop them"):
        graph.release_pool()
    assert view.shape == (2, 4)  # still readable: the pool is still there
    del view
    gc.collect()
    graph.release_pool()
    with pytest.raises(sg.StepGraphError, match="released"):
        graph.replay()


def test_side_stream_scope_records_ops_on_stream_one(ctx):
    layer = sg.Linear(ctx, 4, 4, dtype="float32")
    x = ctx.tensor((2, 4))

    def step():
        with ctx.stream(1):
            y = layer(x)
        return y

    graph = sg.capture(ctx, step)
    assert " s1 " in graph.dump()


def test_moe_train_step_graph_equals_eager(ctx):
    def make():
        return sg.ResidualStack(ctx, hidden=32, ffn=64, layers=2, vocab=48, dtype="float32", seed=3, experts=4, topk=2,
                        moe_every=2)

    eager_model, graph_model = make(), make()
    eager = sg.TrainStep(eager_model, sg.AdamW(ctx, eager_model, lr=1e-2), TOKENS)
    graphed = sg.TrainStep(graph_model, sg.AdamW(ctx, graph_model, lr=1e-2), TOKENS)
    graph = graphed.capture(policy="error")
    for step in range(3):
        x, labels = batch(200 + step)
        eager.load(x, labels)
        graphed.load(x, labels)
        eager_loss = eager().item()
        graph.replay()
        assert eager_loss == graph.outputs[0].item(), f"step {step}"
