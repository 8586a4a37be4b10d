"""Per-layer graphs for pipeline schedules through the binding, on the host:
sg.make_graphed_layers replayed in 1F1B order equals the same layers' eager forward and backward
in that order, bit for bit, over two iterations, with the gradients summed over the microbatches;
a replay out of the captured order is refused, naming the graph due."""

import numpy as np
import pytest

import stepgraph as sg

HIDDEN = 32


@pytest.fixture
def ctx():
    with sg.Context("host") as context:
        yield context


def stage(ctx):
    return [sg.LayerNormMLP(ctx, HIDDEN, 2 * HIDDEN, dtype="float32", name="mlp", seed=4),
            sg.Linear(ctx, HIDDEN, HIDDEN, dtype="float32", name="out", seed=5)]


def test_one_f_one_b_order():
    assert sg.one_f_one_b(4, 1) == [1, 2, -1, 3, -2, 4, -3, -4]
    assert sg.one_f_one_b(3, 0) == [1, -1, 2, -2, 3, -3]
    assert sg.one_f_one_b(2, 5) == [1, 2, -1, -2]


def test_graphed_layers_in_1f1b_order_equal_eager_bitwise(ctx):
    tokens = [8, 16, 8]
    order = sg.one_f_one_b(3, 1)
    eager, graphed_layers = stage(ctx), stage(ctx)
    samples = [ctx.tensor((t, HIDDEN), "float32", name=f"sample{m}") for m, t in enumerate(tokens)]
    graphed = sg.make_graphed_layers(graphed_layers, samples, order)
    assert graphed.graph_count == len(order) * 2
    assert graphed.pool_bytes <= 1.10 * graphed.lower_bound_bytes
    assert graphed.next_graph == "F0 layer 0 (layernorm_mlp)"
    rng = np.random.default_rng(7)
    for iteration in range(2):
        xs = [rng.standard_normal((t, HIDDEN)).astype(np.float32) for t in tokens]
        dys = [rng.standard_normal((t, HIDDEN)).astype(np.float32) for t in tokens]
        saved, sums = {}, None
        for entry in order:
            m = abs(entry) - 1
            if entry > 0:
                h = ctx.from_numpy(xs[m])
                saved[m] = []
                for layer in eager:
                    h, s = layer.forward(h)
                    saved[m].append(s)
                got = graphed.forward(m, ctx.from_numpy(xs[m]))
                np.testing.assert_array_equal(got.numpy(), h.numpy(), err_msg=f"iteration {iteration} F{m}")
            else:
                g = ctx.from_numpy(dys[m])
                for layer, s in reversed(list(zip(eager, saved.pop(m)))):
                    g = layer.backward(s, g)
                grads = [p.grad.numpy().copy() for layer in eager for p in layer.parameters()]
                sums = grads if sums is None else [a + b for a, b in zip(sums, grads)]
                got = graphed.backward(m, ctx.from_numpy(dys[m]))
                np.testing.assert_array_equal(got.numpy(), g.numpy(), err_msg=f"iteration {iteration} B{m}")
        for index, (got, want) in enumerate(zip(graphed.gradients, sums)):
            np.testing.assert_array_equal(got.numpy(), want, err_msg=f"iteration {iteration} gradient {index}")


def test_replays_out_of_order_and_bad_arguments_are_refused(ctx):
    layers = stage(ctx)
    samples = [ctx.tensor((8, HIDDEN), "float32", name="x") for _ in range(2)]
    with pytest.raises(sg.StepGraphError, match="2 sample input"):
        sg.make_graphed_layers(layers, samples, [1, -1])
    with pytest.raises(sg.StepGraphError, match="backward before its forward"):
        sg.make_graphed_layers(layers, samples, [-1, 1, 2, -2])
    graphed = sg.make_graphed_layers(layers, samples, [1, 2, -1, -2])
    with pytest.raises(sg.StepGraphError, match="next graph, 'F0 layer 0"):
        graphed.backward(0)
    graphed.input(0).copy_from(np.ones((8, HIDDEN), np.float32))
    y = graphed.forward(0)  # the input written in place
    assert y.shape == (8, HIDDEN)
    assert graphed.next_graph == "F1 layer 0 (layernorm_mlp)"
