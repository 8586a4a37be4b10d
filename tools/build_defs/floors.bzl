"""The floors of the tree and who may build on each (README: Layout).

Every dependency points down. A target's `visibility` names the floors above
it, so a dependency from a lower floor to a higher one is a build error:

    trainer/ benchmarks/ tools/ python/   the programs
    capi/                                 the C API
    train/      checkpoint/               training steps, pipeline schedules of layers |
                                          a run's state on disk (siblings)
    optim/                                the optimizer (AdamW, its ZeRO-1 shards)
    layers/                               layers and models
    ops/        graphs/                   op definitions | trace, plan, capture (siblings:
                                          neither sees the other)
    kernels/    launch/                   CUDA kernels and host references | how the
                                          processes of a run find each other (siblings)
    engine/                               the ground floor

tests/ sees every floor. tools/check_layering.sh proves the rule holds.
"""

_PROGRAMS = [
    "//benchmarks:__subpackages__",
    "//python:__subpackages__",
    "//tests:__subpackages__",
    "//tools:__subpackages__",
    "//trainer:__subpackages__",
]

# capi/ is used by the programs only.
CAPI_USERS = _PROGRAMS

# train/ (training steps, pipeline schedules) by capi/ and the programs.
TRAIN_USERS = ["//capi:__subpackages__"] + _PROGRAMS

# checkpoint/ (a run's state on disk) by the same: train/'s sibling, neither sees the other.
CHECKPOINT_USERS = TRAIN_USERS

# optim/ (the optimizer) by train/, checkpoint/ and everything above them.
OPTIM_USERS = ["//train:__subpackages__", "//checkpoint:__subpackages__"] + TRAIN_USERS

# layers/ by optim/ and everything above it.
LAYERS_USERS = ["//optim:__subpackages__"] + OPTIM_USERS

# ops/ and graphs/ (one floor, two rooms) by layers/ and everything above.
OPS_USERS = ["//layers:__subpackages__"] + LAYERS_USERS
GRAPHS_USERS = OPS_USERS

# kernels/ by ops/ and everything above it (layers name kernel enums in their configs).
KERNELS_USERS = ["//ops:__subpackages__"] + OPS_USERS

# launch/ (the launchers' environment, the rendezvous) by capi/ and the
# programs: only they start or join a multi-process run.
LAUNCH_USERS = CAPI_USERS + ["//capi:__subpackages__"]

# engine/ by everyone.
ENGINE_USERS = ["//:__subpackages__"]
