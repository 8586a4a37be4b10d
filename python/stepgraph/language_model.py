"""LanguageModel: the trainer's model (layers/language_model.h) built from Python, a GPT or the
window model, trained by a TrainStep on token ids.

    model = sg.LanguageModel(ctx, vocab=256, hidden=64, layers=2, heads=4, ffn=256, seq_len=32)
    step = sg.TrainStep(model, sg.AdamW(ctx, model, lr=3e-3), tokens=8 * 32)   # 8 sequences of 32
    step.load(tokens, labels)                      # token ids [256], each one's next token
    loss = step().item()
"""

import ctypes
import math

from stepgraph import _capi, _checks
from stepgraph.distributed import World
from stepgraph.dtypes import as_dtype
from stepgraph.fp8 import Fp8Recipe
from stepgraph.layers import Layer, _context, _eps, _norm

# The integer fields and their C types with the engine's rules; the engine checks how they
# relate (hidden a multiple of heads, kv_heads dividing heads, topk <= experts, ...).
_RANGES = {"vocab": _checks.POSITIVE_INT64, "hidden": _checks.POSITIVE_INT64, "ffn": _checks.POSITIVE_INT64,
           "layers": _checks.NON_NEGATIVE_INT64, "heads": _checks.NON_NEGATIVE_INT64,
           "kv_heads": _checks.NON_NEGATIVE_INT64, "context": _checks.POSITIVE_INT64, "seed": _checks.UINT32,
           "experts": _checks.NON_NEGATIVE_INT64, "topk": _checks.INT64, "moe_every": _checks.INT64}


def _defaults():
    config = _capi.LanguageModelConfig()
    _capi.lib().sg_language_model_config_default(ctypes.byref(config))
    return config


class LanguageModel(Layer):
    """Next-token prediction, the C++ trainer's model, with the trainer's options as arguments:

    heads > 0 (default 4), a GPT: an embedding, `layers` TransformerLayers (causal attention over
    packed sequences of `seq_len` tokens with rotary positions, `kv_heads` key/value heads: fewer
    than heads is grouped-query attention; then an MLP of `ffn`), a final norm and an LM head of
    `vocab` logits, every next token predicted. heads = 0, the window model: one prediction per
    example from a window of `context` tokens by MLP blocks (hidden a multiple of context).

    vocab is the head's width: a multiple of 8 (the trainer rounds its data's vocabulary up to
    that). experts > 0 makes every moe_every-th block a mixture of experts routing each token to
    its topk. dropout in [0, 1) on the stack's input and every attention and MLP output (Philox
    on the device: eager and captured draw alike). fp8=sg.Fp8Recipe(...) runs the blocks' GEMMs
    in FP8; fp8_weight_cache=True quantizes each weight once per update. recompute_activation
    keeps fc1's pre-activation only. tensor_parallel=world shards the blocks and the head over
    the world's ranks (overlap: "none", "bulk" (default), "overlap" or four modes).
    context_parallel=world splits the GPT's sequences over the world's ranks (the trainer's --cp:
    each rank holds its zig-zag chunks of the batch's tokens; its TrainStep's world is this world,
    or the data x context parallel one). Unset arguments take the engine's
    defaults. Its input is token ids with their packing, which a TrainStep holds: it has no
    forward of its own (a StepGraphError); train it with a TrainStep."""

    def __init__(self, ctx, vocab=None, hidden=None, layers=None, heads=None, kv_heads=None, ffn=None,
                 seq_len=None, context=None, norm="layernorm", eps=None, dtype="bfloat16", seed=None, experts=None,
                 topk=None, moe_every=None, rope_base=None, dropout=0.0, recompute_activation=False, fp8=None,
                 fp8_weight_cache=False, tensor_parallel=None, overlap=None, context_parallel=None):
        owner = "LanguageModel"
        _context(owner, ctx)
        config = _defaults()
        values = {"vocab": vocab, "hidden": hidden, "ffn": ffn, "layers": layers, "heads": heads,
                  "kv_heads": kv_heads, "seed": seed, "experts": experts, "topk": topk, "moe_every": moe_every}
        for field, value in values.items():
            if value is not None:
                setattr(config, field, _checks.check_int(field, value, *_RANGES[field], owner))
        # The trainer's two flags: --seq-len for the GPT, --context for the window model.
        lengths = {name: _checks.check_int(name, value, *_RANGES["context"], owner)
                   for name, value in (("seq_len", seq_len), ("context", context)) if value is not None}
        length_name = "seq_len" if config.heads > 0 else "context"
        wrong = "context" if config.heads > 0 else "seq_len"
        given = lengths.get(wrong)
        if given is not None:
            raise _checks.ArgumentError(
                f"{owner}: {wrong}={given!r} is the " + ("window model's (heads=0)" if wrong == "context" else
                                                         "GPT's (heads > 0)") +
                f" length; this model has heads={config.heads}, so pass {length_name}")
        if length_name in lengths:
            config.context = lengths[length_name]
        if not config.experts:
            for field, value in (("topk", topk), ("moe_every", moe_every)):
                if value is not None:  # it would be ignored: no block is a mixture of experts
                    raise _checks.ArgumentError(f"{owner}: {field}={value!r} applies to mixture-of-experts blocks "
                                                f"only; set experts > 0 too, or leave {field} out")
        if not config.heads:
            for field, value in (("kv_heads", kv_heads), ("rope_base", rope_base)):
                if value is not None:  # it would be ignored: the window model has no attention
                    raise _checks.ArgumentError(f"{owner}: {field}={value!r} applies to attention (heads > 0); "
                                                f"the window model (heads=0) has none, so leave {field} out")
        if rope_base is not None:
            config.rope_base = _checks.check_float32("rope_base", rope_base, 1.0, math.inf, owner=owner)
        if eps is not None:
            config.eps = _eps(owner, eps)
        config.norm, config.dtype = _norm(owner, norm), int(as_dtype(dtype, "dtype", owner))
        config.dropout = _checks.check_float32("dropout", dropout, 0.0, 1.0, hi_open=True, owner=owner)
        config.recompute_activation = _checks.check_flag("recompute_activation", recompute_activation, owner)
        config.fp8_weight_cache = _checks.check_flag("fp8_weight_cache", fp8_weight_cache, owner)
        if fp8 is not None:
            _checks.check_instance("fp8", fp8, Fp8Recipe, "an sg.Fp8Recipe or None", owner)
            config.fp8, config.fp8_recipe = 1, fp8._to_c(owner)
        elif config.fp8_weight_cache:  # it would be ignored: no FP8 weights to cache
            raise _checks.ArgumentError(f"{owner}: fp8_weight_cache=True caches FP8 weights; pass fp8=sg.Fp8Recipe"
                                        f"(...) too, or leave it out")
        if overlap is not None:
            overlap = _checks.check_name("overlap", overlap, owner)
            if tensor_parallel is None:  # it would be ignored: no collectives to overlap
                raise _checks.ArgumentError(f"{owner}: overlap={overlap.decode()!r} applies to a tensor-parallel "
                                            f"model only; pass tensor_parallel=world too, or leave overlap out")
        if tensor_parallel is not None:
            _checks.check_instance("tensor_parallel", tensor_parallel, World,
                                   "a stepgraph World (from init_distributed) or None", owner)
            config.tensor_parallel = tensor_parallel.handle.value
        config.overlap = overlap
        if context_parallel is not None:
            _checks.check_instance("context_parallel", context_parallel, World,
                                   "a stepgraph World (from init_distributed) or None", owner)
            config.context_parallel = context_parallel.handle.value
        self.context_parallel = context_parallel
        self.fp8 = fp8
        self.tensor_parallel = tensor_parallel
        self.config = {name: getattr(config, name) for name, _ in _capi.LanguageModelConfig._fields_
                       if name not in ("size", "magic", "version", "fp8_recipe", "tensor_parallel", "overlap",
                                       "context_parallel")}
        self.config["seq_len" if config.heads > 0 else "context"] = self.config.pop("context")
        self.ctx = ctx
        self._handle = _capi.new_handle()
        _capi.call("sg_language_model_create", ctx.handle, ctypes.byref(config), ctypes.byref(self._handle))
        self._stops_on_non_finite = fp8 is not None and fp8.on_non_finite == "stop"

    @property
    def sequence_model(self):
        """True for the GPT (heads > 0), False for the window model."""
        return self.config["heads"] > 0

    @property
    def length(self):
        """Tokens per sequence (GPT) or per example (window model)."""
        return self.config["seq_len" if self.sequence_model else "context"]

    def __repr__(self):
        config = getattr(self, "config", None)
        if config is None:
            return "<stepgraph.LanguageModel (not built)>"
        return f"<stepgraph.LanguageModel {'GPT' if self.sequence_model else 'window model'} {config}>"
