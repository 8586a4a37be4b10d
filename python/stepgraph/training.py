"""AdamW and the whole training step of a ResidualStack (forward, cross-entropy, backward, AdamW)."""

import ctypes
import math

import numpy as np

from stepgraph import _capi, _checks
from stepgraph.context import Context
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


class AdamW:
    """AdamW over the parameters of `layers` (one layer or a list), one multi-tensor op per step.
    The rate is a device scalar every update reads: `lr` (default 1e-3) at first, then `set_lr(value)` between
    steps, or, with `schedule` (an LrSchedule, whose base is the rate: lr is then refused), the schedule's
    rate of each step."""

    def __init__(self, ctx, layers, lr=None, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, schedule=None):
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
        self._layers = layers  # the parameters' owners
        handles = (ctypes.c_void_p * len(layers))(*[layer._handle.value for layer in layers])
        self._handle = _capi.new_handle()
        if schedule is None:
            _capi.call("sg_adamw_create", ctx.handle, handles, len(layers), ctypes.byref(config),
                       ctypes.byref(self._handle))
        else:
            _checks.check_instance("schedule", schedule, LrSchedule, "a stepgraph.LrSchedule or None", "AdamW")
            plan = schedule._to_c("AdamW: schedule")
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
        _checks.check_instance("model", model, ResidualStack, "a stepgraph ResidualStack", "TrainStep")
        _checks.check_instance("optimizer", optimizer, AdamW, "a stepgraph AdamW", "TrainStep")
        if world is not None:
            _checks.check_instance("world", world, World, "a stepgraph World (from init_distributed) or None",
                                   "TrainStep")
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
        policy = policy_value(policy, "TrainStep.capture")
        handle = _capi.new_handle()
        _capi.call("sg_train_step_capture", self._handle, policy, ctypes.byref(handle))
        return CapturedStep(handle, keep_alive=self)
