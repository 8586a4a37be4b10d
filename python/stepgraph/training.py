"""AdamW and the whole training step of a ResidualStack or a LanguageModel (forward, cross-entropy, backward,
AdamW)."""

import ctypes
import dataclasses
import math

import numpy as np

from stepgraph import _capi, _checks
from stepgraph.context import Context
from stepgraph.distributed import World
from stepgraph.dtypes import to_storage
from stepgraph.graph import CapturedStep, policy_value
from stepgraph.language_model import LanguageModel
from stepgraph.layers import Layer, ResidualStack
from stepgraph.tensor import Tensor

# The label the training step's cross-entropy skips (ops/loss_ops.h CrossEntropyParams::ignore_index).
IGNORE_INDEX = -100


_SCHEDULE_KINDS = {"constant": 0, "cosine": 1, "linear": 2}


class LrSchedule:
    """A learning-rate schedule computed on the device from the step counter (kernels/lr_schedule.h):
    `warmup` steps of linear warmup to `base`, then constant, cosine or linear decay to `min_lr` at step
    `total`. A captured step replays with each step's rate.

        sg.AdamW(ctx, model, schedule=sg.LrSchedule("cosine", base=3e-4, min_lr=3e-5, warmup=100, total=8000))
    """

    def __init__(self, kind="constant", base=1e-3, min_lr=0.0, warmup=0, total=0):
        self.kind, self.base, self.min_lr, self.warmup, self.total = kind, base, min_lr, warmup, total
        self._to_c("LrSchedule")  # every field checked now; AdamW checks them again (they may change)

    def _to_c(self, owner):
        """The sg_lr_schedule of this schedule, each field checked as the C API stores it (int64 steps,
        float32 rates); the engine then checks how they relate (min_lr <= base, total > warmup)."""
        schedule = _capi.LrSchedule(
            _SCHEDULE_KINDS[_checks.check_choice("kind", self.kind, _SCHEDULE_KINDS, owner)],
            _checks.check_float32("base", self.base, 0.0, math.inf, owner=owner),
            _checks.check_float32("min_lr", self.min_lr, 0.0, math.inf, owner=owner),
            _checks.check_int("warmup", self.warmup, *_checks.NON_NEGATIVE_INT64, owner),
            _checks.check_int("total", self.total, *_checks.NON_NEGATIVE_INT64, owner))
        if self.kind == "constant" and (self.min_lr != 0 or self.total != 0):
            # They would be ignored: a constant schedule has no decay.
            raise _checks.ArgumentError(f"{owner}: min_lr ({self.min_lr}) and total ({self.total}) set the decay of "
                                        f"'cosine' and 'linear' schedules; a 'constant' one ignores them, so leave "
                                        f"them out or pick a decay")
        return schedule

    def __repr__(self):
        return (f"LrSchedule({self.kind!r}, base={self.base}, min_lr={self.min_lr}, warmup={self.warmup}, "
                f"total={self.total})")


@dataclasses.dataclass(frozen=True)
class LossScaling:
    """Dynamic loss scaling on the device (Note [Loss scaling] in kernels/step_guard.h), for fp16
    models: the loss gradient is multiplied by the scale, the update divides it out; a step whose
    gradients overflow is skipped and the scale backs off, `growth_interval` good steps in a row
    grow it (the trainer's --loss-scale-interval). Factors and the initial scale are powers of two."""
    initial_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self):
        owner = "LossScaling"
        _checks.check_float32("initial_scale", self.initial_scale, 1.0, 16777216.0, owner=owner)
        _checks.check_float32("growth_factor", self.growth_factor, 1.0, math.inf, owner=owner)
        _checks.check_float32("backoff_factor", self.backoff_factor, 0.0, 1.0, owner=owner)
        _checks.check_int("growth_interval", self.growth_interval, 1, _checks.INT32[1], owner)


class AdamW:
    """AdamW over the parameters of `layers` (one layer or a list), one multi-tensor op per step.
    The rate is a device scalar every update reads: `lr` (default 1e-3) at first, then `set_lr(value)` between
    steps, or, with `schedule` (an LrSchedule, whose base is the rate: lr is then refused), the schedule's
    rate of each step.

    skip_nonfinite=True: a step whose loss or gradients are NaN or infinite changes nothing (checked on
    the device, captured too; the trainer's default, not with ZeRO-1). loss_scaling=sg.LossScaling(...)
    (or True for the defaults): dynamic loss scaling for fp16 models. step_scoped_gradients=True: each
    gradient lives from its backward to its group's update instead of for the model's life (less
    memory; not with the skip or parallelism)."""

    def __init__(self, ctx, layers, lr=None, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, schedule=None,
                 skip_nonfinite=False, loss_scaling=None, step_scoped_gradients=False):
        _checks.check_instance("ctx", ctx, Context, "a stepgraph Context", "AdamW")
        layers = [layers] if isinstance(layers, Layer) else _checks.check_sequence("layers", layers, "AdamW")
        if not layers:
            raise _checks.ArgumentError("AdamW: layers is empty; pass a model or a list of its layers")
        for index, layer in enumerate(layers):
            _checks.check_instance(f"layers[{index}]", layer, Layer,
                                   "a stepgraph layer (pass a model or a list of layers)", "AdamW")
        betas = _checks.check_sequence("betas", betas, "AdamW", length=2)
        if lr is not None and schedule is not None:
            # It would be ignored: the schedule's base is the rate.
            raise _checks.ArgumentError(f"AdamW: lr={lr!r} and a schedule were both given; the schedule's base is "
                                        f"the rate, so set LrSchedule(base=...) and leave lr out")
        lr = 1e-3 if lr is None else lr
        # The engine's rules (kernels/adamw.cu check_adamw_hyper), on the float32 values it stores.
        config = _capi.AdamWConfig(_checks.check_float32("lr", lr, 0.0, math.inf, owner="AdamW"),
                                   _checks.check_float32("beta1", betas[0], 0.0, 1.0, hi_open=True, owner="AdamW"),
                                   _checks.check_float32("beta2", betas[1], 0.0, 1.0, hi_open=True, owner="AdamW"),
                                   _checks.check_float32("eps", eps, 0.0, math.inf, owner="AdamW"),
                                   _checks.check_float32("weight_decay", weight_decay, 0.0, math.inf, owner="AdamW"))
        options = _capi.OptimizerConfig()
        _capi.lib().sg_optimizer_config_default(ctypes.byref(options))
        options.adamw = config
        if schedule is not None:
            _checks.check_instance("schedule", schedule, LrSchedule, "a stepgraph.LrSchedule or None", "AdamW")
            options.schedule, options.lr_schedule = 1, schedule._to_c("AdamW: schedule")
        options.skip_nonfinite = _checks.check_flag("skip_nonfinite", skip_nonfinite, "AdamW")
        options.step_scoped_gradients = _checks.check_flag("step_scoped_gradients", step_scoped_gradients, "AdamW")
        if loss_scaling is True:
            loss_scaling = LossScaling()
        if loss_scaling is not None:
            _checks.check_instance("loss_scaling", loss_scaling, LossScaling,
                                   "an sg.LossScaling, True (its defaults) or None", "AdamW")
            if not skip_nonfinite:  # the engine skips a step whose scaled gradients overflow
                raise _checks.ArgumentError("AdamW: loss_scaling skips the steps whose scaled gradients overflow; "
                                            "pass skip_nonfinite=True too")
            options.loss_scaling = 1
            options.loss_scale_initial = loss_scaling.initial_scale
            options.loss_scale_growth_factor = loss_scaling.growth_factor
            options.loss_scale_backoff_factor = loss_scaling.backoff_factor
            options.loss_scale_growth_interval = loss_scaling.growth_interval
        self.schedule, self.skip_nonfinite, self.loss_scaling = schedule, bool(skip_nonfinite), loss_scaling
        self.step_scoped_gradients = bool(step_scoped_gradients)
        self._layers = layers  # the parameters' owners
        handles = (ctypes.c_void_p * len(layers))(*[layer._handle.value for layer in layers])
        self._handle = _capi.new_handle()
        _capi.call("sg_optimizer_create", ctx.handle, handles, len(layers), ctypes.byref(options),
                   ctypes.byref(self._handle))

    def __del__(self):
        _capi.destroy("sg_optimizer_destroy", getattr(self, "_handle", None))
        self._handle = None

    def step(self):
        _capi.call("sg_optimizer_step", self._handle)

    def set_lr(self, lr):
        """The rate of the next steps; a step captured before takes it (an error with a schedule)."""
        _capi.call("sg_optimizer_set_lr", self._handle,
                   _checks.check_float32("lr", lr, 0.0, math.inf, owner="AdamW.set_lr"))

    @property
    def lr(self):
        """The rate the last update used (with a schedule) or the one set; reads the device."""
        value = ctypes.c_float()
        _capi.call("sg_optimizer_lr", self._handle, ctypes.byref(value))
        return value.value

    @property
    def skipped_steps(self):
        """Steps skipped as non-finite so far (0 without skip_nonfinite); reads the device."""
        value = ctypes.c_int64()
        _capi.call("sg_optimizer_skipped_steps", self._handle, ctypes.byref(value))
        return value.value

    @property
    def loss_scale(self):
        """The loss scale the next step uses (1.0 without loss scaling); reads the device."""
        value = ctypes.c_float()
        _capi.call("sg_optimizer_loss_scale", self._handle, ctypes.byref(value))
        return value.value

    @property
    def steps_taken(self):
        value = ctypes.c_int64()
        _capi.call("sg_optimizer_steps_taken", self._handle, ctypes.byref(value))
        return value.value


_DP_MODES = {"allreduce": 0, "zero1": 1}


class TrainStep:
    """One training step of `model` over `tokens` rows: forward, cross-entropy, backward, AdamW.
    Its inputs are persistent tensors, written by load():

    - a ResidualStack: `x` [tokens, hidden] in the model dtype and `labels` [tokens] int32;
    - a LanguageModel GPT: token ids `x` [tokens, 1] int32 (tokens / seq_len sequences of seq_len
      tokens; with `sequences`, up to that many sequences of any lengths, packed: pass each batch's
      packing to load), one label per token (its next token), and `packing`, the cu_seqlens
      [sequences + 1] int32;
    - a LanguageModel window model: token ids `x` [tokens, context] (one example per row), one label per
      example.

        step = TrainStep(model, AdamW(ctx, model), tokens=64)
        step.load(x, labels)
        loss = step().item()              # eager
        graph = step.capture()            # or one graph, replayed

    With `world` (from init_distributed) the step is data parallel: `tokens` is this rank's share,
    each rank loads its own slice of a global batch of world.size * tokens rows, the gradients are
    summed across the ranks inside the step (captured too), and the loss is the global mean, the
    same on every rank; dp_mode="zero1" shards the optimizer instead (reduce-scatter, 1/N update,
    all-gather). Every rank builds the same model (same seed), optimizer and step, and runs or
    captures the same steps.
    """

    def __init__(self, model, optimizer, tokens, world=None, sequences=None, dp_mode="allreduce"):
        _checks.check_instance("model", model, (ResidualStack, LanguageModel),
                               "a stepgraph ResidualStack or LanguageModel", "TrainStep")
        _checks.check_instance("optimizer", optimizer, AdamW, "a stepgraph AdamW", "TrainStep")
        if world is not None:
            _checks.check_instance("world", world, World, "a stepgraph World (from init_distributed) or None",
                                   "TrainStep")
        tokens = _checks.check_int("tokens", tokens, *_checks.POSITIVE_INT64, "TrainStep")
        dp_mode = _checks.check_choice("dp_mode", dp_mode, _DP_MODES, "TrainStep")
        self.model, self.optimizer, self.world = model, optimizer, world
        self._language_model = isinstance(model, LanguageModel)
        config = _capi.TrainStepConfig()
        _capi.lib().sg_train_step_config_default(ctypes.byref(config))
        config.tokens = tokens
        config.world = world.handle.value if world is not None else None
        if sequences is not None:
            sequences = _checks.check_int("sequences", sequences, *_checks.POSITIVE_INT64, "TrainStep")
            if not (self._language_model and model.sequence_model):
                raise _checks.ArgumentError(f"TrainStep: sequences={sequences!r} packs the sequences of a "
                                            f"LanguageModel with attention (heads > 0); this model has none, "
                                            f"so leave it out")
            config.sequences = sequences
        config.zero1 = _DP_MODES[dp_mode]
        self._handle = _capi.new_handle()
        _capi.call("sg_train_step_create", model._handle, optimizer._handle, ctypes.byref(config),
                   ctypes.byref(self._handle))
        x, labels, packing = _capi.new_handle(), _capi.new_handle(), _capi.new_handle()
        _capi.call("sg_train_step_inputs", self._handle, ctypes.byref(x), ctypes.byref(labels))
        _capi.call("sg_train_step_packing", self._handle, ctypes.byref(packing))
        self.x, self.labels = Tensor(x), Tensor(labels)
        self.packing = Tensor._adopt(packing)

    def __del__(self):
        _capi.destroy("sg_train_step_destroy", getattr(self, "_handle", None))
        self._handle = None

    def load(self, x, labels, packing=None):
        """Copies a batch into the step's inputs, every array checked before any is copied:

        - x: a ResidualStack's activations [tokens, hidden] (floats rounded to the model dtype), or a
          LanguageModel's token ids, integers in [0, vocab): [tokens] or [tokens, 1] for the GPT,
          [tokens, context] for the window model;
        - labels: integers in [0, vocab) or IGNORE_INDEX (-100: the row counts for nothing in the loss),
          one per row of the logits;
        - packing (a GPT's cu_seqlens, [sequences + 1]): where each sequence of x starts, from 0 to
          tokens, never decreasing; None keeps the packing the step has."""
        owner = "TrainStep.load"
        vocab = self.model.config["vocab"]
        labels = _checks.check_array_shape("labels", labels, self.labels.shape, "int32", owner)
        if labels.dtype.kind not in "iu":
            raise TypeError(f"{owner}: labels must be an integer array (class indices), got {labels.dtype}; "
                            f"floats would be truncated into classes")
        _checks.check_values("labels", labels, 0, vocab - 1, allowed=(IGNORE_INDEX,), owner=owner,
                             note=f"; labels are classes in [0, vocab = {vocab}), or {IGNORE_INDEX} for a row "
                                  f"the loss skips")
        if self._language_model:
            data = self._checked_tokens(x, owner)
        else:
            x = _checks.check_array_shape("x", x, self.x.shape, self.x.dtype.short_name, owner)
            data = to_storage(x, self.x.dtype, f"{owner}: x")
        cu_seqlens = None
        if packing is not None:
            cu_seqlens = self._checked_packing(packing, owner)
        self.x.copy_from(data, f"{owner}: x")
        self.labels.copy_from(labels.astype(np.int32), f"{owner}: labels")
        if cu_seqlens is not None:
            self.packing.copy_from(cu_seqlens, f"{owner}: packing")

    def _checked_tokens(self, x, owner):
        shape = self.x.shape
        x = np.asarray(x)
        if self.model.sequence_model and x.ndim == 1:
            x = x.reshape(-1, 1)  # one token per row
        x = _checks.check_array_shape("x", x, shape, "int32 token ids", owner)
        if x.dtype.kind not in "iu":
            raise TypeError(f"{owner}: x must be an integer array of token ids, got {x.dtype}")
        vocab = self.model.config["vocab"]
        _checks.check_values("x", x, 0, vocab - 1, owner=owner, note=f"; token ids are in [0, vocab = {vocab})")
        return x.astype(np.int32)

    def _checked_packing(self, packing, owner):
        if self.packing is None:
            raise _checks.ArgumentError(f"{owner}: packing is the cu_seqlens of a model with attention; this "
                                        f"model has none, so leave it out")
        packing = _checks.check_array_shape("packing", packing, self.packing.shape, "int32", owner)
        if packing.dtype.kind not in "iu":
            raise TypeError(f"{owner}: packing must be an integer array (token offsets), got {packing.dtype}")
        tokens = self.x.shape[0]
        _checks.check_values("packing", packing, 0, tokens, owner=owner,
                             note=f"; cu_seqlens are token offsets in [0, tokens = {tokens}]")
        values = packing.astype(np.int64)
        if values[0] != 0 or values[-1] != tokens or (np.diff(values) < 0).any():
            raise _checks.ArgumentError(f"{owner}: packing must start at 0, end at tokens = {tokens} and never "
                                        f"decrease (each sequence's start), got {values.tolist()}")
        return values.astype(np.int32)

    def __call__(self):
        """Runs one step now (eager); returns the loss tensor (fp32 scalar)."""
        loss = _capi.new_handle()
        _capi.call("sg_train_step_run", self._handle, ctypes.byref(loss))
        return Tensor(loss)

    def check_errors(self):
        """Raises if any label so far was outside [0, vocab) or an MoE block's routing or split
        sizes went wrong (reads device flags: after a step)."""
        _capi.call("sg_train_step_check_errors", self._handle)

    def capture(self, policy="error"):
        """The whole step captured as one graph (CUDA graphs on cuda, a planned host program on
        host); its output 0 is the loss. Replay it with graph.replay()."""
        policy = policy_value(policy, "TrainStep.capture")
        handle = _capi.new_handle()
        _capi.call("sg_train_step_capture", self._handle, policy, ctypes.byref(handle))
        return CapturedStep(handle, keep_alive=self)
