"""The trainer's model from Python on the host: a GPT and the window model trained by a TrainStep
on token ids (eager equal to the captured step bit for bit), packed sequences of any lengths,
the optimizer's options (non-finite skip, loss scaling, step-scoped gradients, ZeRO-1), and every
argument checked before it reaches C."""

import numpy as np
import pytest

import stepgraph as sg

VOCAB, SEQ = 32, 8


@pytest.fixture
def ctx():
    with sg.Context("host") as context:
        yield context


def gpt(ctx, **kwargs):
    options = dict(vocab=VOCAB, hidden=32, layers=1, heads=2, ffn=64, seq_len=SEQ, dtype="float32", seed=3)
    options.update(kwargs)
    return sg.LanguageModel(ctx, **options)


def batch(tokens, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, tokens)
    return ids, np.roll(ids, -1)


def losses(step, ids, labels, steps, graphed, packing=None):
    graph = step.capture() if graphed else None
    out = []
    for _ in range(steps):
        step.load(ids, labels, packing)
        if graph is not None:
            graph.replay()
            out.append(graph.outputs[0].item())
        else:
            out.append(step().item())
    step.check_errors()
    return np.array(out, np.float32)


@pytest.mark.parametrize("kwargs", [{}, {"kv_heads": 1, "dropout": 0.1, "experts": 4, "topk": 1, "moe_every": 1}],
                         ids=["gpt", "gqa_dropout_moe"])
def test_gpt_trains_and_eager_equals_graph(ctx, kwargs):
    ids, labels = batch(4 * SEQ)
    runs = []
    for graphed in (False, True):
        model = gpt(ctx, **kwargs)
        step = sg.TrainStep(model, sg.AdamW(ctx, model, lr=1e-2, skip_nonfinite=True), tokens=4 * SEQ)
        assert step.x.shape == (4 * SEQ, 1) and step.labels.shape == (4 * SEQ,)
        assert step.packing.numpy().tolist() == [0, 8, 16, 24, 32]
        runs.append(losses(step, ids, labels, 6, graphed))
    assert runs[0][-1] < runs[0][0], runs[0]
    assert runs[0].view(np.uint32).tolist() == runs[1].view(np.uint32).tolist()


def test_window_model_takes_one_example_per_row(ctx):
    model = sg.LanguageModel(ctx, vocab=VOCAB, hidden=32, layers=2, heads=0, ffn=64, context=4, dtype="float32")
    assert not model.sequence_model and model.length == 4
    step = sg.TrainStep(model, sg.AdamW(ctx, model, lr=1e-2), tokens=16)
    assert step.x.shape == (16, 4) and step.labels.shape == (16,) and step.packing is None
    rng = np.random.default_rng(1)
    windows = rng.integers(0, VOCAB, (16, 4))
    got = losses(step, windows, windows[:, -1], 5, graphed=True)
    assert got[-1] < got[0]


def test_packed_sequences_of_any_lengths(ctx):
    model = gpt(ctx)
    step = sg.TrainStep(model, sg.AdamW(ctx, model, lr=1e-2), tokens=24, sequences=4)
    assert step.packing.numpy().tolist() == [0, 24, 24, 24, 24]  # one sequence of every token until loaded
    ids, labels = batch(24)
    got = losses(step, ids, labels, 3, graphed=True, packing=[0, 5, 11, 11, 24])
    assert step.packing.numpy().tolist() == [0, 5, 11, 11, 24]
    assert got[-1] < got[0]


def test_step_scoped_gradients_train_alike(ctx):
    ids, labels = batch(2 * SEQ)
    runs = []
    for scoped in (False, True):
        model = gpt(ctx)
        optimizer = sg.AdamW(ctx, model, lr=1e-2, step_scoped_gradients=scoped)
        runs.append(losses(sg.TrainStep(model, optimizer, tokens=2 * SEQ), ids, labels, 3, graphed=True))
    assert runs[0].view(np.uint32).tolist() == runs[1].view(np.uint32).tolist()


def test_loss_scaling_and_the_skip(ctx):
    model = gpt(ctx, dtype="float16")
    optimizer = sg.AdamW(ctx, model, lr=1e-3, skip_nonfinite=True,
                         loss_scaling=sg.LossScaling(initial_scale=1024.0, growth_interval=1))
    assert optimizer.loss_scale == 1024.0
    ids, labels = batch(2 * SEQ)
    losses(sg.TrainStep(model, optimizer, tokens=2 * SEQ), ids, labels, 2, graphed=False)
    assert optimizer.loss_scale == 4096.0 and optimizer.skipped_steps == 0
    plain = sg.AdamW(ctx, gpt(ctx))
    assert plain.loss_scale == 1.0 and plain.skipped_steps == 0
    with pytest.raises(sg.ArgumentError, match="pass skip_nonfinite=True too"):
        sg.AdamW(ctx, model, loss_scaling=True)
    with pytest.raises(sg.ArgumentError, match="growth_interval must be in"):
        sg.LossScaling(growth_interval=0)
    with pytest.raises(sg.StepGraphError, match="non-finite skip"):
        sg.AdamW(ctx, model, skip_nonfinite=True, step_scoped_gradients=True)


def test_fp8_with_its_weight_cache_trains(ctx):
    model = gpt(ctx, hidden=64, ffn=128, heads=4, fp8=sg.Fp8Recipe.delayed(amax_history_len=4),
                fp8_weight_cache=True)
    step = sg.TrainStep(model, sg.AdamW(ctx, model, lr=1e-2, skip_nonfinite=True), tokens=2 * SEQ)
    got = losses(step, *batch(2 * SEQ), 4, graphed=True)
    assert np.isfinite(got).all() and got[-1] < got[0]
    model.check_errors()


def test_model_arguments_are_checked(ctx):
    with pytest.raises(sg.ArgumentError, match="context=4 is the window model's"):
        gpt(ctx, context=4)
    with pytest.raises(sg.ArgumentError, match="seq_len=4 is the GPT's"):
        sg.LanguageModel(ctx, heads=0, seq_len=4)
    with pytest.raises(sg.ArgumentError, match="dropout must be finite and in"):
        gpt(ctx, dropout=1.0)
    with pytest.raises(TypeError, match="heads must be an integer"):
        gpt(ctx, heads=2.0)
    with pytest.raises(sg.ArgumentError, match="fp8_weight_cache=True caches FP8 weights"):
        gpt(ctx, fp8_weight_cache=True)
    with pytest.raises(sg.ArgumentError, match="overlap='bulk' applies to a tensor-parallel model"):
        gpt(ctx, overlap="bulk")
    with pytest.raises(sg.ArgumentError, match="kv_heads=1 applies to attention"):
        sg.LanguageModel(ctx, heads=0, kv_heads=1)
    with pytest.raises(sg.ArgumentError, match="topk=1 applies to mixture-of-experts"):
        gpt(ctx, topk=1)
    with pytest.raises(sg.ArgumentError, match="vocab must be in"):
        gpt(ctx, vocab=0)
    with pytest.raises(sg.StepGraphError, match="heads"):
        gpt(ctx, heads=3)  # hidden 32 does not split into 3 heads
    with pytest.raises(sg.StepGraphError, match="no forward of its own"):
        gpt(ctx).forward(ctx.tensor((2, 32)))


def test_step_arguments_are_checked(ctx):
    model = gpt(ctx)
    optimizer = sg.AdamW(ctx, model)
    with pytest.raises(sg.StepGraphError, match="multiple of the model's context"):
        sg.TrainStep(model, optimizer, tokens=12)
    with pytest.raises(sg.ArgumentError, match="dp_mode must be one of"):
        sg.TrainStep(model, optimizer, tokens=8, dp_mode="zero2")
    with pytest.raises(sg.StepGraphError, match="config->zero1 shards the optimizer"):
        sg.TrainStep(model, optimizer, tokens=8, dp_mode="zero1")
    window = sg.LanguageModel(ctx, vocab=VOCAB, hidden=32, layers=1, heads=0, ffn=64, context=4)
    with pytest.raises(sg.ArgumentError, match="sequences=2 packs the sequences"):
        sg.TrainStep(window, sg.AdamW(ctx, window), tokens=8, sequences=2)
    step = sg.TrainStep(model, optimizer, tokens=16)
    ids, labels = batch(16)
    with pytest.raises(sg.ArgumentError, match="token ids are in"):
        step.load(np.full(16, VOCAB), labels)
    with pytest.raises(TypeError, match="x must be an integer array of token ids"):
        step.load(ids.astype(np.float32), labels)
    with pytest.raises(sg.ArgumentError, match="x must have shape"):
        step.load(ids[:8], labels)
    with pytest.raises(sg.ArgumentError, match="labels must hold values in"):
        step.load(ids, np.full(16, VOCAB))
    with pytest.raises(sg.ArgumentError, match="packing must start at 0, end at tokens = 16"):
        step.load(ids, labels, packing=[0, 10, 8])
    with pytest.raises(sg.ArgumentError, match="packing must have shape"):
        step.load(ids, labels, packing=[0, 16])
    window_step = sg.TrainStep(window, sg.AdamW(ctx, window), tokens=4)
    with pytest.raises(sg.ArgumentError, match="packing is the cu_seqlens of a model with attention"):
        window_step.load(np.zeros((4, 4), np.int32), np.zeros(4, np.int32), packing=[0, 4])


def test_gemm_algorithms_is_the_contexts():
    with sg.Context("host", gemm_algorithms="timed") as timed:
        assert timed.gemm_algorithms == "timed"
    with sg.Context("host") as default:
        assert default.gemm_algorithms == "heuristic"
    with pytest.raises(sg.ArgumentError, match="gemm_algorithms must be one of"):
        sg.Context("host", gemm_algorithms="fastest")


def test_a_captured_gpt_step_profiles_like_the_trainers_profile_flag(ctx):
    model = gpt(ctx)
    optimizer = sg.AdamW(ctx, model, lr=1e-2)
    step = sg.TrainStep(model, optimizer, tokens=2 * SEQ)
    step.load(*batch(2 * SEQ))
    graph = step.capture()
    graph.replay()
    text = graph.profile()  # a real step: the optimizer's counter moves
    assert optimizer.steps_taken == 2
    assert "matmul" in text or "gemm" in text, text


def test_a_world_of_one_splits_into_a_world_of_one():
    with sg.init_distributed("host") as world:  # no launcher variables: this process alone
        group = world.split(0)
        assert (group.rank, group.size, group.device) == (0, 1, "host")
        with pytest.raises(sg.ArgumentError, match="color must be in"):
            world.split(-1)
