"""Checkpoints: a model's and its AdamW's whole training state saved to a file and loaded back (the
trainer's --checkpoint, --save-every and --resume; C API sg_checkpoint_save and sg_checkpoint_load).

    sg.save_checkpoint("run.safetensors", model, optimizer, metadata={"data.position": str(position)})
    ...
    metadata = sg.load_checkpoint("run.safetensors", model, optimizer)  # a model and optimizer built alike
    position = int(metadata["data.position"])
"""

import ctypes
import os

from stepgraph import _capi, _checks
from stepgraph.distributed import World
from stepgraph.language_model import LanguageModel
from stepgraph.layers import ResidualStack
from stepgraph.training import AdamW

# The entries the library writes itself (capi/stepgraph.h): a caller's metadata may not use them.
STEP_KEY = "stepgraph.step"
_RESERVED = (STEP_KEY, "stepgraph.checksum", "stepgraph.checkpoint_set")


def _checked(path, model, optimizer, world, owner):
    """The C arguments of a checkpoint call: the path as bytes and the config with the world set."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{owner}: path must be a str or os.PathLike (the checkpoint's file), got "
                        f"{type(path).__name__} {path!r}")
    path = _checks.check_name("path", os.fspath(path), owner)
    _checks.check_instance("model", model, (LanguageModel, ResidualStack),
                           "a stepgraph LanguageModel or ResidualStack", owner)
    _checks.check_instance("optimizer", optimizer, AdamW, "the stepgraph AdamW made over the model", owner)
    if world is not None:
        _checks.check_instance("world", world, World, "a stepgraph World (from init_distributed) or None", owner)
    config = _capi.CheckpointConfig()
    _capi.lib().sg_checkpoint_config_default(ctypes.byref(config))
    config.world = world.handle.value if world is not None else None
    return path, config


def _checked_metadata(metadata, owner):
    """`metadata` (a mapping of str to str) as two lists of UTF-8 bytes, keys checked."""
    if metadata is None:
        return [], []
    if not hasattr(metadata, "items"):
        raise TypeError(f"{owner}: metadata must be a dict of str keys to str values or None, got "
                        f"{type(metadata).__name__} {metadata!r}")
    keys, values = [], []
    for key, value in metadata.items():
        if not isinstance(key, str):
            raise TypeError(f"{owner}: metadata keys must be str, got {type(key).__name__} {key!r}")
        name = f"metadata[{key!r}]"
        if key in _RESERVED:
            raise _checks.ArgumentError(f"{owner}: {name} is an entry the library writes itself (the step, the "
                                        f"checksum, a set's manifest); choose another key")
        if not isinstance(value, str):
            raise TypeError(f"{owner}: {name} must be a str (write numbers with str()), got "
                            f"{type(value).__name__} {value!r}")
        keys.append(_checks.check_name("metadata key", key, owner))
        if "\0" in value:
            raise _checks.ArgumentError(f"{owner}: {name} must not contain a NUL character (C strings end there)")
        try:
            values.append(value.encode("utf-8"))
        except UnicodeEncodeError as error:
            raise _checks.ArgumentError(f"{owner}: {name} is not valid Unicode text ({error.reason})") from None
    return keys, values


def save_checkpoint(path, model, optimizer, metadata=None, world=None):
    """Saves `model`'s and `optimizer`'s whole training state after the steps run so far to `path`:
    every parameter's fp32 master, AdamW's moments and step counter, the skipped-step tally and loss
    scale where it keeps them, the model's other state (FP8 scaling state, the dropout generator).
    The file is the trainer's format (safetensors with a checksum, written atomically: a crash
    leaves the previous file whole).

    metadata: a dict of str to str saved with it (a data position, the script's settings); the
    library adds "stepgraph.step", the steps the optimizer ran.
    world: None for one process. With a World of several ranks every rank calls it: where every rank
    holds the same state rank 0 writes `path` and the others wait for it; with dp_mode="zero1" (or a
    tensor-parallel model) each rank writes its own part beside `path`, committed together by a
    manifest at `path`. Pass the whole world: every rank that holds a part."""
    owner = "save_checkpoint"
    path, config = _checked(path, model, optimizer, world, owner)
    keys, values = _checked_metadata(metadata, owner)
    key_array = (ctypes.c_char_p * len(keys))(*keys)
    value_array = (ctypes.c_char_p * len(values))(*values)
    config.metadata_keys = ctypes.cast(key_array, ctypes.POINTER(ctypes.c_char_p))
    config.metadata_values = ctypes.cast(value_array, ctypes.POINTER(ctypes.c_char_p))
    config.metadata_count = len(keys)
    _capi.call("sg_checkpoint_save", model._handle, optimizer._handle, path, ctypes.byref(config))


def load_checkpoint(path, model, optimizer, world=None):
    """Loads the state saved at `path` into `model` and `optimizer`, built as the saving run built
    them (same config and options, e.g. a new Context after a restart), and returns its metadata: a
    dict of str to str with the caller's entries and "stepgraph.step". The next steps equal those of
    the run that saved it, bit for bit; a step captured before the load replays from the loaded
    state. A tensor of another shape or dtype, or one the model lacks, is an error naming it; a
    corrupt or truncated file an error naming the file; nothing is loaded then. `world`: as for
    save_checkpoint (each rank of a ZeRO-1 run loads its own part).

    A checkpoint of the trainer (--checkpoint) loads too, where the model and optimizer match its
    flags: its metadata holds the flags as "config.<flag>" and the data position as
    "stepgraph.data_position" (python/README.md: "Checkpoints")."""
    owner = "load_checkpoint"
    path, config = _checked(path, model, optimizer, world, owner)
    handle = _capi.new_handle()
    _capi.call("sg_checkpoint_load", model._handle, optimizer._handle, path, ctypes.byref(config),
               ctypes.byref(handle))
    try:
        count = ctypes.c_size_t()
        _capi.call("sg_checkpoint_metadata_count", handle, ctypes.byref(count))
        metadata = {}
        for index in range(count.value):
            key_length, value_length = ctypes.c_size_t(), ctypes.c_size_t()
            _capi.call("sg_checkpoint_metadata_entry", handle, index, None, 0, ctypes.byref(key_length), None, 0,
                       ctypes.byref(value_length))
            key = ctypes.create_string_buffer(key_length.value + 1)
            value = ctypes.create_string_buffer(value_length.value + 1)
            _capi.call("sg_checkpoint_metadata_entry", handle, index, key, len(key), None, value, len(value), None)
            metadata[key.value.decode("utf-8", "replace")] = value.value.decode("utf-8", "replace")
        return metadata
    finally:
        _capi.call("sg_checkpoint_metadata_destroy", handle)
