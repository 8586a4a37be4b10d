"""A context-parallel rank's share of a batch (the C++ train/context_parallel_batch.h; Note
[Context-parallel token layout] in kernels/context_parallel_plan.h)."""

import numpy as np

from stepgraph import _checks
from stepgraph._library import ArgumentError
from stepgraph.distributed import World


def context_parallel_rows(values, world):
    """This rank's tokens (or labels) of a context-parallel group's batch: its T tokens, in order, cut
    into 2N equal chunks for the N ranks of `world`; rank r keeps chunk r then chunk 2N - 1 - r, which
    balances the causal mask's work. Load the result into a TrainStep of a model built with
    context_parallel=world; the packing stays the whole batch's. T must divide into 2N chunks (an
    ArgumentError otherwise)."""
    _checks.check_instance("world", world, World, "a stepgraph World (sg.init_distributed())")
    flat = np.asarray(values).reshape(-1)
    if flat.dtype.kind not in "iu":
        raise TypeError(f"context_parallel_rows: values must be token ids or labels (integers), got an array of "
                        f"{flat.dtype}")
    ranks, rank = world.size, world.rank
    if flat.size == 0 or flat.size % (2 * ranks) != 0:
        raise ArgumentError(f"context_parallel_rows: the batch's {flat.size} tokens must divide into 2 x {ranks} "
                         f"context-parallel chunks; make the tokens a multiple of {2 * ranks}")
    chunk = flat.size // (2 * ranks)
    return np.concatenate([flat[rank * chunk:(rank + 1) * chunk],
                           flat[(2 * ranks - 1 - rank) * chunk:(2 * ranks - rank) * chunk]])
