"""The C API (capi/stepgraph.h) through ctypes: prototypes, structs and
the call wrapper that turns a failed call into StepGraphError. Internal."""

import ctypes
from ctypes import POINTER, c_char_p, c_double, c_float, c_int, c_int64, c_size_t, c_uint32, c_void_p

from stepgraph._library import StepGraphError, library_path

API_VERSION = 11


_HEADER = [("size", c_size_t), ("magic", c_uint32), ("version", c_uint32)]


class Fp8Recipe(ctypes.Structure):
    """sg_fp8_recipe: fill it with sg_fp8_recipe_default, then set the fields."""
    _fields_ = [("scaling", c_int), ("hybrid", c_int), ("amax_history_len", c_int), ("amax_most_recent", c_int),
                ("margin", c_int), ("power_of_two_scales", c_int), ("fast_accumulation_forward", c_int),
                ("fast_accumulation_backward", c_int), ("stop_on_non_finite", c_int)]


# The layer configs (version 1 each): fill one with its sg_*_config_default, which sets size, magic
# and version, then set the fields.
class LinearConfig(ctypes.Structure):
    _fields_ = _HEADER + [("in_features", c_int64), ("out_features", c_int64), ("bias", c_int), ("dtype", c_int),
                          ("dgrad", c_int), ("wgrad", c_int), ("fp8", c_int), ("fp8_recipe", Fp8Recipe)]


class NormConfig(ctypes.Structure):
    _fields_ = _HEADER + [("kind", c_int), ("hidden", c_int64), ("eps", c_float), ("dtype", c_int)]


class LayerNormLinearConfig(ctypes.Structure):
    _fields_ = _HEADER + [("norm", c_int), ("eps", c_float), ("in_features", c_int64), ("out_features", c_int64),
                          ("bias", c_int), ("dtype", c_int), ("dgrad", c_int), ("wgrad", c_int), ("fp8", c_int),
                          ("fp8_recipe", Fp8Recipe)]


class LayerNormMLPConfig(ctypes.Structure):
    _fields_ = _HEADER + [("hidden", c_int64), ("ffn", c_int64), ("norm", c_int), ("eps", c_float), ("dtype", c_int),
                          ("fp8", c_int), ("fp8_recipe", Fp8Recipe)]


class ResidualStackConfig(ctypes.Structure):
    _fields_ = _HEADER + [("hidden", c_int64), ("ffn", c_int64), ("layers", c_int64), ("vocab", c_int64),
                          ("norm", c_int), ("eps", c_float), ("dtype", c_int), ("seed", c_uint32),
                          ("experts", c_int64), ("topk", c_int64), ("moe_every", c_int64),
                          ("tensor_parallel", c_void_p), ("overlap", c_char_p)]


class AdamWConfig(ctypes.Structure):
    _fields_ = [("lr", c_float), ("beta1", c_float), ("beta2", c_float), ("eps", c_float),
                ("weight_decay", c_float)]


class LrSchedule(ctypes.Structure):
    """sg_lr_schedule: kind 0 constant, 1 cosine, 2 linear."""
    _fields_ = [("kind", c_int), ("base", c_float), ("min_lr", c_float), ("warmup", c_int64), ("total", c_int64)]


class TrainStepConfig(ctypes.Structure):
    """sg_train_step_config (version 2): fill it with sg_train_step_config_default, which sets
    size, magic and version, then set the fields."""
    _fields_ = [("size", c_size_t), ("magic", c_uint32), ("version", c_uint32), ("tokens", c_int64),
                ("world", c_void_p), ("sequences", c_int64), ("zero1", c_int)]


class OptimizerConfig(ctypes.Structure):
    """sg_optimizer_config (version 1): fill it with sg_optimizer_config_default."""
    _fields_ = [("size", c_size_t), ("magic", c_uint32), ("version", c_uint32), ("adamw", AdamWConfig),
                ("schedule", c_int), ("lr_schedule", LrSchedule), ("skip_nonfinite", c_int), ("loss_scaling", c_int),
                ("loss_scale_initial", c_float), ("loss_scale_growth_factor", c_float),
                ("loss_scale_backoff_factor", c_float), ("loss_scale_growth_interval", c_int),
                ("step_scoped_gradients", c_int)]


class LanguageModelConfig(ctypes.Structure):
    """sg_language_model_config (version 2): fill it with sg_language_model_config_default."""
    _fields_ = [("size", c_size_t), ("magic", c_uint32), ("version", c_uint32), ("vocab", c_int64),
                ("hidden", c_int64), ("ffn", c_int64), ("layers", c_int64), ("heads", c_int64),
                ("kv_heads", c_int64), ("context", c_int64), ("norm", c_int), ("eps", c_float), ("dtype", c_int),
                ("seed", c_uint32), ("experts", c_int64), ("topk", c_int64), ("moe_every", c_int64),
                ("rope_base", c_float), ("dropout", c_float), ("recompute_activation", c_int), ("fp8", c_int),
                ("fp8_recipe", Fp8Recipe), ("fp8_weight_cache", c_int), ("tensor_parallel", c_void_p),
                ("overlap", c_char_p), ("context_parallel", c_void_p)]


class CheckpointConfig(ctypes.Structure):
    """sg_checkpoint_config (version 1): fill it with sg_checkpoint_config_default."""
    _fields_ = [("size", c_size_t), ("magic", c_uint32), ("version", c_uint32), ("world", c_void_p),
                ("metadata_keys", POINTER(c_char_p)), ("metadata_values", POINTER(c_char_p)),
                ("metadata_count", c_size_t)]


class GraphCacheStats(ctypes.Structure):
    _fields_ = [("hits", c_int64), ("misses", c_int64), ("captures", c_int64), ("evictions", c_int64),
                ("entries", c_int64), ("pool_bytes", c_int64)]


# int (*)(void* user, sg_tensor* outputs, size_t capacity, size_t* count)
STEP_FN = ctypes.CFUNCTYPE(c_int, c_void_p, POINTER(c_void_p), c_size_t, POINTER(c_size_t))

H = c_void_p  # every opaque handle
P = POINTER
_STRING_OUT = [c_char_p, c_size_t, P(c_size_t)]

# name: argument types (restype sg_result = int unless listed in _OTHER_RESTYPES)
_PROTOTYPES = {
    "sg_cuda_device_count": [P(c_int)] + _STRING_OUT,
    "sg_context_create": [c_int, c_int, P(H)],
    "sg_context_destroy": [H],
    "sg_context_device": [H, P(c_int)],
    "sg_context_stream_count": [H, P(c_int)],
    "sg_context_cuda_stream": [H, c_int, P(c_void_p)],
    "sg_context_synchronize": [H],
    "sg_context_memory": [H, P(c_int64), P(c_int64), P(c_int64)],
    "sg_context_set_communication_stream": [H, c_int],
    "sg_context_communication_stream": [H, P(c_int)],
    "sg_context_set_gemm_algorithms": [H, c_char_p],
    "sg_context_gemm_algorithms": [H] + _STRING_OUT,
    "sg_stream_scope_enter": [H, c_int, P(H)],
    "sg_stream_scope_exit": [H],
    "sg_cuda_stream_synchronize": [c_void_p],
    "sg_tensor_create": [H, c_char_p, c_int, c_int, P(c_int64), P(H)],
    "sg_tensor_wrap": [H, c_char_p, c_int, c_int, P(c_int64), P(c_int64), c_void_p, P(H)],
    "sg_tensor_retain": [H, P(H)],
    "sg_tensor_destroy": [H],
    "sg_tensor_rank": [H, P(c_int)],
    "sg_tensor_dims": [H, P(c_int64), c_int],
    "sg_tensor_dtype": [H, P(c_int)],
    "sg_tensor_device": [H, P(c_int)],
    "sg_tensor_storage": [H, P(c_int)],
    "sg_tensor_numel": [H, P(c_int64)],
    "sg_tensor_bytes": [H, P(c_int64)],
    "sg_tensor_data": [H, P(c_void_p)],
    "sg_tensor_name": [H] + _STRING_OUT,
    "sg_tensor_set_name": [H, c_char_p],
    "sg_tensor_copy_from_host": [H, c_void_p, c_size_t],
    "sg_tensor_copy_to_host": [H, c_void_p, c_size_t],
    "sg_linear_create": [H, c_char_p, P(LinearConfig), c_uint32, P(H)],
    "sg_norm_create": [H, c_char_p, P(NormConfig), P(H)],
    "sg_layernorm_linear_create": [H, c_char_p, P(LayerNormLinearConfig), c_uint32, P(H)],
    "sg_layernorm_mlp_create": [H, c_char_p, P(LayerNormMLPConfig), c_uint32, P(H)],
    "sg_residual_stack_create": [H, P(ResidualStackConfig), P(H)],
    "sg_language_model_create": [H, P(LanguageModelConfig), P(H)],
    "sg_layer_destroy": [H],
    "sg_layer_kind": [H] + _STRING_OUT,
    "sg_layer_forward": [H, H, P(H), P(H)],
    "sg_layer_backward": [H, H, H, P(H)],
    "sg_saved_destroy": [H],
    "sg_layer_check_errors": [H],
    "sg_layer_parameter_count": [H, P(c_int64)],
    "sg_layer_parameter": [H, c_int64] + _STRING_OUT + [P(H), P(H), P(H)],
    "sg_layer_sync_parameters": [H],
    "sg_optimizer_destroy": [H],
    "sg_optimizer_step": [H],
    "sg_optimizer_steps_taken": [H, P(c_int64)],
    "sg_optimizer_create": [H, P(H), c_size_t, P(OptimizerConfig), P(H)],
    "sg_optimizer_skipped_steps": [H, P(c_int64)],
    "sg_optimizer_loss_scale": [H, P(c_float)],
    "sg_optimizer_set_lr": [H, c_float],
    "sg_optimizer_lr": [H, P(c_float)],
    "sg_world_init": [c_int, c_double, P(H)],
    "sg_world_destroy": [H],
    "sg_world_split": [H, c_int, c_int, P(H)],
    "sg_world_rank": [H, P(c_int)],
    "sg_world_size": [H, P(c_int)],
    "sg_world_local_rank": [H, P(c_int)],
    "sg_world_describe": [H] + _STRING_OUT,
    "sg_train_step_create": [H, H, P(TrainStepConfig), P(H)],
    "sg_train_step_destroy": [H],
    "sg_train_step_inputs": [H, P(H), P(H)],
    "sg_train_step_packing": [H, P(H)],
    "sg_train_step_run": [H, P(H)],
    "sg_train_step_check_errors": [H],
    "sg_capture": [H, STEP_FN, c_void_p, c_int, P(H)],
    "sg_train_step_capture": [H, c_int, P(H)],
    "sg_graph_destroy": [H],
    "sg_graph_replay": [H, P(H), P(H), c_size_t],
    "sg_graph_replay_ordered": [H, P(H), P(H), c_size_t, P(c_void_p), c_size_t],
    "sg_graph_output_count": [H, P(c_size_t)],
    "sg_graph_output": [H, c_size_t, P(H)],
    "sg_graph_replay_count": [H, P(c_int64)],
    "sg_graph_segment_count": [H, P(c_size_t)],
    "sg_graph_pool_bytes": [H, P(c_int64)],
    "sg_graph_pool_report_count": [H, P(c_size_t), P(c_int64)],
    "sg_graph_pool_report": [H] + _STRING_OUT,
    "sg_graph_dump": [H] + _STRING_OUT,
    "sg_graph_release_pool": [H],
    "sg_graph_profile": [H],
    "sg_graph_last_profile": [H] + _STRING_OUT,
    "sg_graph_cache_create": [c_int64, P(H)],
    "sg_graph_cache_destroy": [H],
    "sg_graph_cache_get_or_capture": [H, c_char_p, H, STEP_FN, c_void_p, c_int, P(H)],
    "sg_graph_cache_contains": [H, c_char_p, H, P(c_int)],
    "sg_graph_cache_erase": [H, c_char_p, H],
    "sg_graph_cache_clear": [H],
    "sg_graph_cache_get_stats": [H, P(GraphCacheStats)],
    "sg_graphed_layers_capture": [H, P(H), c_size_t, P(H), P(c_int64), c_size_t, c_int, P(H)],
    "sg_graphed_layers_destroy": [H],
    "sg_graphed_layers_forward": [H, c_int64, H, P(c_void_p), c_size_t, P(H)],
    "sg_graphed_layers_backward": [H, c_int64, H, P(c_void_p), c_size_t, P(H)],
    "sg_graphed_layers_input": [H, c_int64, P(H)],
    "sg_graphed_layers_grad_output": [H, c_int64, P(H)],
    "sg_graphed_layers_gradient_count": [H, P(c_size_t)],
    "sg_graphed_layers_gradient": [H, c_size_t, P(H)],
    "sg_graphed_layers_graph_count": [H, P(c_size_t)],
    "sg_graphed_layers_pool_bytes": [H, P(c_int64), P(c_int64)],
    "sg_graphed_layers_next_graph": [H] + _STRING_OUT,
    "sg_checkpoint_save": [H, H, c_char_p, P(CheckpointConfig)],
    "sg_checkpoint_load": [H, H, c_char_p, P(CheckpointConfig), P(H)],
    "sg_checkpoint_metadata_count": [H, P(c_size_t)],
    "sg_checkpoint_metadata_entry": [H, c_size_t, c_char_p, c_size_t, P(c_size_t), c_char_p, c_size_t, P(c_size_t)],
    "sg_checkpoint_metadata_destroy": [H],
}

_OTHER_RESTYPES = {
    "sg_last_error": (c_char_p, []),
    "sg_result_name": (c_char_p, [c_int]),
    "sg_api_version": (c_int, []),
    "sg_step_error": (None, [c_char_p]),
    "sg_linear_config_default": (None, [P(LinearConfig)]),
    "sg_norm_config_default": (None, [P(NormConfig)]),
    "sg_fp8_recipe_default": (None, [P(Fp8Recipe), c_int]),
    "sg_layernorm_linear_config_default": (None, [P(LayerNormLinearConfig)]),
    "sg_layernorm_mlp_config_default": (None, [P(LayerNormMLPConfig)]),
    "sg_residual_stack_config_default": (None, [P(ResidualStackConfig)]),
    "sg_adamw_config_default": (None, [P(AdamWConfig)]),
    "sg_train_step_config_default": (None, [P(TrainStepConfig)]),
    "sg_optimizer_config_default": (None, [P(OptimizerConfig)]),
    "sg_language_model_config_default": (None, [P(LanguageModelConfig)]),
    "sg_checkpoint_config_default": (None, [P(CheckpointConfig)]),
}

_lib = None


def lib():
    """The loaded library with every prototype declared (loaded on first use)."""
    global _lib
    if _lib is None:
        path = library_path().resolve()
        try:
            loaded = ctypes.CDLL(str(path))
        except OSError as error:
            raise StepGraphError(f"loading {path} failed: {error}") from error
        for name, argtypes in _PROTOTYPES.items():
            function = getattr(loaded, name)
            function.argtypes = argtypes
            function.restype = c_int
        for name, (restype, argtypes) in _OTHER_RESTYPES.items():
            function = getattr(loaded, name)
            function.argtypes = argtypes
            function.restype = restype
        version = loaded.sg_api_version()
        if version != API_VERSION:
            raise StepGraphError(f"{path} has C API version {version}; this package needs {API_VERSION}")
        _lib = loaded
    return _lib


def call(name, *args):
    """Calls sg_<name>; a failed call raises StepGraphError with the engine's message."""
    result = getattr(lib(), name)(*args)
    if result != 0:
        raise StepGraphError(lib().sg_last_error().decode("utf-8", "replace"), result)


def string_out(name, *args):
    """Calls a (buffer, capacity, length) function and returns the whole string."""
    capacity = 256
    while True:
        buffer = ctypes.create_string_buffer(capacity)
        length = c_size_t()
        call(name, *args, buffer, capacity, ctypes.byref(length))
        if length.value < capacity:
            return buffer.value.decode("utf-8", "replace")
        capacity = length.value + 1


def new_handle():
    return c_void_p()


def destroy(name, handle):
    """Destroys a handle from a finalizer: never raises (the interpreter may be exiting)."""
    try:
        if handle and _lib is not None:
            getattr(_lib, name)(handle)
    except Exception:  # noqa: BLE001 - finalizers must not raise
        pass
