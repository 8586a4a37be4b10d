"""Learning-rate schedules from Python on the host (kernels/lr_schedule.h): a TrainStep whose AdamW
follows a warmup + cosine schedule, captured once and replayed, equals eager steps bit for bit and uses
each step's rate; set_lr between replays reaches the captured step; bad schedules are errors."""

import math

import numpy as np
import pytest

import stepgraph as sg
from host_models import TOKENS, batch, ctx, small_model  # noqa: F401 (ctx is a fixture)


def cosine_rate(schedule, t):
    """kernels::lr_at in Python doubles, rounded once to float32, as the host reference computes it."""
    base = float(np.float32(schedule.base))
    if t <= schedule.warmup:
        return float(np.float32(base * t / schedule.warmup))
    p = min(max((t - schedule.warmup) / (schedule.total - schedule.warmup), 0.0), 1.0)
    floor = float(np.float32(schedule.min_lr))
    return float(np.float32(floor + (base - floor) * (0.5 * (1.0 + math.cos(math.pi * p)))))


def test_scheduled_train_step_replays_like_eager_with_each_steps_rate(ctx):
    schedule = sg.LrSchedule("cosine", base=1e-2, min_lr=1e-3, warmup=2, total=7)
    eager_model, graph_model = small_model(ctx), small_model(ctx)
    eager = sg.TrainStep(eager_model, sg.AdamW(ctx, eager_model, schedule=schedule), TOKENS)
    graphed = sg.TrainStep(graph_model, sg.AdamW(ctx, graph_model, schedule=schedule), TOKENS)
    graph = graphed.capture(policy="error")
    rates = []
    for step in range(1, 10):
        x, labels = batch(100 + step % 2)
        eager.load(x, labels)
        graphed.load(x, labels)
        eager_loss = eager().item()
        graph.replay()
        assert eager_loss == graph.outputs[0].item(), f"step {step}"
        assert graphed.optimizer.lr == eager.optimizer.lr == cosine_rate(schedule, step), f"step {step}"
        rates.append(graphed.optimizer.lr)
    assert rates[1] == pytest.approx(1e-2) and rates[-1] == pytest.approx(1e-3)
    assert graph.replay_count == 9, "one capture took every rate"


def test_set_lr_between_replays_reaches_the_captured_step(ctx):
    eager_model, graph_model = small_model(ctx), small_model(ctx)
    eager = sg.TrainStep(eager_model, sg.AdamW(ctx, eager_model, lr=1e-2), TOKENS)
    graphed = sg.TrainStep(graph_model, sg.AdamW(ctx, graph_model, lr=1e-2), TOKENS)
    graph = graphed.capture(policy="error")
    x, labels = batch(7)
    for step, rate in enumerate([1e-2, 0.0, 3e-3]):
        eager.optimizer.set_lr(rate)
        graphed.optimizer.set_lr(rate)
        eager.load(x, labels)
        graphed.load(x, labels)
        assert eager().item() == (graph.replay(), graph.outputs[0].item())[1], f"step {step}"
        assert graphed.optimizer.lr == np.float32(rate)


def test_bad_schedules_are_errors(ctx):
    model = small_model(ctx)
    with pytest.raises(ValueError, match="kind must be one of"):
        sg.LrSchedule("step")
    with pytest.raises(sg.StepGraphError, match="total steps must be larger"):
        sg.AdamW(ctx, model, schedule=sg.LrSchedule("cosine", base=1e-3, warmup=5, total=5))
    optimizer = sg.AdamW(ctx, model, schedule=sg.LrSchedule("constant", base=1e-3, warmup=3))
    with pytest.raises(sg.StepGraphError, match="writes the rate"):
        optimizer.set_lr(1e-4)
