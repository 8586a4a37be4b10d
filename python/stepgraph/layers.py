"""Layers: Linear, LayerNorm/RMSNorm, LayerNormLinear, LayerNormMLP and ResidualStack.

Every layer's forward returns (y, saved) and its backward takes saved and dy,
writes the parameter gradients (fp32, overwritten) and returns dx:

    y, saved = mlp.forward(x)
    dx = mlp.backward(saved, dy)

The same calls run now (eager) or are recorded inside a captured step function.
"""

import collections
import ctypes
import math

from stepgraph import _capi, _checks
from stepgraph.context import Context
from stepgraph.distributed import World
from stepgraph.fp8 import Fp8Recipe
from stepgraph.dtypes import as_dtype
from stepgraph.graph import tracing
from stepgraph.tensor import Tensor

_NORMS = {"layernorm": 0, "rmsnorm": 1}

Forward = collections.namedtuple("Forward", ["y", "saved"])
Parameter = collections.namedtuple("Parameter", ["name", "master", "value", "grad"])
Parameter.__doc__ = ("A parameter: fp32 master weight, the copy in the layer dtype the forward reads "
                     "(the master itself in fp32), and the fp32 gradient.")


def _norm(owner, kind, name="norm"):
    return _NORMS[_checks.check_choice(name, kind, _NORMS, owner)]


def _eps(owner, eps):
    """The norm's epsilon as the float32 the C API stores: finite and >= 0 (1e40 would be inf)."""
    return _checks.check_float32("eps", eps, 0.0, math.inf, owner=owner)


def _context(owner, ctx):
    return _checks.check_instance("ctx", ctx, Context, "a stepgraph Context", owner)


class Saved:
    """What a layer's backward needs from its forward (opaque). It keeps the forward's input
    alive: the layer may read it again in the backward (a saved reference, never a copy), so
    a wrapped torch or CuPy array must not go back to its allocator before the backward ran."""

    def __init__(self, handle, keeps=None):
        self._handle = None
        self._handle = _checks.check_handle(handle, "a Saved is made by a layer's forward")
        self._keeps = keeps

    def __del__(self):
        _capi.destroy("sg_saved_destroy", getattr(self, "_handle", None))
        self._handle = None


class Layer:
    """Base of every layer: forward, backward, parameters."""

    # An FP8 layer whose recipe says on_non_finite="stop": its eager forward and backward check
    # the device's count of non-finite amaxes after they run (see check_errors).
    _stops_on_non_finite = False

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
        _checks.check_instance("x", x, Tensor, "a stepgraph Tensor (ctx.wrap or ctx.from_numpy)",
                               f"{type(self).__name__}.forward")
        y, saved = _capi.new_handle(), _capi.new_handle()
        _capi.call("sg_layer_forward", self._handle, x._handle, ctypes.byref(y), ctypes.byref(saved))
        out = Forward(Tensor(y), Saved(saved, keeps=x))
        self._check_eager()
        return out

    def __call__(self, x):
        return self.forward(x).y

    def backward(self, saved, dy):
        """dx (None when the layer computes none); writes every parameter gradient."""
        owner = f"{type(self).__name__}.backward"
        _checks.check_instance("saved", saved, Saved, "the Saved of this layer's forward", owner)
        _checks.check_instance("dy", dy, Tensor, "a stepgraph Tensor", owner)
        dx = _capi.new_handle()
        _capi.call("sg_layer_backward", self._handle, saved._handle, dy._handle, ctypes.byref(dx))
        out = Tensor._adopt(dx)
        self._check_eager()
        return out

    def check_errors(self):
        """Raises StepGraphError for what the layer counted on the device since it was built: FP8
        quantizations that met a non-finite amax where the recipe's on_non_finite is "stop"
        (a NaN or infinity in an input, weight or gradient), and a ResidualStack's MoE routing
        errors. Reads the device (it waits for the work so far). Eager forward and backward of a
        "stop" layer call it themselves; call it after a captured step's replay()."""
        _capi.call("sg_layer_check_errors", self._handle)

    def _check_eager(self):
        if self._stops_on_non_finite and not tracing():
            self.check_errors()

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


def _name(owner, name):
    return _checks.check_name("name", name, owner)


def _linear_fields(owner, config, in_features, out_features, bias, dtype, dgrad, wgrad):
    """Sets a Linear's fields of `config` (an sg_linear_config or sg_layernorm_linear_config); returns it."""
    config.in_features, config.out_features = _sizes(owner, in_features=in_features, out_features=out_features)
    config.bias, config.dgrad, config.wgrad = (_checks.check_flag(name, value, owner) for name, value in
                                               (("bias", bias), ("dgrad", dgrad), ("wgrad", wgrad)))
    config.dtype = int(as_dtype(dtype, "dtype", owner))
    return config


def _defaults(structure, default_function):
    config = structure()
    getattr(_capi.lib(), default_function)(ctypes.byref(config))
    return config


def _set_fp8(owner, config, fp8):
    """config.fp8 and config.fp8_recipe from `fp8` (an Fp8Recipe, or None for 16-bit GEMMs)."""
    if fp8 is not None:
        _checks.check_instance("fp8", fp8, Fp8Recipe, "an sg.Fp8Recipe or None", owner)
        config.fp8, config.fp8_recipe = 1, fp8._to_c(owner)
    return config


def _stops(fp8):
    return fp8 is not None and fp8.on_non_finite == "stop"


class Linear(Layer):
    """y = x W^T (+ b); W is [out_features, in_features]. fp8=sg.Fp8Recipe(...) runs its
    GEMMs in FP8 (features and tokens multiples of 16, 128 with block scaling)."""

    def __init__(self, ctx, in_features, out_features, bias=True, dtype="bfloat16", dgrad=True, wgrad=True,
                 name="linear", seed=1, fp8=None):
        _context("Linear", ctx)
        config = _linear_fields("Linear", _defaults(_capi.LinearConfig, "sg_linear_config_default"), in_features,
                                out_features, bias, dtype, dgrad, wgrad)
        _set_fp8("Linear", config, fp8)
        super().__init__(ctx, "sg_linear_create", _name("Linear", name), ctypes.byref(config), _seed("Linear", seed))
        self._stops_on_non_finite = _stops(fp8)


class Norm(Layer):
    """LayerNorm ("layernorm": gamma, beta) or RMSNorm ("rmsnorm": gamma) over the last dimension."""

    def __init__(self, ctx, hidden, kind="layernorm", eps=1e-5, dtype="bfloat16", name="norm"):
        owner = type(self).__name__
        _context(owner, ctx)
        config = _defaults(_capi.NormConfig, "sg_norm_config_default")
        (hidden,) = _sizes(owner, hidden=hidden)
        config.kind, config.hidden = _norm(owner, kind, "kind"), hidden
        config.eps, config.dtype = _eps(owner, eps), int(as_dtype(dtype, "dtype", owner))
        super().__init__(ctx, "sg_norm_create", _name(owner, name), ctypes.byref(config))


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
        _context("LayerNormLinear", ctx)
        config = _defaults(_capi.LayerNormLinearConfig, "sg_layernorm_linear_config_default")
        config.norm, config.eps = _norm("LayerNormLinear", norm), _eps("LayerNormLinear", eps)
        _linear_fields("LayerNormLinear", config, in_features, out_features, bias, dtype, dgrad, wgrad)
        _set_fp8("LayerNormLinear", config, fp8)
        super().__init__(ctx, "sg_layernorm_linear_create", _name("LayerNormLinear", name), ctypes.byref(config),
                         _seed("LayerNormLinear", seed))
        self._stops_on_non_finite = _stops(fp8)


class LayerNormMLP(Layer):
    """norm -> fc1 (hidden -> ffn) -> GeLU (tanh) -> fc2 (ffn -> hidden); parameters in order
    norm gamma[, beta], fc1 weight, fc1 bias, fc2 weight, fc2 bias."""

    def __init__(self, ctx, hidden, ffn, norm="layernorm", eps=1e-5, dtype="bfloat16", name="mlp", seed=1,
                 fp8=None):
        _context("LayerNormMLP", ctx)
        config = _defaults(_capi.LayerNormMLPConfig, "sg_layernorm_mlp_config_default")
        config.hidden, config.ffn = _sizes("LayerNormMLP", hidden=hidden, ffn=ffn)
        config.norm, config.eps = _norm("LayerNormMLP", norm), _eps("LayerNormMLP", eps)
        config.dtype = int(as_dtype(dtype, "dtype", "LayerNormMLP"))
        _set_fp8("LayerNormMLP", config, fp8)
        super().__init__(ctx, "sg_layernorm_mlp_create", _name("LayerNormMLP", name), ctypes.byref(config),
                         _seed("LayerNormMLP", seed))
        self._stops_on_non_finite = _stops(fp8)


# The integer fields of a ResidualStack: their C types and the engine's rules (layers >= 0,
# vocab > 0, ...); topk and moe_every matter only with experts > 0, where the engine checks
# the combination (topk 1 or 2, moe_every in [1, layers]).
_MODEL_RANGES = {"hidden": _checks.POSITIVE_INT64, "ffn": _checks.POSITIVE_INT64, "layers": _checks.NON_NEGATIVE_INT64,
                 "vocab": _checks.POSITIVE_INT64, "seed": _checks.UINT32, "experts": _checks.NON_NEGATIVE_INT64,
                 "topk": _checks.INT64, "moe_every": _checks.INT64}


def _model_defaults():
    return _defaults(_capi.ResidualStackConfig, "sg_residual_stack_config_default")


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
    collectives meet their GEMMs, "none", "bulk" (default), "overlap" or four modes; it is refused
    without tensor_parallel, where it would have no effect."""

    def __init__(self, ctx, hidden=None, ffn=None, layers=None, vocab=None, norm="layernorm", eps=None,
                 dtype="bfloat16", seed=None, experts=None, topk=None, moe_every=None, tensor_parallel=None,
                 overlap=None):
        _context("ResidualStack", ctx)
        config = _model_defaults()
        values = {"hidden": hidden, "ffn": ffn, "layers": layers, "vocab": vocab, "seed": seed, "experts": experts,
                  "topk": topk, "moe_every": moe_every}
        for field, value in values.items():
            if value is not None:
                setattr(config, field, _checks.check_int(field, value, *_MODEL_RANGES[field], "ResidualStack"))
        if not config.experts:
            for field, value in (("topk", topk), ("moe_every", moe_every)):
                if value is not None:  # it would be ignored: no block is a mixture of experts
                    raise _checks.ArgumentError(f"ResidualStack: {field}={value!r} applies to mixture-of-experts "
                                                f"blocks only; set experts > 0 too, or leave {field} out")
        if eps is not None:
            config.eps = _eps("ResidualStack", eps)
        config.norm, config.dtype = _norm("ResidualStack", norm), int(as_dtype(dtype, "dtype", "ResidualStack"))
        if overlap is not None:
            overlap = _checks.check_name("overlap", overlap, "ResidualStack")
        if tensor_parallel is not None:
            _checks.check_instance("tensor_parallel", tensor_parallel, World,
                                   "a stepgraph World (from init_distributed) or None", "ResidualStack")
            overlap = b"bulk" if overlap is None else overlap
        elif overlap is not None:
            # It would be ignored: only a tensor-parallel stack has collectives to overlap.
            raise _checks.ArgumentError(f"ResidualStack: overlap={overlap.decode()!r} applies to a tensor-parallel "
                                        f"stack only; pass tensor_parallel=world too, or leave overlap out")
        self.config = {name: getattr(config, name) for name, _ in _capi.ResidualStackConfig._fields_
                       if name not in ("size", "magic", "version", "tensor_parallel", "overlap")}
        if tensor_parallel is not None:
            config.tensor_parallel, config.overlap = tensor_parallel.handle.value, overlap
        self.ctx = ctx
        self._handle = _capi.new_handle()
        _capi.call("sg_residual_stack_create", ctx.handle, ctypes.byref(config), ctypes.byref(self._handle))
