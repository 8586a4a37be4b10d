"""Layers: Linear, LayerNorm/RMSNorm, LayerNormLinear, LayerNormMLP and ResidualStack.

Every layer's forward returns (y, saved) and its backward takes saved and dy,
writes the parameter gradients (fp32, overwritten) and returns dx:

    y, saved = mlp.forward(x)
    dx = mlp.backward(saved, dy)

The same calls run now (eager) or are recorded inside a captured step function.
"""

import collections
import ctypes

from stepgraph import _capi, _checks
from stepgraph.fp8 import Fp8Recipe
from stepgraph._library import StepGraphError
from stepgraph.dtypes import as_dtype
from stepgraph.tensor import Tensor

_NORMS = {"layernorm": 0, "rmsnorm": 1}

Forward = collections.namedtuple("Forward", ["y", "saved"])
Parameter = collections.namedtuple("Parameter", ["name", "master", "value", "grad"])
Parameter.__doc__ = ("A parameter: fp32 master weight, the copy in the layer dtype the forward reads "
                     "(the master itself in fp32), and the fp32 gradient.")


def _norm(kind):
    if kind not in _NORMS:
        raise StepGraphError(f"norm must be 'layernorm' or 'rmsnorm', got {kind!r}")
    return _NORMS[kind]


class Saved:
    """What a layer's backward needs from its forward (opaque). It keeps the forward's input
    alive: the layer may read it again in the backward (a saved reference, never a copy), so
    a wrapped torch or CuPy array must not go back to its allocator before the backward ran."""

    def __init__(self, handle, keeps=None):
        self._handle = handle
        self._keeps = keeps

    def __del__(self):
        _capi.destroy("sg_saved_destroy", getattr(self, "_handle", None))
        self._handle = None


class Layer:
    """Base of every layer: forward, backward, parameters."""

    def __init__(self, ctx, create, *args):
        self.ctx = ctx
        self._handle = _capi.new_handle()
        _capi.call(create, ctx.handle, *args, ctypes.byref(self._handle))

    def __del__(self):
        _capi.destroy("sg_layer_destroy", getattr(self, "_handle", None))
        self._handle = None

    @property
    def kind(self):
        return _capi.string_out("sg_layer_kind", self._handle)

    def forward(self, x):
        """(y, saved) for input `x` (a stepgraph Tensor)."""
        if not isinstance(x, Tensor):
            raise TypeError(f"forward takes a stepgraph Tensor (ctx.wrap or ctx.from_numpy), got {type(x).__name__}")
        y, saved = _capi.new_handle(), _capi.new_handle()
        _capi.call("sg_layer_forward", self._handle, x._handle, ctypes.byref(y), ctypes.byref(saved))
        return Forward(Tensor(y), Saved(saved, keeps=x))

    def __call__(self, x):
        return self.forward(x).y

    def backward(self, saved, dy):
        """dx (None when the layer computes none); writes every parameter gradient."""
        if not isinstance(saved, Saved) or not isinstance(dy, Tensor):
            raise TypeError("backward takes the Saved of this layer's forward and a stepgraph Tensor dy")
        dx = _capi.new_handle()
        _capi.call("sg_layer_backward", self._handle, saved._handle, dy._handle, ctypes.byref(dx))
        return Tensor._adopt(dx)

    def parameters(self):
        count = ctypes.c_int64()
        _capi.call("sg_layer_parameter_count", self._handle, ctypes.byref(count))
        out = []
        for index in range(count.value):
            handles = [_capi.new_handle() for _ in range(3)]
            buffer = ctypes.create_string_buffer(512)
            _capi.call("sg_layer_parameter", self._handle, index, buffer, 512, None,
                       *[ctypes.byref(h) for h in handles])
            out.append(Parameter(buffer.value.decode(), *[Tensor(h) for h in handles]))
        return out

    def sync_parameters(self):
        """Refreshes the dtype copies from the fp32 masters (after writing masters from outside)."""
        _capi.call("sg_layer_sync_parameters", self._handle)


def _sizes(owner, **sizes):
    """Each size (hidden, ffn, in_features, ...) as an int in [1, 2**63 - 1] (int64_t, > 0)."""
    return [_checks.check_int(name, value, *_checks.POSITIVE_INT64, owner) for name, value in sizes.items()]


def _seed(owner, seed):
    return _checks.check_int("seed", seed, *_checks.UINT32, owner)


def _linear_config(owner, in_features, out_features, bias, dtype, dgrad, wgrad):
    config = _capi.LinearConfig()
    _capi.lib().sg_linear_config_default(ctypes.byref(config))
    config.in_features, config.out_features = _sizes(owner, in_features=in_features, out_features=out_features)
    config.bias, config.dgrad, config.wgrad = (_checks.check_flag(name, value, owner) for name, value in
                                               (("bias", bias), ("dgrad", dgrad), ("wgrad", wgrad)))
    config.dtype = int(as_dtype(dtype))
    return config


def _fp8_args(owner, create, fp8):
    """The create function and its trailing recipe argument: the FP8 variant when a recipe is given."""
    if fp8 is None:
        return create, ()
    if not isinstance(fp8, Fp8Recipe):
        raise TypeError(f"{owner}: fp8 must be an sg.Fp8Recipe or None, got {type(fp8).__name__}")
    return create + "_fp8", (ctypes.byref(fp8._to_c(owner)),)


class Linear(Layer):
    """y = x W^T (+ b); W is [out_features, in_features]. fp8=sg.Fp8Recipe(...) runs its
    GEMMs in FP8 (features and tokens multiples of 16, 128 with block scaling)."""

    def __init__(self, ctx, in_features, out_features, bias=True, dtype="bfloat16", dgrad=True, wgrad=True,
                 name="linear", seed=1, fp8=None):
        config = _linear_config("Linear", in_features, out_features, bias, dtype, dgrad, wgrad)
        create, recipe = _fp8_args("Linear", "sg_linear_create", fp8)
        super().__init__(ctx, create, name.encode(), ctypes.byref(config), _seed("Linear", seed), *recipe)


class Norm(Layer):
    """LayerNorm ("layernorm": gamma, beta) or RMSNorm ("rmsnorm": gamma) over the last dimension."""

    def __init__(self, ctx, hidden, kind="layernorm", eps=1e-5, dtype="bfloat16", name="norm"):
        config = _capi.NormConfig()
        _capi.lib().sg_norm_config_default(ctypes.byref(config))
        (hidden,) = _sizes("Norm", hidden=hidden)
        config.kind, config.hidden, config.eps, config.dtype = _norm(kind), hidden, eps, int(as_dtype(dtype))
        super().__init__(ctx, "sg_norm_create", name.encode(), ctypes.byref(config))


class LayerNorm(Norm):
    def __init__(self, ctx, hidden, eps=1e-5, dtype="bfloat16", name="layernorm"):
        super().__init__(ctx, hidden, "layernorm", eps, dtype, name)


class RMSNorm(Norm):
    def __init__(self, ctx, hidden, eps=1e-5, dtype="bfloat16", name="rmsnorm"):
        super().__init__(ctx, hidden, "rmsnorm", eps, dtype, name)


class LayerNormLinear(Layer):
    """norm -> Linear."""

    def __init__(self, ctx, in_features, out_features, norm="layernorm", eps=1e-5, bias=True, dtype="bfloat16",
                 dgrad=True, wgrad=True, name="layernorm_linear", seed=1, fp8=None):
        config = _capi.LayerNormLinearConfig()
        _capi.lib().sg_layernorm_linear_config_default(ctypes.byref(config))
        config.norm, config.eps = _norm(norm), eps
        config.linear = _linear_config("LayerNormLinear", in_features, out_features, bias, dtype, dgrad, wgrad)
        create, recipe = _fp8_args("LayerNormLinear", "sg_layernorm_linear_create", fp8)
        super().__init__(ctx, create, name.encode(), ctypes.byref(config), _seed("LayerNormLinear", seed), *recipe)


class LayerNormMLP(Layer):
    """norm -> fc1 (hidden -> ffn) -> GeLU (tanh) -> fc2 (ffn -> hidden); parameters in order
    norm gamma[, beta], fc1 weight, fc1 bias, fc2 weight, fc2 bias."""

    def __init__(self, ctx, hidden, ffn, norm="layernorm", eps=1e-5, dtype="bfloat16", name="mlp", seed=1,
                 fp8=None):
        config = _capi.LayerNormMLPConfig()
        _capi.lib().sg_layernorm_mlp_config_default(ctypes.byref(config))
        config.hidden, config.ffn = _sizes("LayerNormMLP", hidden=hidden, ffn=ffn)
        config.norm, config.eps, config.dtype = _norm(norm), eps, int(as_dtype(dtype))
        create, recipe = _fp8_args("LayerNormMLP", "sg_layernorm_mlp_create", fp8)
        super().__init__(ctx, create, name.encode(), ctypes.byref(config), _seed("LayerNormMLP", seed), *recipe)


# The integer fields of a ResidualStack: their C types and the engine's rules (layers >= 0,
# vocab > 0, ...); topk and moe_every matter only with experts > 0, where the engine checks
# the combination (topk 1 or 2, moe_every in [1, layers]).
_MODEL_RANGES = {"hidden": _checks.POSITIVE_INT64, "ffn": _checks.POSITIVE_INT64, "layers": _checks.NON_NEGATIVE_INT64,
                 "vocab": _checks.POSITIVE_INT64, "seed": _checks.UINT32, "experts": _checks.NON_NEGATIVE_INT64,
                 "topk": _checks.INT64, "moe_every": _checks.INT64}


def _model_defaults():
    config = _capi.ResidualStackConfig()
    _capi.lib().sg_residual_stack_config_default(ctypes.byref(config))
    return config


class ResidualStack(Layer):
    """The residual trunk of a language model, fed activations: residual blocks
    h = h + LayerNormMLP(h), a final norm and an LM head; forward takes x [tokens, hidden] and
    gives logits [tokens, vocab]. experts > 0 makes every moe_every-th block a mixture of experts
    routing each token to its topk experts (topk 1 or 2, at most experts); a bad combination
    raises StepGraphError when the stack is built. Unset arguments take the engine's defaults.

    tensor_parallel=world (a World from init_distributed) shards the stack over the world's ranks
    (tensor and sequence parallelism): each rank's forward takes its rows x [tokens / N, hidden] and
    gives every rank's tokens' logits over its vocabulary slice [tokens, vocab / N]; a TrainStep of
    it (tokens = this rank's rows, no world of its own) trains on each rank's rows. overlap: how the
    collectives meet their GEMMs, "none", "bulk" (default), "overlap" or four modes."""

    def __init__(self, ctx, hidden=None, ffn=None, layers=None, vocab=None, norm="layernorm", eps=None,
                 dtype="bfloat16", seed=None, experts=None, topk=None, moe_every=None, tensor_parallel=None,
                 overlap="bulk"):
        config = _model_defaults()
        values = {"hidden": hidden, "ffn": ffn, "layers": layers, "vocab": vocab, "seed": seed, "experts": experts,
                  "topk": topk, "moe_every": moe_every}
        for field, value in values.items():
            if value is not None:
                setattr(config, field, _checks.check_int(field, value, *_MODEL_RANGES[field], "ResidualStack"))
        if eps is not None:
            config.eps = eps
        config.norm, config.dtype = _norm(norm), int(as_dtype(dtype))
        self.config = {name: getattr(config, name) for name, _ in _capi.ResidualStackConfig._fields_}
        self.ctx = ctx
        self._handle = _capi.new_handle()
        if tensor_parallel is None:
            _capi.call("sg_residual_stack_create", ctx.handle, ctypes.byref(config), ctypes.byref(self._handle))
        else:
            if not isinstance(overlap, str):
                raise TypeError(f"ResidualStack: overlap must be a str such as 'bulk', got {type(overlap).__name__}")
            _capi.call("sg_residual_stack_create_tensor_parallel", ctx.handle, ctypes.byref(config),
                       tensor_parallel._handle, overlap.encode(), ctypes.byref(self._handle))
