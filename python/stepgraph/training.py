"""AdamW and the whole training step of a ResidualStack (forward, cross-entropy, backward, AdamW)."""

import ctypes

import numpy as np

from stepgraph import _capi
from stepgraph.graph import CapturedStep, policy_value
from stepgraph.layers import Layer, ResidualStack
from stepgraph.tensor import Tensor


class AdamW:
    """AdamW over the parameters of `layers` (one layer or a list), one multi-tensor op per step."""

    def __init__(self, ctx, layers, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        layers = [layers] if isinstance(layers, Layer) else list(layers)
        self._layers = layers  # the parameters' owners
        config = _capi.AdamWConfig(lr, betas[0], betas[1], eps, weight_decay)
        handles = (ctypes.c_void_p * len(layers))(*[layer._handle.value for layer in layers])
        self._handle = _capi.new_handle()
        _capi.call("sg_adamw_create", ctx.handle, handles, len(layers), ctypes.byref(config),
                   ctypes.byref(self._handle))

    def __del__(self):
        _capi.destroy("sg_optimizer_destroy", getattr(self, "_handle", None))
        self._handle = None

    def step(self):
        _capi.call("sg_optimizer_step", self._handle)

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
    """

    def __init__(self, model, optimizer, tokens):
        if not isinstance(model, ResidualStack):
            raise TypeError(f"TrainStep needs a stepgraph ResidualStack, got {type(model).__name__}")
        self.model, self.optimizer = model, optimizer
        self._handle = _capi.new_handle()
        _capi.call("sg_train_step_create", model._handle, optimizer._handle, tokens, ctypes.byref(self._handle))
        x, labels = _capi.new_handle(), _capi.new_handle()
        _capi.call("sg_train_step_inputs", self._handle, ctypes.byref(x), ctypes.byref(labels))
        self.x, self.labels = Tensor(x), Tensor(labels)

    def __del__(self):
        _capi.destroy("sg_train_step_destroy", getattr(self, "_handle", None))
        self._handle = None

    def load(self, x, labels):
        """Copies a batch into the step's inputs (x floats are rounded to the model dtype)."""
        self.x.copy_from(x)
        self.labels.copy_from(np.asarray(labels, dtype=np.int32))

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
