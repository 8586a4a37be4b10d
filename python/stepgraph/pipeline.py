"""Per-layer graphs for pipeline schedules: a list of layers captured as one graph per layer,
pass and microbatch, in the order a schedule gives, all planned into one pool
(TransformerEngine's make_graphed_callables with _order, done by the planner).

    order = sg.one_f_one_b(microbatches=4, warmup=1)     # [1, 2, -1, 3, -2, 4, -3, -4]
    graphed = sg.make_graphed_layers([attn, mlp], [x0, x1, x2, x3], order)
    for entry in order:
        m = abs(entry) - 1
        if entry > 0:
            y = graphed.forward(m, recv_activation())    # the stage's output for microbatch m
        else:
            dx = graphed.backward(m, recv_gradient())
    graphed.gradients                                    # each parameter's, summed over the microbatches

`order` is TransformerEngine's signed form, counting from 1: +m runs microbatch m's forward, -m
its backward. forward() and backward() take the microbatch counting from 0 (an index into
sample_inputs). The graphs must run in the captured order, since the pool's memory is reused in
that order: a call out of it raises StepGraphError naming the graph due.
"""

import ctypes

from stepgraph import _capi, _checks
from stepgraph._library import StepGraphError
from stepgraph.graph import _source_streams, policy_value
from stepgraph.layers import Layer
from stepgraph.tensor import Tensor


def one_f_one_b(microbatches, warmup):
    """The 1F1B order of a stage `warmup` forwards ahead of its first backward (stage s of p:
    p - s - 1), in the signed form make_graphed_layers takes."""
    microbatches = _checks.check_int("microbatches", microbatches, *_checks.POSITIVE_INT64, "one_f_one_b")
    warmup = min(_checks.check_int("warmup", warmup, *_checks.NON_NEGATIVE_INT64, "one_f_one_b"), microbatches - 1)
    order = list(range(1, warmup + 2))
    forward = warmup + 2
    for backward in range(1, microbatches + 1):
        order.append(-backward)
        if forward <= microbatches:
            order.append(forward)
            forward += 1
    return order


def make_graphed_layers(layers, sample_inputs, order, policy="error"):
    """Captures `layers` (stepgraph layers of one context) as per-layer graphs over the
    microbatches of `order`; sample_inputs[i] gives microbatch i's input shape and dtype (one per
    microbatch: len(order) // 2). `policy` is the pool report policy (see stepgraph.capture)."""
    owner = "make_graphed_layers"
    layers = _checks.check_sequence("layers", layers, owner)
    sample_inputs = _checks.check_sequence("sample_inputs", sample_inputs, owner)
    if not layers:
        raise _checks.ArgumentError("make_graphed_layers takes a non-empty list of stepgraph layers, got none")
    for i, layer in enumerate(layers):
        _checks.check_instance(f"layers[{i}]", layer, Layer, "a stepgraph layer", owner)
    for i, x in enumerate(sample_inputs):
        _checks.check_instance(f"sample_inputs[{i}]", x, Tensor, "a stepgraph Tensor (ctx.wrap or ctx.from_numpy)",
                               owner)
    order = [_checks.check_int(f"order[{i}]", entry, *_checks.INT64, owner)
             for i, entry in enumerate(_checks.check_sequence("order", order, owner))]
    policy = policy_value(policy, owner)
    if len(sample_inputs) != len(order) // 2:
        raise StepGraphError(f"make_graphed_layers: {len(sample_inputs)} sample input(s) for an order of "
                             f"{len(order)} passes; give one per microbatch ({len(order) // 2})")
    layer_handles = (ctypes.c_void_p * len(layers))(*[layer._handle.value for layer in layers])
    input_handles = (ctypes.c_void_p * max(len(sample_inputs), 1))(*[x._handle.value for x in sample_inputs])
    order_array = (ctypes.c_int64 * max(len(order), 1))(*order)
    handle = _capi.new_handle()
    _capi.call("sg_graphed_layers_capture", layers[0].ctx.handle, layer_handles, len(layers), input_handles,
               order_array, len(order), policy, ctypes.byref(handle))
    return GraphedLayers(handle, layers)


class GraphedLayers:
    """The per-layer graphs of make_graphed_layers: replay each pass in the captured order."""

    def __init__(self, handle, layers):
        self._handle = None
        self._handle = _checks.check_handle(handle, "GraphedLayers are made by make_graphed_layers()")
        self._layers = layers  # the handle keeps them alive too; this keeps their Python side

    def __del__(self):
        _capi.destroy("sg_graphed_layers_destroy", getattr(self, "_handle", None))
        self._handle = None

    def _pass(self, name, microbatch, source):
        microbatch = _checks.check_int("microbatch", microbatch, *_checks.INT64, f"GraphedLayers.{name}")
        if source is not None:
            _checks.check_instance("x" if name == "forward" else "dy", source, Tensor, "a stepgraph Tensor or None",
                                   f"GraphedLayers.{name}")
        streams = _source_streams([source] if source is not None else [])
        stream_array = (ctypes.c_void_p * max(len(streams), 1))(*streams)
        out = _capi.new_handle()
        _capi.call(f"sg_graphed_layers_{name}", self._handle, microbatch,
                   source._handle if source is not None else None, stream_array, len(streams), ctypes.byref(out))
        return Tensor._adopt(out)

    def forward(self, microbatch, x=None):
        """Replays microbatch `microbatch`'s forward through every layer after copying x into its
        static input (None: it was written in place, see input()); the stage's output, valid
        until this pass runs again."""
        return self._pass("forward", microbatch, x)

    def backward(self, microbatch, dy=None):
        """Replays the microbatch's backward after copying dy into its static output gradient;
        dx (None where the first layer computes none)."""
        return self._pass("backward", microbatch, dy)

    def _tensor(self, name, microbatch):
        microbatch = _checks.check_int("microbatch", microbatch, *_checks.INT64, f"GraphedLayers.{name}")
        out = _capi.new_handle()
        _capi.call(f"sg_graphed_layers_{name}", self._handle, microbatch, ctypes.byref(out))
        return Tensor(out)

    def input(self, microbatch):
        """The microbatch's static input (write it in place and pass x=None to skip the copy)."""
        return self._tensor("input", microbatch)

    def grad_output(self, microbatch):
        """The microbatch's static output gradient."""
        return self._tensor("grad_output", microbatch)

    @property
    def gradients(self):
        """Every layer's parameters' gradients in order, summed over the microbatches."""
        count = ctypes.c_size_t()
        _capi.call("sg_graphed_layers_gradient_count", self._handle, ctypes.byref(count))
        out = []
        for index in range(count.value):
            handle = _capi.new_handle()
            _capi.call("sg_graphed_layers_gradient", self._handle, index, ctypes.byref(handle))
            out.append(Tensor(handle))
        return out

    @property
    def graph_count(self):
        count = ctypes.c_size_t()
        _capi.call("sg_graphed_layers_graph_count", self._handle, ctypes.byref(count))
        return count.value

    @property
    def pool_bytes(self):
        return self._pool()[0]

    @property
    def lower_bound_bytes(self):
        """The planner's lower bound for the pool: the most bytes that must be live at once."""
        return self._pool()[1]

    def _pool(self):
        pool, bound = ctypes.c_int64(), ctypes.c_int64()
        _capi.call("sg_graphed_layers_pool_bytes", self._handle, ctypes.byref(pool), ctypes.byref(bound))
        return pool.value, bound.value

    @property
    def next_graph(self):
        """The graph due next, e.g. "F0 layer 0 (linear)"."""
        return _capi.string_out("sg_graphed_layers_next_graph", self._handle)
