"""init_distributed: this process's place among the ranks of a data-parallel run, read from the
environment the launcher set up (torchrun, Slurm srun, Open MPI mpirun), as the C++ trainer reads it.

    world = sg.init_distributed()          # before sg.Context: on cuda it picks this rank's GPU
    with sg.Context(world.device, side_streams=2, communication_stream=2) as ctx:
        ...
        step = sg.TrainStep(model, optimizer, tokens=global_tokens // world.size, world=world)
"""

import ctypes

from stepgraph import _capi, _checks
from stepgraph._library import StepGraphError
from stepgraph.context import cuda_device_count

_DEVICES = {"cuda": 0, "host": 1}
# The C API's bounds (sg_world_init): a millisecond to a week.
MIN_TIMEOUT, MAX_TIMEOUT = 0.001, 7 * 24 * 3600.0


def init_distributed(device="auto", timeout=300):
    """Joins the world the launcher's variables describe and returns it (a `World`).

    torchrun's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT are read
    first, then srun's SLURM_* and mpirun's OMPI_COMM_WORLD_* variables; with none of them set the
    world is this process alone (rank 0 of 1: no communicator, no socket), so the same script runs
    unchanged without a launcher. Otherwise every rank meets rank 0 at MASTER_ADDR:MASTER_PORT,
    waiting at most `timeout` seconds for the others, and they build a communicator: NCCL on
    "cuda" (this rank's GPU, LOCAL_RANK, becomes the current device: call this before creating a
    Context), TCP between the processes on "host". "auto" is "cuda" where there is a GPU, else
    "host"; every rank must pick the same device. `timeout` also bounds each later collective: a
    rank that died ends the others' next step with a StepGraphError instead of a hang."""
    _checks.check_choice("device", device, ("auto", *_DEVICES), "init_distributed")
    timeout = _checks.check_real("timeout", timeout, MIN_TIMEOUT, MAX_TIMEOUT, "init_distributed")
    if device == "auto":
        device = "cuda" if cuda_device_count()[0] > 0 else "host"
    return World._join(device, timeout)


class World:
    """The ranks of a data-parallel run as this process sees them (make one with init_distributed).

    `rank` in [0, size), `size` (the number of ranks), `local_rank` (the index among the ranks of
    this host: its GPU on cuda), `device`. A context manager: close() (or leaving the with block)
    drops this handle; train steps made with the world keep its communicator alive until they and
    their graphs go, so close it after the last step (a rank that closes early ends the others'
    next step with an error)."""

    def __init__(self, *args, **kwargs):
        raise TypeError("make a World with stepgraph.init_distributed(device, timeout)")

    @classmethod
    def _join(cls, device, timeout):
        self = object.__new__(cls)
        self._handle = _capi.new_handle()
        _capi.call("sg_world_init", _DEVICES[device], timeout, ctypes.byref(self._handle))
        return self._read(device)

    def split(self, color, key=None):
        """The ranks of this world that pass the same `color` (>= 0), ordered by `key` (default: the rank),
        as a World of their own; every rank must call it. The trainer's --dp x --tp is
        `tp = world.split(world.rank // TP)` (the model's tensor_parallel) and `dp = world.split(world.rank % TP)`
        (the TrainStep's world). NCCL worlds (cuda) split; the host's TCP worlds of several ranks cannot
        yet (a StepGraphError)."""
        color = _checks.check_int("color", color, *_checks.NON_NEGATIVE_INT32, "World.split")
        key = self._rank if key is None else _checks.check_int("key", key, *_checks.INT32, "World.split")
        group = object.__new__(World)
        group._handle = _capi.new_handle()
        _capi.call("sg_world_split", self.handle, color, key, ctypes.byref(group._handle))
        return group._read(self._device)

    def _read(self, device):
        self._device = device
        values = {}
        for name in ("rank", "size", "local_rank"):
            value = ctypes.c_int()
            _capi.call(f"sg_world_{name}", self._handle, ctypes.byref(value))
            values[name] = value.value
        self._rank, self._size, self._local_rank = values["rank"], values["size"], values["local_rank"]
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        _capi.destroy("sg_world_destroy", getattr(self, "_handle", None))
        self._handle = None

    __del__ = close

    @property
    def closed(self):
        return not self._handle

    @property
    def handle(self):
        if not self._handle:
            raise StepGraphError("this World is closed")
        return self._handle

    @property
    def rank(self):
        return self._rank

    @property
    def size(self):
        return self._size

    @property
    def local_rank(self):
        return self._local_rank

    @property
    def device(self):
        return self._device

    def describe(self):
        """"rank 1 of 2 (local 1 of 2) via torchrun, rendezvous 127.0.0.1:29500; communicator ...", for logs."""
        return _capi.string_out("sg_world_describe", self.handle)

    def __repr__(self):
        state = " closed" if self.closed else ""
        return (f"<stepgraph.World rank {self._rank} of {self._size} (local {self._local_rank}) on "
                f"{self._device}{state}>")
