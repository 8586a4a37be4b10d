"""AdamW and the whole training step of a ResidualStack (forward, cross-entropy, backward, AdamW)."""

import ctypes
import math

import numpy as np

from stepgraph import _capi, _checks
from stepgraph.distributed import World
from stepgraph.dtypes import to_storage
from stepgraph.graph import CapturedStep, policy_value
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
        if kind not in _SCHEDULE_KINDS:
            raise ValueError(f"LrSchedule: kind must be one of {sorted(_SCHEDULE_KINDS)}, got {kind!r}")
        self.kind, self.base, self.min_lr, self.warmup, self.total = kind, base, min_lr, warmup, total

    def __repr__(self):
        return (f"LrSchedule({self.kind!r}, base={self.base}, min_lr={self.min_lr}, warmup={self.warmup}, "
                f"total={self.total})")


class AdamW:
    """AdamW over the parameters of `layers` (one layer or a list), one multi-tensor op per step.
    The rate is a device scalar every update reads: `lr` at first, then `set_lr(value)` between steps, or,
    with `schedule` (an LrSchedule, whose base replaces lr), the schedule's rate of each step."""

    def __init__(self, ctx, layers, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, schedule=None):
        layers = [layers] if isinstance(layers, Layer) else list(layers)
        for layer in layers:
            if not isinstance(layer, Layer):
                raise TypeError(f"AdamW: layers must be stepgraph layers (a model or a list of layers), got "
                                f"{type(layer).__name__}")
        if isinstance(betas, (str, bytes)) or len(betas) != 2:
            raise TypeError(f"AdamW: betas must be a pair (beta1, beta2), got {betas!r}")
        # The engine's rules (kernels/adamw.cu check_adamw_hyper), on the float32 values it stores.
        config = _capi.AdamWConfig(_checks.check_float32("lr", lr, 0.0, math.inf, owner="AdamW"),
                                   _checks.check_float32("beta1", betas[0], 0.0, 1.0, hi_open=True, owner="AdamW"),
                                   _checks.check_float32("beta2", betas[1], 0.0, 1.0, hi_open=True, owner="AdamW"),
                                   _checks.check_float32("eps", eps, 0.0, math.inf, owner="AdamW"),
                                   _checks.check_float32("weight_decay", weight_decay, 0.0, math.inf, owner="AdamW"))
        self._layers = layers  # the parameters' owners
        handles = (ctypes.c_void_p * len(layers))(*[layer._handle.value for layer in layers])
        self._handle = _capi.new_handle()
        if schedule is None:
            _capi.call("sg_adamw_create", ctx.handle, handles, len(layers), ctypes.byref(config),
                       ctypes.byref(self._handle))
        else:
            if not isinstance(schedule, LrSchedule):
                raise TypeError(f"AdamW: schedule must be a stepgraph.LrSchedule, got {type(schedule).__name__}")
            plan = _capi.LrSchedule(_SCHEDULE_KINDS[schedule.kind],
                                    _checks.check_float32("schedule.base", schedule.base, 0.0, math.inf, owner="AdamW"),
                                    _checks.check_float32("schedule.min_lr", schedule.min_lr, 0.0, math.inf,
                                                          owner="AdamW"),
                                    int(schedule.warmup), int(schedule.total))
            _capi.call("sg_adamw_create_scheduled", ctx.handle, handles, len(layers), ctypes.byref(config),
                       ctypes.byref(plan), ctypes.byref(self._handle))

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
    def steps_taken(self):
        value = ctypes.c_int64()
        _capi.call("sg_optimizer_steps_taken", self._handle, ctypes.byref(value))
        return value.value


class TrainStep:
    """One training step of `model` (a ResidualStack) over `tokens` tokens. Its inputs are persistent
    tensors: `x` [tokens, hidden] in the model dtype and `labels` [tokens] int32.

        step = TrainStep(model, AdamW(ctx, model), tokens=64)
        step.load(x, labels)
        loss = step().item()              # eager
        graph = step.capture()            # or one graph, replayed

    With `world` (from init_distributed) the step is data parallel: `tokens` is this rank's share,
    each rank loads its own slice of a global batch of world.size * tokens rows, the gradients are
    summed across the ranks inside the step (captured too), and the loss is the global mean, the
    same on every rank. Every rank builds the same model (same seed), optimizer and step, and runs
    or captures the same steps.
    """

    def __init__(self, model, optimizer, tokens, world=None):
        if not isinstance(model, ResidualStack):
            raise TypeError(f"TrainStep needs a stepgraph ResidualStack, got {type(model).__name__}")
        if not isinstance(optimizer, AdamW):
            raise TypeError(f"TrainStep needs a stepgraph AdamW, got {type(optimizer).__name__}")
        if world is not None and not isinstance(world, World):
            raise TypeError(f"TrainStep: world must be a stepgraph World (from init_distributed) or None, got "
                            f"{type(world).__name__}")
        tokens = _checks.check_int("tokens", tokens, *_checks.POSITIVE_INT64, "TrainStep")
        self.model, self.optimizer, self.world = model, optimizer, world
        config = _capi.TrainStepConfig()
        _capi.lib().sg_train_step_config_default(ctypes.byref(config))
        config.tokens = tokens
        config.world = world.handle.value if world is not None else None
        self._handle = _capi.new_handle()
        _capi.call("sg_train_step_create_with_config", model._handle, optimizer._handle, ctypes.byref(config),
                   ctypes.byref(self._handle))
        x, labels = _capi.new_handle(), _capi.new_handle()
        _capi.call("sg_train_step_inputs", self._handle, ctypes.byref(x), ctypes.byref(labels))
        self.x, self.labels = Tensor(x), Tensor(labels)

    def __del__(self):
        _capi.destroy("sg_train_step_destroy", getattr(self, "_handle", None))
        self._handle = None

    def load(self, x, labels):
        """Copies a batch into the step's inputs: x of shape [tokens, hidden] (floats rounded to the
        model dtype), labels of shape [tokens], an integer array with every value in [0, vocab) or
        IGNORE_INDEX (-100: the token counts for nothing in the loss). Both are checked before
        either is copied."""
        labels = _checks.check_array_shape("labels", labels, self.labels.shape, "int32", "TrainStep.load")
        if labels.dtype.kind not in "iu":
            raise TypeError(f"TrainStep.load: labels must be an integer array (class indices), got {labels.dtype}; "
                            f"floats would be truncated into classes")
        vocab = self.model.config["vocab"]
        _checks.check_values("labels", labels, 0, vocab - 1, allowed=(IGNORE_INDEX,), owner="TrainStep.load",
                             note=f"; labels are classes in [0, vocab = {vocab}), or {IGNORE_INDEX} for a token "
                                  f"the loss skips")
        x = _checks.check_array_shape("x", x, self.x.shape, self.x.dtype.short_name, "TrainStep.load")
        data = to_storage(x, self.x.dtype, "TrainStep.load: x")
        self.x.copy_from(data, "TrainStep.load: x")
        self.labels.copy_from(labels.astype(np.int32), "TrainStep.load: labels")

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
        handle = _capi.new_handle()
        _capi.call("sg_train_step_capture", self._handle, policy_value(policy), ctypes.byref(handle))
        return CapturedStep(handle, keep_alive=self)
