"""Captured steps: a Python step function (or a TrainStep) traced once, planned into
one static pool, captured into CUDA graphs (host: a planned program) and replayed.

    def step():
        y, saved = mlp.forward(x)
        mlp.backward(saved, dy)
        return y                       # outputs: a Tensor or a sequence of Tensors
    graph = stepgraph.capture(ctx, step, policy="error")
    graph.replay()                     # or graph.replay({x: batch}) to copy batch into x first
    graph.outputs[0].numpy()
"""

import ctypes
import sys
import threading
import weakref

from stepgraph import _capi, _checks
from stepgraph._library import StepGraphError
from stepgraph.tensor import Tensor

_POLICIES = {"warn": 0, "error": 1, "free": 2}

# Step functions being traced on this thread (their layer calls record, nothing runs).
_trace_depth = threading.local()


def tracing():
    """Whether a step function of this thread is being traced (inside capture or get_or_capture)."""
    return getattr(_trace_depth, "value", 0) > 0


def policy_value(policy, owner=None):
    """The sg_pool_report_policy of "warn", "error" or "free"."""
    return _POLICIES[_checks.check_choice("policy", policy, _POLICIES, owner)]


def _context(owner, ctx):
    from stepgraph.context import Context  # context imports tensor, as this module does

    return _checks.check_instance("ctx", ctx, Context, "a stepgraph Context", owner)


def _bindings(bindings):
    """replay's bindings as a list of (static, source) Tensor pairs."""
    if bindings is None:
        return []
    if isinstance(bindings, dict):
        pairs = list(bindings.items())
    else:
        pairs = _checks.check_sequence("bindings", bindings, "replay")
    for index, pair in enumerate(pairs):
        if isinstance(pair, (str, bytes)) or not hasattr(pair, "__len__") or len(pair) != 2:
            raise TypeError(f"replay: bindings[{index}] must be a pair (static input, source), got {pair!r}")
        static, source = pair
        if not isinstance(static, Tensor) or not isinstance(source, Tensor):
            raise TypeError(f"replay bindings map stepgraph Tensors to stepgraph Tensors, got "
                            f"{type(static).__name__} -> {type(source).__name__} at bindings[{index}]")
    return [tuple(pair) for pair in pairs]


class CapturedStep:
    """A captured step: replay it, read its outputs (tensors in the graph pool, valid until
    the next replay), its pool report and its plan."""

    def __init__(self, handle, keep_alive=None):
        self._handle = None
        self._handle = _checks.check_handle(handle, "a CapturedStep is made by capture(), GraphCache or "
                                                    "TrainStep.capture()")
        self._keep_alive = keep_alive
        # Output tensors handed out (a NumPy or torch view keeps its tensor alive):
        # release_pool() refuses while any is in use, since their memory is the pool.
        self._outputs_in_use = weakref.WeakSet()

    def __del__(self):
        _capi.destroy("sg_graph_destroy", getattr(self, "_handle", None))
        self._handle = None

    def replay(self, bindings=None):
        """Runs the step once. `bindings` ({static input: source} or pairs) copies each source
        into its static input (a persistent tensor the step reads) first.

        Returns before the copies run (cuda). Sources wrapped from torch or CuPy arrays may be
        dropped right away: the stream each was produced on, and torch's current stream, wait
        until the copies have read them, so the allocator's reuse of their memory cannot
        overwrite a batch before the step reads it."""
        pairs = _bindings(bindings)
        statics = (ctypes.c_void_p * max(len(pairs), 1))(*[s._handle.value for s, _ in pairs])
        sources = (ctypes.c_void_p * max(len(pairs), 1))(*[t._handle.value for _, t in pairs])
        streams = _source_streams(source for _, source in pairs)
        stream_array = (ctypes.c_void_p * max(len(streams), 1))(*streams)
        _capi.call("sg_graph_replay_ordered", self._handle, statics, sources, len(pairs), stream_array, len(streams))

    def _get(self, name, ctype):
        value = ctype()
        _capi.call(name, self._handle, ctypes.byref(value))
        return value.value

    @property
    def outputs(self):
        out = []
        for index in range(self._get("sg_graph_output_count", ctypes.c_size_t)):
            handle = _capi.new_handle()
            _capi.call("sg_graph_output", self._handle, index, ctypes.byref(handle))
            out.append(Tensor(handle))
        self._outputs_in_use.update(out)
        return out

    @property
    def replay_count(self):
        return self._get("sg_graph_replay_count", ctypes.c_int64)

    @property
    def segment_count(self):
        return self._get("sg_graph_segment_count", ctypes.c_size_t)

    @property
    def pool_bytes(self):
        return self._get("sg_graph_pool_bytes", ctypes.c_int64)

    @property
    def pool_report_count(self):
        """How many pool tensors the step kept without returning them."""
        count = ctypes.c_size_t()
        _capi.call("sg_graph_pool_report_count", self._handle, ctypes.byref(count), None)
        return count.value

    @property
    def pool_report(self):
        """The pool report as text ("N tensor(s) in the graph pool not returned as outputs ...")."""
        return _capi.string_out("sg_graph_pool_report", self._handle)

    def dump(self):
        """The program and its plan, as text."""
        return _capi.string_out("sg_graph_dump", self._handle)

    def profile(self):
        """Runs the step once more with a timing mark around every op (a real step: an optimizer update
        happens as in a replay) and returns the table of when each op ran, as text (the trainer's
        --profile)."""
        _capi.call("sg_graph_profile", self._handle)
        return _capi.string_out("sg_graph_last_profile", self._handle)

    def release_pool(self):
        """Frees the pool now; replaying or reading the outputs afterwards is an error. Refused
        while an output tensor taken from `outputs`, or a NumPy or torch view of one, is still
        alive: a view reads the pool's memory directly and would read freed memory."""
        in_use = list(self._outputs_in_use)
        if in_use:
            names = ", ".join(sorted({repr(tensor.name) for tensor in in_use}))
            raise StepGraphError(f"release_pool: {len(in_use)} output tensor(s) of this graph ({names}) or NumPy/"
                                 f"torch views of them are still in use, and their memory is the pool; drop them "
                                 f"(del) first")
        _capi.call("sg_graph_release_pool", self._handle)


def _source_streams(sources):
    """The streams that may reuse the sources' memory: each wrapped source's producer stream
    and, once torch is in use, torch's current stream (deduplicated; 0 is the legacy stream)."""
    streams = {source._source_stream for source in sources if source._source_stream is not None}
    torch = sys.modules.get("torch")
    if streams and torch is not None and torch.cuda.is_initialized():
        streams.add(torch.cuda.current_stream().cuda_stream)
    return sorted(streams)


class _StepFunction:
    """A Python step function as an sg_step_fn; keeps the exception it raised."""

    def __init__(self, fn):
        self.fn = fn
        self.error = None
        self.c_function = _capi.STEP_FN(self._call)

    def _call(self, _user, outputs, capacity, count):
        written = 0
        _trace_depth.value = getattr(_trace_depth, "value", 0) + 1
        try:
            try:
                result = self.fn()
            finally:
                _trace_depth.value -= 1
            tensors = [result] if isinstance(result, Tensor) else list(result or [])
            if len(tensors) > capacity:
                raise StepGraphError(f"a step function returns at most {capacity} tensors, got {len(tensors)}")
            for tensor in tensors:
                if not isinstance(tensor, Tensor):
                    raise TypeError(f"a step function returns stepgraph Tensors, got {type(tensor).__name__}")
                handle = _capi.new_handle()
                _capi.call("sg_tensor_retain", tensor._handle, ctypes.byref(handle))
                outputs[written] = handle.value
                written += 1
            count[0] = written
            return 0
        except BaseException as error:  # noqa: BLE001 - re-raised by run() after the C call returns
            self.error = error
            count[0] = written  # StepGraph owns (and frees) the handles written so far
            _capi.lib().sg_step_error(f"{type(error).__name__}: {error}".encode("utf-8", "replace"))
            return 1

    def run(self, name, *args):
        """Calls sg_<name>(..., this function, NULL, ...) and re-raises the step function's own error."""
        try:
            _capi.call(name, *args)
        except StepGraphError:
            if self.error is not None:
                raise self.error
            raise


def capture(ctx, fn, policy="warn"):
    """Traces `fn()` once on `ctx` (layer calls record, nothing runs), plans and captures it.
    `fn` returns the step's outputs. Policy for pool tensors the step keeps without returning
    them: "warn" (keep them valid), "error" (refuse the capture), "free" (reuse their memory)."""
    _context("capture", ctx)
    policy = policy_value(policy, "capture")
    step = _StepFunction(_checks.check_callable("fn", fn, "capture"))
    handle = _capi.new_handle()
    step.run("sg_capture", ctx.handle, step.c_function, None, policy, ctypes.byref(handle))
    return CapturedStep(handle)


def _key(owner, key):
    """A cache key as C text: a str, or an int (its decimal text); other objects are refused,
    since str() of one (a default repr with its address) would make a new key every run."""
    if isinstance(key, int) and not isinstance(key, bool):
        key = str(key)
    return _checks.check_name("key", key, owner)


class GraphCache:
    """Captured steps by key, least recently used evicted beyond `max_pool_bytes` of pools.
    A key (a str, or an int) names everything the graph depends on; keys are per context."""

    def __init__(self, max_pool_bytes=8 << 30):
        max_pool_bytes = _checks.check_int("max_pool_bytes", max_pool_bytes, *_checks.POSITIVE_INT64, "GraphCache")
        self._handle = _capi.new_handle()
        _capi.call("sg_graph_cache_create", max_pool_bytes, ctypes.byref(self._handle))

    def __del__(self):
        _capi.destroy("sg_graph_cache_destroy", getattr(self, "_handle", None))
        self._handle = None

    def get_or_capture(self, key, ctx, fn, policy="warn"):
        """The graph stored under `key` (a hit), or `fn` captured and stored (a miss)."""
        key = _key("GraphCache.get_or_capture", key)
        _context("GraphCache.get_or_capture", ctx)
        policy = policy_value(policy, "GraphCache.get_or_capture")
        step = _StepFunction(_checks.check_callable("fn", fn, "GraphCache.get_or_capture"))
        handle = _capi.new_handle()
        step.run("sg_graph_cache_get_or_capture", self._handle, key, ctx.handle, step.c_function, None, policy,
                 ctypes.byref(handle))
        return CapturedStep(handle)

    def contains(self, key, ctx):
        key = _key("GraphCache.contains", key)
        _context("GraphCache.contains", ctx)
        value = ctypes.c_int()
        _capi.call("sg_graph_cache_contains", self._handle, key, ctx.handle, ctypes.byref(value))
        return bool(value.value)

    def erase(self, key, ctx):
        key = _key("GraphCache.erase", key)
        _context("GraphCache.erase", ctx)
        _capi.call("sg_graph_cache_erase", self._handle, key, ctx.handle)

    def clear(self):
        _capi.call("sg_graph_cache_clear", self._handle)

    @property
    def stats(self):
        """{"hits", "misses", "captures", "evictions", "entries", "pool_bytes"}."""
        stats = _capi.GraphCacheStats()
        _capi.call("sg_graph_cache_get_stats", self._handle, ctypes.byref(stats))
        return {name: getattr(stats, name) for name, _ in _capi.GraphCacheStats._fields_}
