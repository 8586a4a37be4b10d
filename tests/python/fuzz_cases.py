"""The bad-input table of fuzz_test.py: each case is a Python snippet that makes one bad call
(through the raw C API in stepgraph._capi, or through the binding) and the error that call
must raise: an exception type and words its message contains.

Case fields:
    area     "capi" (raw ctypes calls) or "binding" (the Python API)
    name     unique id
    body     the snippet; runs after PRELUDE, its last statement is the bad call
    errors   exception type names (from the snippet's namespace) that count as a clear error
    words    strings the message must contain
    xfail    None, or the reason (naming the bug) a case is a known failure
"""

import collections

Case = collections.namedtuple("Case", "area name body errors words xfail")

# Runs before every body. DEVICE comes from argv[1] ("host" or "cuda").
PRELUDE = r'''
import ctypes, math, sys
import numpy as np
import stepgraph as sg
from stepgraph import _capi
from stepgraph._library import StepGraphError
c = ctypes
DEVICE = sys.argv[1]
DEV = 0 if DEVICE == "cuda" else 1
HUGE = 2**64 + 32
def byref(x): return c.byref(x)
def dims(*values): return (c.c_int64 * max(len(values), 1))(*values)
def new_ctx():
    h = _capi.new_handle()
    _capi.call("sg_context_create", DEV, 0, byref(h))
    return h
def new_tensor(ctx, *shape, dtype=0):
    h = _capi.new_handle()
    _capi.call("sg_tensor_create", ctx, b"t", dtype, len(shape), dims(*shape), byref(h))
    return h
def small_model(ctx, **overrides):
    args = dict(hidden=8, ffn=16, layers=1, vocab=16, dtype="float32")
    args.update(overrides)
    return sg.ResidualStack(ctx, **args)
def new_world():
    h = _capi.new_handle()
    _capi.call("sg_world_init", DEV, 30.0, byref(h))  # no launcher variables here: a world of one
    return h
def step_config(tokens=4, world=None):
    cfg = _capi.TrainStepConfig()
    _capi.lib().sg_train_step_config_default(byref(cfg))
    cfg.tokens, cfg.world = tokens, world
    return cfg
def create_step(cfg):
    model = small_model(ctx)
    opt = sg.AdamW(ctx, model)
    _capi.call('sg_train_step_create', model._handle, opt._handle, byref(cfg), byref(c.c_void_p()))
def train_step(ctx, tokens=4):
    model = small_model(ctx)
    return sg.TrainStep(model, sg.AdamW(ctx, model), tokens=tokens)
X = np.arange(32, dtype=np.float32).reshape(4, 8) / 32
def linear_graph(ctx):
    """A captured step reading the persistent x [2, 4] fp32: returns (graph, x, layer)."""
    layer = sg.Linear(ctx, 4, 4, dtype="float32")
    x = ctx.tensor((2, 4))
    graph = sg.capture(ctx, lambda: [layer(x)])
    return graph, x, layer
def tp_stack(world, overlap=b"bulk", out=True):
    """sg_residual_stack_create of a small fp32 stack tensor-parallel over `world`."""
    cfg = _capi.ResidualStackConfig()
    _capi.lib().sg_residual_stack_config_default(byref(cfg))
    cfg.hidden, cfg.ffn, cfg.layers, cfg.vocab, cfg.dtype = 8, 16, 1, 16, 0
    cfg.tensor_parallel, cfg.overlap = world, overlap
    _capi.call('sg_residual_stack_create', raw_ctx, byref(cfg), byref(c.c_void_p()) if out else None)
def optimizer_config(**fields):
    cfg = _capi.OptimizerConfig()
    _capi.lib().sg_optimizer_config_default(byref(cfg))
    for name, value in fields.items():
        setattr(cfg, name, value)
    return cfg
ctx = sg.Context(DEVICE)
raw_ctx = new_ctx()
_buffer_tensor = ctx.tensor((64,))  # memory of the context's device, for sg_tensor_wrap
BUF = c.c_void_p(_buffer_tensor.data_ptr)
'''

_CASES = []


def case(area, name, body, errors=("StepGraphError",), words=(), xfail=None):
    _CASES.append(Case(area, name, body.strip("\n"), tuple(errors), tuple(words), xfail))


SGE = ("StepGraphError",)
ARG = ("ArgumentError",)  # sg.ArgumentError (a StepGraphError and a ValueError)
TYPE = ("TypeError",)

# ---- raw C API through ctypes -------------------------------------------------------------

case("capi", "null_tensor_handle", "_capi.call('sg_tensor_rank', None, byref(c.c_int()))",
     words=["sg_tensor_rank"])
case("capi", "garbage_tensor_handle", "_capi.call('sg_tensor_numel', c.c_void_p(0xDEADBEEF), byref(c.c_int64()))",
     words=["sg_tensor_numel", "not a handle this library issued"])
case("capi", "random_garbage_graph_handle", "_capi.call('sg_graph_replay', c.c_void_p(0x7f3a12345678), None, None, 0)",
     words=["sg_graph_replay", "not a handle this library issued"])
case("capi", "destroyed_tensor_handle", """
t = new_tensor(raw_ctx, 2, 3)
_capi.call('sg_tensor_destroy', t)
_capi.call('sg_tensor_bytes', t, byref(c.c_int64()))
""", words=["sg_tensor_bytes", "destroyed"])
case("capi", "double_destroy_graph", """
g, x, layer = linear_graph(ctx)
h = c.c_void_p(g._handle.value)
_capi.call('sg_graph_destroy', h)
_capi.call('sg_graph_destroy', h)
""", words=["sg_graph_destroy", "destroyed"])
case("capi", "context_as_tensor", "_capi.call('sg_tensor_rank', raw_ctx, byref(c.c_int()))",
     words=["sg_tensor_rank", "not a tensor handle"])
case("capi", "tensor_as_layer", """
t = new_tensor(raw_ctx, 2)
_capi.call('sg_layer_forward', t, t, byref(c.c_void_p()), byref(c.c_void_p()))
""", words=["sg_layer_forward", "not a layer handle"])
case("capi", "layer_as_optimizer", """
layer = sg.Linear(ctx, 4, 4, dtype="float32")
_capi.call('sg_optimizer_step', layer._handle)
""", words=["sg_optimizer_step", "not a"])
case("capi", "destroyed_context_create_tensor", """
h = new_ctx()
_capi.call('sg_context_destroy', h)
new_tensor(h, 2)
""", words=["sg_tensor_create", "destroyed"])
case("capi", "null_out_context_create", "_capi.call('sg_context_create', DEV, 0, None)",
     words=["sg_context_create"])
case("capi", "null_out_tensor_rank", "_capi.call('sg_tensor_rank', new_tensor(raw_ctx, 2), None)",
     words=["sg_tensor_rank"])
case("capi", "null_out_tensor_create", "_capi.call('sg_tensor_create', raw_ctx, b't', 0, 1, dims(2), None)",
     words=["sg_tensor_create"])
case("capi", "null_out_graph_output", """
g, x, layer = linear_graph(ctx)
_capi.call('sg_graph_output', g._handle, 0, None)
""", words=["sg_graph_output"])
case("capi", "bad_device_enum", "_capi.call('sg_context_create', 7, 0, byref(c.c_void_p()))",
     words=["device 7 is not an sg_device"])
case("capi", "negative_side_streams", "_capi.call('sg_context_create', DEV, -1, byref(c.c_void_p()))",
     words=["side_streams", "got -1"])
case("capi", "bad_dtype_code_99", "new_tensor(raw_ctx, 2, dtype=99)", words=["dtype 99 is not an sg_dtype"])
case("capi", "bad_dtype_code_negative", "new_tensor(raw_ctx, 2, dtype=-1)", words=["dtype -1 is not an sg_dtype"])
case("capi", "negative_rank", "_capi.call('sg_tensor_create', raw_ctx, b't', 0, -1, dims(2), byref(c.c_void_p()))",
     words=["sg_tensor_create", "rank"])
case("capi", "huge_rank", """
_capi.call('sg_tensor_create', raw_ctx, b't', 0, 1000, (c.c_int64 * 1000)(*([1] * 1000)), byref(c.c_void_p()))
""", words=["sg_tensor_create", "rank"])
case("capi", "int_max_rank",
     "_capi.call('sg_tensor_create', raw_ctx, b't', 0, 2**31 - 1, dims(2), byref(c.c_void_p()))",
     words=["sg_tensor_create", "rank"])
case("capi", "negative_dim", "new_tensor(raw_ctx, 2, -3)", words=["sg_tensor_create"])
case("capi", "huge_dims_overflow", "new_tensor(raw_ctx, 2**62, 2**62)", words=["more elements than int64"])
case("capi", "null_dims", "_capi.call('sg_tensor_create', raw_ctx, b't', 0, 2, None, byref(c.c_void_p()))",
     words=["sg_tensor_create"])
case("capi", "wrap_null_data",
     "_capi.call('sg_tensor_wrap', raw_ctx, b'w', 0, 1, dims(4), None, None, byref(c.c_void_p()))",
     words=["address is null"])
case("capi", "wrap_transposed_strides", """
buf = (c.c_float * 12)()
_capi.call('sg_tensor_wrap', raw_ctx, b'w', 0, 2, dims(3, 4), dims(1, 3), BUF,
           byref(c.c_void_p()))
""", words=["sg_tensor_wrap"])
case("capi", "wrap_bad_dtype", """
_capi.call('sg_tensor_wrap', raw_ctx, b'w', 42, 1, dims(4), None, BUF, byref(c.c_void_p()))
""", words=["dtype 42 is not an sg_dtype"])
case("capi", "wrap_negative_dim", """
_capi.call('sg_tensor_wrap', raw_ctx, b'w', 0, 2, dims(2, -2), None, BUF, byref(c.c_void_p()))
""", words=["sg_tensor_wrap"])
case("capi", "copy_from_host_too_few_bytes", """
buf = (c.c_float * 6)()
_capi.call('sg_tensor_copy_from_host', new_tensor(raw_ctx, 2, 3), buf, 8)
""", words=["holds 24 bytes, got 8"])
case("capi", "copy_to_host_too_many_bytes", """
buf = (c.c_float * 64)()
_capi.call('sg_tensor_copy_to_host', new_tensor(raw_ctx, 2, 3), buf, 256)
""", words=["holds 24 bytes", "256"])
case("capi", "copy_from_host_null_src", "_capi.call('sg_tensor_copy_from_host', new_tensor(raw_ctx, 4), None, 16)",
     words=["sg_tensor_copy_from_host"])
case("capi", "copy_to_host_huge_bytes", """
buf = (c.c_float * 4)()
_capi.call('sg_tensor_copy_to_host', new_tensor(raw_ctx, 4), buf, 2**63)
""", words=["holds 16 bytes", "9223372036854775808"])
case("capi", "tensor_dims_null_dims", "_capi.call('sg_tensor_dims', new_tensor(raw_ctx, 2, 3), None, 3)",
     words=["sg_tensor_dims", "dims is NULL"])
case("capi", "tensor_dims_negative_capacity", """
out = (c.c_int64 * 4)()
_capi.call('sg_tensor_dims', new_tensor(raw_ctx, 2, 3), out, -1)
""", words=["sg_tensor_dims"])
case("capi", "tensor_set_name_null", "_capi.call('sg_tensor_set_name', new_tensor(raw_ctx, 2), None)",
     words=["sg_tensor_set_name", "name is NULL"])
case("capi", "replay_huge_count_null_arrays", """
g, x, layer = linear_graph(ctx)
_capi.call('sg_graph_replay', g._handle, None, None, 2**63)
""", words=["sg_graph_replay"])
case("capi", "replay_binding_wrong_shape", """
g, x, layer = linear_graph(ctx)
src = ctx.tensor((4, 2))
_capi.call('sg_graph_replay', g._handle, (c.c_void_p * 1)(x._handle.value), (c.c_void_p * 1)(src._handle.value), 1)
""", words=["is [2, 4] fp32 but its source", "[4, 2]"])
case("capi", "replay_binding_wrong_dtype", """
g, x, layer = linear_graph(ctx)
src = ctx.tensor((2, 4), "int32")
_capi.call('sg_graph_replay', g._handle, (c.c_void_p * 1)(x._handle.value), (c.c_void_p * 1)(src._handle.value), 1)
""", words=["but its source", "int32"])
case("capi", "replay_binding_other_context", """
g, x, layer = linear_graph(ctx)
other = sg.Context(DEVICE)
src = other.tensor((2, 4))
_capi.call('sg_graph_replay', g._handle, (c.c_void_p * 1)(x._handle.value), (c.c_void_p * 1)(src._handle.value), 1)
""", words=["must belong to the step's context"])
case("capi", "replay_binding_unread_static", """
g, x, layer = linear_graph(ctx)
unread, src = ctx.tensor((2, 4)), ctx.tensor((2, 4))
_capi.call('sg_graph_replay', g._handle, (c.c_void_p * 1)(unread._handle.value), (c.c_void_p * 1)(src._handle.value), 1)
""", words=["never reads"])
case("capi", "replay_binding_garbage_source", """
g, x, layer = linear_graph(ctx)
_capi.call('sg_graph_replay', g._handle, (c.c_void_p * 1)(x._handle.value), (c.c_void_p * 1)(0xDEADBEEF), 1)
""", words=["sg_graph_replay", "not a handle this library issued"])
case("capi", "replay_ordered_huge_stream_count", """
g, x, layer = linear_graph(ctx)
_capi.call('sg_graph_replay_ordered', g._handle, None, None, 0, None, 2**63)
""", words=["sg_graph_replay_ordered"])
case("capi", "graph_output_index_out_of_range", """
g, x, layer = linear_graph(ctx)
_capi.call('sg_graph_output', g._handle, 5, byref(c.c_void_p()))
""", words=["sg_graph_output"])
case("capi", "layer_parameter_negative_index", """
layer = sg.Linear(ctx, 4, 4, dtype="float32")
buf = c.create_string_buffer(64)
_capi.call('sg_layer_parameter', layer._handle, -1, buf, 64, byref(c.c_size_t()), byref(c.c_void_p()),
           byref(c.c_void_p()), byref(c.c_void_p()))
""", words=["sg_layer_parameter"])
case("capi", "layer_parameter_huge_index", """
layer = sg.Linear(ctx, 4, 4, dtype="float32")
buf = c.create_string_buffer(64)
_capi.call('sg_layer_parameter', layer._handle, 2**62, buf, 64, byref(c.c_size_t()), byref(c.c_void_p()),
           byref(c.c_void_p()), byref(c.c_void_p()))
""", words=["sg_layer_parameter"])
case("capi", "adamw_null_layers", """
_capi.call('sg_optimizer_create', raw_ctx, None, 3, byref(optimizer_config()), byref(c.c_void_p()))
""", words=["sg_optimizer_create", "layers is NULL"])
case("capi", "adamw_nan_lr", """
layer = sg.Linear(ctx, 4, 4, dtype="float32")
cfg = optimizer_config(); cfg.adamw.lr = float('nan')
_capi.call('sg_optimizer_create', ctx.handle, (c.c_void_p * 1)(layer._handle.value), 1, byref(cfg),
           byref(c.c_void_p()))
""", words=["lr must be finite"])
case("capi", "adamw_null_config", """
layer = sg.Linear(ctx, 4, 4, dtype="float32")
_capi.call('sg_optimizer_create', ctx.handle, (c.c_void_p * 1)(layer._handle.value), 1, None, byref(c.c_void_p()))
""", words=["sg_optimizer_create", "config is NULL"])
case("capi", "train_step_negative_tokens", """
model = small_model(ctx)
opt = sg.AdamW(ctx, model)
_capi.call('sg_train_step_create', model._handle, opt._handle, byref(step_config(tokens=-4)), byref(c.c_void_p()))
""", words=["tokens must be > 0, got -4"])
case("capi", "train_step_capture_bad_policy", """
step = train_step(ctx)
_capi.call('sg_train_step_capture', step._handle, 7, byref(c.c_void_p()))
""", words=["policy 7 is not an sg_pool_report_policy"])
case("capi", "cuda_stream_negative_index", "_capi.call('sg_context_cuda_stream', raw_ctx, -1, byref(c.c_void_p()))",
     words=["stream index -1 out of range"])
case("capi", "stream_scope_index_99", "_capi.call('sg_stream_scope_enter', raw_ctx, 99, byref(c.c_void_p()))",
     words=["stream 99 does not exist"])
case("capi", "graph_cache_negative_bytes", "_capi.call('sg_graph_cache_create', -1, byref(c.c_void_p()))",
     words=["max_pool_bytes must be > 0"])
case("capi", "layer_forward_null_input", """
layer = sg.Linear(ctx, 4, 4, dtype="float32")
_capi.call('sg_layer_forward', layer._handle, None, byref(c.c_void_p()), byref(c.c_void_p()))
""", words=["sg_layer_forward"])
case("capi", "linear_null_config", "_capi.call('sg_linear_create', raw_ctx, b'l', None, 0, byref(c.c_void_p()))",
     words=["sg_linear_create"])
case("capi", "linear_bad_dtype", """
cfg = _capi.LinearConfig(); _capi.lib().sg_linear_config_default(byref(cfg)); cfg.in_features = 4; cfg.out_features = 4
cfg.dtype = 42
_capi.call('sg_linear_create', raw_ctx, b'l', byref(cfg), 0, byref(c.c_void_p()))
""", words=["dtype 42 is not an sg_dtype"])
case("capi", "linear_negative_features", """
cfg = _capi.LinearConfig(); _capi.lib().sg_linear_config_default(byref(cfg)); cfg.in_features = -4; cfg.out_features = 4
cfg.dtype = 0
_capi.call('sg_linear_create', raw_ctx, b'l', byref(cfg), 0, byref(c.c_void_p()))
""", words=["in_features and out_features must be > 0"])
case("capi", "norm_bad_kind", """
cfg = _capi.NormConfig(); _capi.lib().sg_norm_config_default(byref(cfg)); cfg.hidden = 8; cfg.dtype = 0; cfg.kind = 9
_capi.call('sg_norm_create', raw_ctx, b'n', byref(cfg), byref(c.c_void_p()))
""", words=["norm kind 9 is not an sg_norm_kind"])
case("capi", "residual_stack_zero_hidden", """
cfg = _capi.ResidualStackConfig(); _capi.lib().sg_residual_stack_config_default(byref(cfg))
cfg.hidden = 0; cfg.ffn = 16; cfg.layers = 1; cfg.vocab = 16; cfg.dtype = 0
_capi.call('sg_residual_stack_create', raw_ctx, byref(cfg), byref(c.c_void_p()))
""", words=["hidden", "must be > 0"])
case("capi", "layer_backward_destroyed_saved", """
layer = sg.Linear(ctx, 4, 4, dtype="float32")
x = ctx.tensor((2, 4))
y, saved = _capi.new_handle(), _capi.new_handle()
_capi.call('sg_layer_forward', layer._handle, x._handle, byref(y), byref(saved))
_capi.call('sg_saved_destroy', saved)
_capi.call('sg_layer_backward', layer._handle, saved, y, byref(c.c_void_p()))
""", words=["sg_layer_backward", "destroyed"])
case("capi", "capture_bad_policy", """
fn = _capi.STEP_FN(lambda user, outputs, capacity, count: 0)
_capi.call('sg_capture', raw_ctx, fn, None, 99, byref(c.c_void_p()))
""", words=["policy 99 is not an sg_pool_report_policy"])

# Worlds, the versioned train step config and the communication stream.
case("capi", "null_out_world_init", "_capi.call('sg_world_init', DEV, 30.0, None)",
     words=["sg_world_init", "out is NULL"])
case("capi", "world_init_bad_device", "_capi.call('sg_world_init', 7, 30.0, byref(c.c_void_p()))",
     words=["sg_world_init", "device 7 is not an sg_device"])
case("capi", "world_init_nan_timeout", "_capi.call('sg_world_init', DEV, float('nan'), byref(c.c_void_p()))",
     words=["sg_world_init", "timeout_seconds must be in", "nan"])
case("capi", "world_init_negative_timeout", "_capi.call('sg_world_init', DEV, -1.0, byref(c.c_void_p()))",
     words=["sg_world_init", "timeout_seconds must be in", "-1"])
case("capi", "world_init_huge_timeout", "_capi.call('sg_world_init', DEV, 1e300, byref(c.c_void_p()))",
     words=["sg_world_init", "timeout_seconds must be in"])
case("capi", "null_out_world_rank", "_capi.call('sg_world_rank', new_world(), None)",
     words=["sg_world_rank", "out is NULL"])
case("capi", "destroyed_world_handle", """
w = new_world()
_capi.call('sg_world_destroy', w)
_capi.call('sg_world_size', w, byref(c.c_int()))
""", words=["sg_world_size", "world handle", "was destroyed"])
case("capi", "double_destroy_world", """
w = new_world()
_capi.call('sg_world_destroy', w)
_capi.call('sg_world_destroy', w)
""", words=["sg_world_destroy", "was already destroyed"])
case("capi", "context_as_world", "_capi.call('sg_world_local_rank', raw_ctx, byref(c.c_int()))",
     words=["sg_world_local_rank", "is a context handle, not a world handle"])
case("capi", "world_as_context", "_capi.call('sg_context_synchronize', new_world())",
     words=["sg_context_synchronize", "is a world handle, not a context handle"])
case("capi", "garbage_world_handle", "_capi.call('sg_world_rank', c.c_void_p(0xDEADBEEF), byref(c.c_int()))",
     words=["sg_world_rank", "not a handle this library issued"])
case("capi", "train_step_config_null", """
model = small_model(ctx)
opt = sg.AdamW(ctx, model)
_capi.call('sg_train_step_create', model._handle, opt._handle, None, byref(c.c_void_p()))
""", words=["sg_train_step_create", "config is NULL"])
case("capi", "train_step_config_not_initialised", """
cfg = _capi.TrainStepConfig(); cfg.tokens = 4
create_step(cfg)
""", words=["sg_train_step_create", "config (sg_train_step_config) was not initialised"])
case("capi", "train_step_config_newer_version", """
cfg = step_config(); cfg.version = 99
create_step(cfg)
""", words=["version 99 is newer than this library reads", "built against a newer stepgraph.h"])
case("capi", "train_step_config_wrong_size", """
cfg = step_config(); cfg.size = 16
create_step(cfg)
""", words=["size 16 does not match version 2", "an older"])
case("capi", "train_step_config_zero_tokens", "create_step(step_config(tokens=0))", words=["tokens must be > 0"])
case("capi", "train_step_config_destroyed_world", """
w = new_world()
_capi.call('sg_world_destroy', w)
create_step(step_config(world=w.value))
""", words=["sg_train_step_create", "config->world", "was destroyed"])
case("capi", "train_step_config_tensor_as_world", """
create_step(step_config(world=new_tensor(raw_ctx, 2).value))
""", words=["sg_train_step_create", "is a tensor handle, not a world handle"])
case("capi", "train_step_config_null_out", """
model = small_model(ctx)
opt = sg.AdamW(ctx, model)
_capi.call('sg_train_step_create', model._handle, opt._handle, byref(step_config()), None)
""", words=["sg_train_step_create", "out is NULL"])
case("capi", "checkpoint_config_null", """
model = small_model(ctx); opt = sg.AdamW(ctx, model)
_capi.call('sg_checkpoint_save', model._handle, opt._handle, b'c.safetensors', None)
""", words=["sg_checkpoint_save", "config is NULL"])
case("capi", "checkpoint_config_not_initialised", """
model = small_model(ctx); opt = sg.AdamW(ctx, model)
_capi.call('sg_checkpoint_load', model._handle, opt._handle, b'c.safetensors', byref(_capi.CheckpointConfig()), None)
""", words=["sg_checkpoint_load", "config (sg_checkpoint_config) was not initialised"])
case("capi", "checkpoint_tensor_as_world", """
model = small_model(ctx); opt = sg.AdamW(ctx, model)
cfg = _capi.CheckpointConfig(); _capi.lib().sg_checkpoint_config_default(byref(cfg))
cfg.world = new_tensor(raw_ctx, 2).value
_capi.call('sg_checkpoint_save', model._handle, opt._handle, b'c.safetensors', byref(cfg))
""", words=["sg_checkpoint_save", "is a tensor handle, not a world handle"])
case("capi", "checkpoint_metadata_count_without_keys", """
model = small_model(ctx); opt = sg.AdamW(ctx, model)
cfg = _capi.CheckpointConfig(); _capi.lib().sg_checkpoint_config_default(byref(cfg))
cfg.metadata_count = 2
_capi.call('sg_checkpoint_save', model._handle, opt._handle, b'c.safetensors', byref(cfg))
""", words=["sg_checkpoint_save", "config->metadata_keys is NULL"])
case("capi", "checkpoint_metadata_count_huge", """
model = small_model(ctx); opt = sg.AdamW(ctx, model)
cfg = _capi.CheckpointConfig(); _capi.lib().sg_checkpoint_config_default(byref(cfg))
cfg.metadata_count = 2**40
_capi.call('sg_checkpoint_save', model._handle, opt._handle, b'c.safetensors', byref(cfg))
""", words=["sg_checkpoint_save", "metadata_count", "65536"])
case("capi", "checkpoint_load_of_a_file_that_is_none", """
import os, tempfile
path = os.path.join(tempfile.mkdtemp(), 'noise.safetensors')
with open(path, 'wb') as f: f.write(bytes(range(256)) * 4)
model = small_model(ctx); opt = sg.AdamW(ctx, model)
cfg = _capi.CheckpointConfig(); _capi.lib().sg_checkpoint_config_default(byref(cfg))
_capi.call('sg_checkpoint_load', model._handle, opt._handle, path.encode(), byref(cfg), None)
""", words=["noise.safetensors"])
case("capi", "checkpoint_garbage_metadata_handle",
     "_capi.call('sg_checkpoint_metadata_count', c.c_void_p(0xDEADBEEF), byref(c.c_size_t()))",
     words=["sg_checkpoint_metadata_count", "not a handle this library issued"])
case("capi", "tensor_parallel_null_world", "tp_stack(None)",
     words=["sg_residual_stack_create", "overlap", "tensor_parallel is NULL"])
case("capi", "tensor_parallel_destroyed_world", """
w = new_world()
_capi.call('sg_world_destroy', w)
tp_stack(w.value)
""", words=["sg_residual_stack_create", "world", "was destroyed"])
case("capi", "tensor_parallel_tensor_as_world", "tp_stack(new_tensor(raw_ctx, 2).value)",
     words=["sg_residual_stack_create", "is a tensor handle, not a world handle"])
case("capi", "tensor_parallel_empty_overlap", "tp_stack(new_world().value, overlap=b'')",
     words=["overlap"])
case("capi", "tensor_parallel_unknown_overlap", "tp_stack(new_world().value, overlap=b'sideways')",
     words=["unknown overlap mode 'sideways'"])
case("capi", "tensor_parallel_misfit_overlap", "tp_stack(new_world().value, overlap=b'pipelined,none,none,none')",
     words=["fc1_fprop (all-gather then GEMM) takes none, bulk or ring_exchange"])
case("capi", "tensor_parallel_null_out", "tp_stack(new_world().value, out=False)",
     words=["sg_residual_stack_create", "out is NULL"])
case("capi", "graph_profile_not_run", """
graph, x, layer = linear_graph(ctx)
_capi.string_out('sg_graph_last_profile', graph._handle)
""", words=["sg_graph_last_profile", "no profile yet", "sg_graph_profile"])
case("capi", "gemm_algorithms_unknown", "_capi.call('sg_context_set_gemm_algorithms', raw_ctx, b'fastest')",
     words=["sg_context_set_gemm_algorithms", "'fastest'", "heuristic", "timed"])
case("capi", "gemm_algorithms_null", "_capi.call('sg_context_set_gemm_algorithms', raw_ctx, None)",
     words=["sg_context_set_gemm_algorithms", "choice is NULL"])
case("capi", "communication_stream_out_of_range", "_capi.call('sg_context_set_communication_stream', raw_ctx, 5)",
     words=["communication stream must be a side stream", "got 5"])
case("capi", "communication_stream_null_out", "_capi.call('sg_context_communication_stream', raw_ctx, None)",
     words=["sg_context_communication_stream", "out is NULL"])

# The values the binding refuses, as a C caller passes them: byte counts past int64 or the
# address space for a real address, flags other than 0/1, eps that is not finite or negative,
# a negative schedule total, fields the layer would ignore; the layer error check.
def _wrap_case(name, dims, words, address="BUF", dtype=0):
    case("capi", name, f"_capi.call('sg_tensor_wrap', raw_ctx, b'w', {dtype}, {len(dims)}, dims(*{dims!r}), None, "
                       f"{address}, byref(c.c_void_p()))", words=["sg_tensor_wrap 'w'", *words])


_wrap_case("wrap_elements_overflow_real_address", (2**32, 2**32), ["more elements than int64"])
_wrap_case("wrap_bytes_overflow_real_address", (2**31, 2**31), ["more bytes than int64"])
_wrap_case("wrap_int64_bytes_overflow", (2**59, 8), ["more bytes than int64"], dtype=6)
_wrap_case("wrap_past_the_address_space", (2**40,), ["pass the end of the address space"],
           address="c.c_void_p(2**64 - 4096)")
_CONFIGS = {
    "linear": ("LinearConfig", "sg_linear_config_default", "cfg.in_features = cfg.out_features = 16; cfg.dtype = 0",
               "_capi.call('sg_linear_create', raw_ctx, b'l', byref(cfg), 1, byref(c.c_void_p()))"),
    "norm": ("NormConfig", "sg_norm_config_default", "cfg.hidden = 8; cfg.dtype = 0",
             "_capi.call('sg_norm_create', raw_ctx, b'n', byref(cfg), byref(c.c_void_p()))"),
    "layernorm_linear": ("LayerNormLinearConfig", "sg_layernorm_linear_config_default",
                         "cfg.in_features = cfg.out_features = 16; cfg.dtype = 0",
                         "_capi.call('sg_layernorm_linear_create', raw_ctx, b'l', byref(cfg), 1, byref(c.c_void_p()))"),
    "layernorm_mlp": ("LayerNormMLPConfig", "sg_layernorm_mlp_config_default", "cfg.hidden = 16; cfg.ffn = 32; "
                      "cfg.dtype = 0",
                      "_capi.call('sg_layernorm_mlp_create', raw_ctx, b'm', byref(cfg), 1, byref(c.c_void_p()))"),
    "residual_stack": ("ResidualStackConfig", "sg_residual_stack_config_default",
                       "cfg.hidden = 8; cfg.ffn = 16; cfg.layers = 1; cfg.vocab = 16; cfg.dtype = 0",
                       "_capi.call('sg_residual_stack_create', raw_ctx, byref(cfg), byref(c.c_void_p()))"),
}


def _config_case(name, layer, change, words):
    struct, default, setup, call = _CONFIGS[layer]
    case("capi", name, f"cfg = _capi.{struct}(); _capi.lib().{default}(byref(cfg)); {setup}\n{change}\n{call}",
         words=words)


for _flag in ("bias", "dgrad", "wgrad"):
    _config_case(f"linear_{_flag}_two", "linear", f"cfg.{_flag} = 2", [f"config {_flag} is a flag", "got 2"])
_config_case("layernorm_linear_bias_minus_one", "layernorm_linear", "cfg.bias = -1",
             ["config bias is a flag", "got -1"])
for _layer in ("norm", "layernorm_linear", "layernorm_mlp", "residual_stack"):
    for _label, _value in (("inf", "float('inf')"), ("nan", "float('nan')"), ("negative", "-1e-5")):
        _config_case(f"{_layer}_eps_{_label}", _layer, f"cfg.eps = {_value}", ["config eps must be finite and >= 0"])
_config_case("residual_stack_topk_without_experts", "residual_stack", "cfg.topk = 1",
             ["config topk (1)", "experts is 0"])
_config_case("residual_stack_moe_every_without_experts", "residual_stack", "cfg.moe_every = 1",
             ["moe_every (1)", "experts is 0"])
for _field, _value, _scaling, _words in (
        ("stop_on_non_finite", "2", 0, ["recipe stop_on_non_finite is a flag", "got 2"]),
        ("hybrid", "-1", 0, ["recipe hybrid is a flag"]),
        ("fast_accumulation_forward", "5", 1, ["recipe fast_accumulation_forward is a flag"]),
        ("margin", "3", 0, ["margin (3)", "apply to delayed scaling only"]),
        ("amax_history_len", "16", 2, ["amax_history_len (16)", "apply to delayed scaling only"]),
        ("power_of_two_scales", "0", 1, ["power_of_two_scales applies to block scaling only"])):
    case("capi", f"fp8_recipe_{_field}_{_value}", f"""
cfg = _capi.LinearConfig(); _capi.lib().sg_linear_config_default(byref(cfg))
cfg.in_features = cfg.out_features = 128; cfg.dtype = 0
cfg.fp8 = 1; _capi.lib().sg_fp8_recipe_default(byref(cfg.fp8_recipe), {_scaling})
cfg.fp8_recipe.{_field} = {_value}
_capi.call('sg_linear_create', raw_ctx, b'l', byref(cfg), 1, byref(c.c_void_p()))
""", words=["sg_linear_create", *_words])
for _name, _schedule, _words in (
        ("schedule_negative_total", "_capi.LrSchedule(1, 1e-3, 0.0, 0, -5)", ["schedule->total must be >= 0, got -5"]),
        ("schedule_negative_warmup", "_capi.LrSchedule(1, 1e-3, 0.0, -1, 10)", ["warmup steps must be >= 0"]),
        ("schedule_constant_with_total", "_capi.LrSchedule(0, 1e-3, 0.0, 0, 100)",
         ["a constant one (kind 0) ignores them"]),
        ("schedule_kind_7", "_capi.LrSchedule(7, 1e-3, 0.0, 0, 100)", ["schedule->kind must be 0"]),
        ("schedule_nan_base", "_capi.LrSchedule(1, float('nan'), 0.0, 0, 100)", ["base rate must be finite"])):
    case("capi", _name, f"""
layer = sg.Linear(ctx, 4, 4, dtype='float32')
cfg = optimizer_config(schedule=1, lr_schedule={_schedule})
_capi.call('sg_optimizer_create', ctx.handle, (c.c_void_p * 1)(layer._handle.value), 1, byref(cfg),
           byref(c.c_void_p()))
""", words=_words)
case("capi", "tensor_set_name_empty", "_capi.call('sg_tensor_set_name', new_tensor(raw_ctx, 2), b'')",
     words=["sg_tensor_set_name", "name is empty"])
case("capi", "graph_cache_empty_key", """
cache = _capi.new_handle()
_capi.call('sg_graph_cache_create', 1 << 20, byref(cache))
_capi.call('sg_graph_cache_contains', cache, b'', raw_ctx, byref(c.c_int()))
""", words=["sg_graph_cache_contains", "key is empty"])
case("capi", "layer_check_errors_null", "_capi.call('sg_layer_check_errors', None)",
     words=["sg_layer_check_errors", "layer"])
case("capi", "layer_check_errors_tensor_handle", "_capi.call('sg_layer_check_errors', new_tensor(raw_ctx, 2))",
     words=["sg_layer_check_errors", "not a layer handle"])
case("capi", "layer_check_errors_while_capturing", """
layer = sg.Linear(ctx, 4, 4, dtype='float32')
x = ctx.tensor((2, 4))
def step():
    y = layer(x)
    _capi.call('sg_layer_check_errors', layer._handle)
    return [y]
sg.capture(ctx, step)
""", words=["sg_layer_check_errors: called while a step is being captured"])
case("capi", "layer_check_errors_fp8_stop_after_nan", """
layer = sg.Linear(ctx, 16, 16, dtype='bf16', fp8=sg.Fp8Recipe.current(on_non_finite='stop'))
values = np.full((16, 16), 0.5, np.float32); values[2, 2] = np.inf
x = ctx.from_numpy(values, dtype='bf16')
y, saved = _capi.new_handle(), _capi.new_handle()
_capi.call('sg_layer_forward', layer._handle, x._handle, byref(y), byref(saved))
_capi.call('sg_layer_check_errors', layer._handle)
""", words=["Linear 'linear'", "met a non-finite amax", "on_non_finite is stop"])

# ---- the Python binding -----------------------------------------------------------------

case("binding", "tensor_huge_dim", "ctx.tensor((HUGE, 2))", ARG, ["shape[0]", str(2**64 + 32)])
case("binding", "tensor_negative_dim", "ctx.tensor((2, -1))", ARG, ["shape[1]", "got -1"])
case("binding", "tensor_bool_dim", "ctx.tensor((True, 2))", TYPE, ["shape[0]", "bool"])
case("binding", "tensor_float_dim", "ctx.tensor((2.5,))", TYPE, ["shape[0]", "float"])
case("binding", "tensor_shape_not_sequence", "ctx.tensor(5)", TYPE, ["shape must be a sequence"])
case("binding", "tensor_unknown_dtype", "ctx.tensor((2,), 'float64')", ("ValueError",), ["unknown dtype"])
case("binding", "linear_huge_in", "sg.Linear(ctx, HUGE, 4, dtype='float32')", ARG, ["in_features"])
case("binding", "linear_negative_out", "sg.Linear(ctx, 4, -1, dtype='float32')", ARG, ["out_features", "got -1"])
case("binding", "linear_bool_in", "sg.Linear(ctx, True, 4, dtype='float32')", TYPE, ["in_features", "bool"])
case("binding", "linear_float_seed", "sg.Linear(ctx, 4, 4, dtype='float32', seed=1.0)", TYPE, ["seed"])
case("binding", "linear_huge_seed", "sg.Linear(ctx, 4, 4, dtype='float32', seed=2**32)", ARG, ["seed"])
case("binding", "norm_zero_hidden", "sg.LayerNorm(ctx, 0, dtype='float32')", ARG, ["hidden"])
case("binding", "mlp_negative_ffn", "sg.LayerNormMLP(ctx, 8, -16, dtype='float32')", ARG, ["ffn"])
case("binding", "stack_hidden_2_63", "small_model(ctx, hidden=2**63)", ARG, ["hidden"])
case("binding", "stack_negative_layers", "small_model(ctx, layers=-1)", ARG, ["layers", "got -1"])
case("binding", "stack_bool_vocab", "small_model(ctx, vocab=False)", TYPE, ["vocab", "bool"])
case("binding", "stack_float_ffn", "small_model(ctx, ffn=16.0)", TYPE, ["ffn", "float"])
case("binding", "stack_topk_over_experts", "small_model(ctx, experts=4, topk=5, moe_every=1)", SGE, ["topk"])
case("binding", "stack_huge_topk", "small_model(ctx, experts=2, topk=HUGE + 1)", ARG, ["topk"])
case("binding", "trainstep_zero_tokens", "m = small_model(ctx); sg.TrainStep(m, sg.AdamW(ctx, m), tokens=0)",
     ARG, ["tokens", "got 0"])
case("binding", "trainstep_huge_tokens", "m = small_model(ctx); sg.TrainStep(m, sg.AdamW(ctx, m), tokens=HUGE)",
     ARG, ["tokens"])
case("binding", "trainstep_bool_tokens", "m = small_model(ctx); sg.TrainStep(m, sg.AdamW(ctx, m), tokens=True)",
     TYPE, ["tokens", "bool"])
case("binding", "trainstep_float_tokens", "m = small_model(ctx); sg.TrainStep(m, sg.AdamW(ctx, m), tokens=4.0)",
     TYPE, ["tokens", "float"])
case("binding", "trainstep_linear_model",
     "l = sg.Linear(ctx, 4, 4, dtype='float32'); sg.TrainStep(l, sg.AdamW(ctx, l), 4)",
     TYPE, ["ResidualStack"])
case("binding", "trainstep_optimizer_of_other_model", """
a, b = small_model(ctx), small_model(ctx)
step = sg.TrainStep(a, sg.AdamW(ctx, b), tokens=4)
""", SGE, ["not a parameter of the step's model"])
case("binding", "context_negative_side_streams", "sg.Context(DEVICE, side_streams=-1)", ARG, ["side_streams"])
case("binding", "context_bad_device", "sg.Context('tpu')", SGE, ["device must be"])
case("binding", "stream_huge_index", "\nwith ctx.stream(HUGE):\n    pass", ARG, ["index"])
case("binding", "stream_out_of_range_index", "\nwith ctx.stream(7):\n    pass", SGE, ["stream"])
case("binding", "cuda_stream_negative", "ctx.cuda_stream(-1)", ARG, ["index"])
case("binding", "graph_cache_negative", "sg.GraphCache(-5)", ARG, ["max_pool_bytes"])
case("binding", "copy_from_wrong_shape", "ctx.tensor((2, 3)).copy_from(np.ones((3, 2), np.float32))", ARG,
     ["must have shape [2, 3]"])
case("binding", "copy_from_complex", "ctx.tensor((2,)).copy_from(np.ones(2, complex))", TYPE, ["complex"])
case("binding", "copy_from_float_into_int32", "ctx.tensor((3,), 'int32').copy_from([1.5, 2.0, 3.0])", TYPE,
     ["integer array"])
case("binding", "copy_from_int_overflow_int32", "ctx.tensor((3,), 'int32').copy_from(np.array([1, 2, 2**40]))", ARG,
     ["2147483647"])
case("binding", "copy_from_bool_into_float", "ctx.tensor((2,)).copy_from(np.array([True, False]))", TYPE, ["bool"])
case("binding", "copy_from_fp8_float", "ctx.tensor((2,), 'fp8_e4m3').copy_from(np.ones(2))", TYPE, ["fp8"])
case("binding", "load_x_transposed", "train_step(ctx).load(X.T.copy(), [0, 1, 2, 3])", ARG, ["x must have shape"])
case("binding", "load_x_wrong_dtype", "train_step(ctx).load(X.astype(complex), [0, 1, 2, 3])", TYPE, ["complex"])
case("binding", "load_label_equal_vocab", "train_step(ctx).load(X, [16, 0, 0, 0])", ARG, ["labels", "got 16"])
case("binding", "load_label_negative", "train_step(ctx).load(X, [0, -5, 0, 0])", ARG, ["labels", "got -5"])
case("binding", "load_label_float", "train_step(ctx).load(X, [0.0, 1.0, 2.0, 3.5])", TYPE, ["integer array"])
case("binding", "load_label_uint64_huge", "train_step(ctx).load(X, np.array([0, 2**63, 0, 0], np.uint64))", ARG,
     ["9223372036854775808"])
case("binding", "load_label_wrong_shape", "train_step(ctx).load(X, [[0], [1], [2], [3]])", ARG,
     ["labels must have shape [4]"])
case("binding", "adamw_negative_lr", "sg.AdamW(ctx, small_model(ctx), lr=-1e-3)", ARG, ["lr"])
case("binding", "adamw_nan_lr", "sg.AdamW(ctx, small_model(ctx), lr=float('nan'))", ARG, ["lr"])
case("binding", "adamw_beta1_one", "sg.AdamW(ctx, small_model(ctx), betas=(1.0, 0.999))", ARG, ["beta1"])
case("binding", "adamw_beta2_negative", "sg.AdamW(ctx, small_model(ctx), betas=(0.9, -0.1))", ARG, ["beta2"])
case("binding", "adamw_one_beta", "sg.AdamW(ctx, small_model(ctx), betas=(0.9,))", TYPE, ["betas"])
case("binding", "adamw_inf_eps", "sg.AdamW(ctx, small_model(ctx), eps=float('inf'))", ARG, ["eps"])
case("binding", "adamw_negative_weight_decay", "sg.AdamW(ctx, small_model(ctx), weight_decay=-0.1)", ARG,
     ["weight_decay"])
case("binding", "adamw_string_lr", "sg.AdamW(ctx, small_model(ctx), lr='0.1')", TYPE, ["lr"])
case("binding", "adamw_not_layers", "sg.AdamW(ctx, [None])", TYPE, ["layers"])
case("binding", "replay_bind_unread_tensor", """
g, x, layer = linear_graph(ctx)
g.replay({ctx.tensor((2, 4)): ctx.tensor((2, 4))})
""", SGE, ["never reads"])
case("binding", "replay_bind_wrong_shape", """
g, x, layer = linear_graph(ctx)
g.replay({x: ctx.tensor((4, 2))})
""", SGE, ["but its source", "[4, 2]"])
case("binding", "replay_bind_wrong_dtype", """
g, x, layer = linear_graph(ctx)
g.replay({x: ctx.tensor((2, 4), 'float16')})
""", SGE, ["but its source", "fp16"])
case("binding", "replay_bind_other_context", """
g, x, layer = linear_graph(ctx)
g.replay({x: sg.Context(DEVICE).tensor((2, 4))})
""", SGE, ["must belong to the step's context"])
case("binding", "replay_bind_non_tensor", """
g, x, layer = linear_graph(ctx)
g.replay({x: np.ones((2, 4), np.float32)})
""", TYPE, ["replay bindings"])
case("binding", "release_pool_then_replay", """
g, x, layer = linear_graph(ctx)
g.replay()
g.release_pool()
g.replay()
""", SGE, ["released"])
case("binding", "train_graph_release_pool_then_replay", """
step = train_step(ctx)
step.load(X, [0, 1, 2, 3])
g = step.capture()
g.release_pool()
g.replay()
""", SGE, ["released"])
case("binding", "forward_tensor_of_other_context", """
layer = sg.Linear(ctx, 4, 4, dtype='float32')
layer(sg.Context(DEVICE).tensor((2, 4)))
""", SGE, ["context"])
case("binding", "forward_wrong_shape", "sg.Linear(ctx, 8, 4, dtype='float32').forward(ctx.tensor((3, 7)))", SGE,
     ["input must be [tokens, 8]"])
case("binding", "forward_wrong_dtype", "sg.Linear(ctx, 4, 4, dtype='float32')(ctx.tensor((2, 4), 'int32'))", SGE,
     ["linear"])
case("binding", "backward_saved_of_other_layer", """
a, b = sg.Linear(ctx, 4, 4, dtype='float32'), sg.Linear(ctx, 4, 4, dtype='float32')
_, saved = a.forward(ctx.tensor((2, 4)))
b.backward(saved, ctx.tensor((2, 4)))
""", SGE, ["another linear"])
case("binding", "capture_step_that_raises", """
def step():
    raise ValueError("boom in the step")
sg.capture(ctx, step)
""", ("ValueError",), ["boom in the step"])
case("binding", "capture_step_returns_non_tensor", "sg.capture(ctx, lambda: [np.ones(2)])", TYPE,
     ["returns stepgraph Tensors"])
case("binding", "capture_bad_policy", "sg.capture(ctx, lambda: [], policy='sometimes')", SGE, ["policy"])
case("binding", "item_of_many_elements", "ctx.tensor((3,)).item()", SGE, ["item() needs one element"])
case("binding", "closed_context", "ctx.close(); ctx.tensor((2,))", SGE, ["closed"])
case("binding", "wrap_float64", "ctx.wrap(np.ones(3, np.float64))", TYPE + SGE, [])
# On cuda a NumPy array is the wrong kind of object (a TypeError naming what a cuda context wraps);
# on host the read-only and transposed arrays are refused as such.
case("binding", "wrap_read_only_or_wrong_device", """
a = np.ones((2, 2), np.float32)
a.setflags(write=False)
ctx.wrap(a)
""", SGE + ("TypeError",), [])
case("binding", "wrap_transposed", "ctx.wrap(np.ones((4, 6), np.float32).T)", SGE + ("TypeError",), [])
# A view larger than its buffer: copies to and from the host (and every op) would run 4 MiB past
# a 4 KiB allocation (a heap overflow under ASan) if wrap took it. Host memory: a host context.
case("binding", "wrap_as_strided_past_its_buffer", """
from numpy.lib.stride_tricks import as_strided
host = sg.Context('host')
t = host.wrap(as_strided(np.zeros(1024, np.float32), shape=(1024, 1024), strides=(4096, 4)))
t.copy_from(np.ones((1024, 1024), np.float32))
""", ARG, ["wrap", "which holds 4096 bytes"])
case("binding", "wrap_interface_past_a_bytearray", """
from numpy.lib.stride_tricks import as_strided
host = sg.Context('host')
buffer = bytearray(64)
host.wrap(as_strided(np.frombuffer(buffer, np.float32), shape=(4096,), strides=(4,))).numpy().sum()
""", ARG, ["which holds 64 bytes"])
case("binding", "init_distributed_bad_device", "sg.init_distributed('tpu')", ARG, ["device must be", "'tpu'"])
case("binding", "init_distributed_int_device", "sg.init_distributed(1)", TYPE, ["device must be"])
case("binding", "init_distributed_zero_timeout", "sg.init_distributed(DEVICE, timeout=0)", ARG, ["timeout", "got 0"])
case("binding", "init_distributed_nan_timeout", "sg.init_distributed(DEVICE, timeout=float('nan'))", ARG,
     ["timeout"])
case("binding", "init_distributed_string_timeout", "sg.init_distributed(DEVICE, timeout='300')", TYPE, ["timeout"])
case("binding", "init_distributed_bool_timeout", "sg.init_distributed(DEVICE, timeout=True)", TYPE, ["timeout"])
case("binding", "trainstep_world_not_a_world", "m = small_model(ctx); sg.TrainStep(m, sg.AdamW(ctx, m), 4, world=3)",
     TYPE, ["world must be a stepgraph World"])
case("binding", "trainstep_closed_world", """
w = sg.init_distributed(DEVICE)
w.close()
m = small_model(ctx)
sg.TrainStep(m, sg.AdamW(ctx, m), 4, world=w)
""", SGE, ["this World is closed"])
case("binding", "world_constructed_directly", "sg.World()", TYPE, ["init_distributed"])
case("binding", "context_communication_stream_out_of_range", "sg.Context(DEVICE, side_streams=1, "
     "communication_stream=4)", SGE, ["communication stream must be a side stream"])
case("binding", "context_communication_stream_negative", "ctx.communication_stream = -2", ARG,
     ["communication_stream", "got -2"])

case("binding", "tensor_numel_overflow", "ctx.tensor((2**40, 2**40))", SGE, ["more elements than int64"])
case("binding", "tensor_out_of_memory", "ctx.tensor((2**50,))", SGE, ["out_of_memory"])
case("binding", "tensor_out_of_memory_names_tensor", "ctx.tensor((2**50,))", SGE,
     ["does not fit", "persistent tensor 'tensor"])
case("binding", "model_out_of_memory_names_parameter", "small_model(ctx, hidden=2**20, ffn=2**22)", SGE,
     ["out_of_memory", "block0", "does not fit"])
case("binding", "stack_bf16_vocab_not_multiple_of_8", "small_model(ctx, vocab=12, dtype='bf16')", SGE,
     ["vocab 12", "multiple of 8"])
case("binding", "read_output_after_release_pool", """
g, x, layer = linear_graph(ctx)
g.replay()
y = g.outputs[0]
g.release_pool()
y.numpy()
""", SGE, [])

CASES = tuple(_CASES)
assert len({(c.area, c.name) for c in CASES}) == len(CASES), "case names must be unique in an area"
