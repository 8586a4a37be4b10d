"""Context: where StepGraph runs (cuda or host), and the tensors it owns or wraps."""

import contextlib
import ctypes
import itertools

import numpy as np

from stepgraph import _capi, _checks, _extent
from stepgraph._library import StepGraphError
from stepgraph.dtypes import as_dtype, to_storage
from stepgraph.tensor import Tensor, _is_torch, describe_array

_DEVICES = {"cuda": 0, "host": 1}
_GEMM_ALGORITHMS = ("heuristic", "timed")  # engine/algorithm_choice.h
_names = itertools.count()


def cuda_device_count():
    """(count, reason): how many CUDA devices there are, and why none when 0."""
    count = ctypes.c_int()
    buffer = ctypes.create_string_buffer(512)
    _capi.call("sg_cuda_device_count", ctypes.byref(count), buffer, 512, None)
    return count.value, buffer.value.decode()


class Context:
    """A StepGraph context on "cuda" or "host", with `side_streams` extra streams.

        with stepgraph.Context("host") as ctx:
            x = ctx.from_numpy(np.ones((4, 8), np.float32))

    `communication_stream`: the side stream collective ops run on (a data-parallel
    TrainStep's gradient all-reduces), so communication overlaps compute; None (the
    default) runs them on the current stream. E.g. Context(device, side_streams=2,
    communication_stream=2).

    Closing it (or leaving the with block) drops this handle; layers, tensors and
    graphs made from it keep the engine's context alive until they go too.
    """

    def __init__(self, device="cuda", side_streams=1, communication_stream=None, gemm_algorithms="heuristic"):
        _checks.check_choice("device", device, _DEVICES, "Context")
        gemm_algorithms = _checks.check_choice("gemm_algorithms", gemm_algorithms, _GEMM_ALGORITHMS, "Context")
        side_streams = _checks.check_int("side_streams", side_streams, *_checks.NON_NEGATIVE_INT32, "Context")
        if communication_stream is not None:
            communication_stream = _checks.check_int("communication_stream", communication_stream,
                                                     *_checks.NON_NEGATIVE_INT32, "Context")
        self._handle = _capi.new_handle()
        _capi.call("sg_context_create", _DEVICES[device], side_streams, ctypes.byref(self._handle))
        self._device = device
        if communication_stream is not None:
            self.communication_stream = communication_stream
        _capi.call("sg_context_set_gemm_algorithms", self._handle, gemm_algorithms.encode())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        _capi.destroy("sg_context_destroy", getattr(self, "_handle", None))
        self._handle = None

    __del__ = close

    @property
    def handle(self):
        if not self._handle:
            raise StepGraphError("this Context is closed")
        return self._handle

    @property
    def device(self):
        return self._device

    @property
    def stream_count(self):
        value = ctypes.c_int()
        _capi.call("sg_context_stream_count", self.handle, ctypes.byref(value))
        return value.value

    @property
    def gemm_algorithms(self):
        """How cuBLASLt's GEMM algorithms are picked: "heuristic" (the same bits on every run) or "timed"
        (the fastest in this process), the trainer's --gemm-algorithms."""
        return _capi.string_out("sg_context_gemm_algorithms", self.handle)

    @property
    def communication_stream(self):
        """The side stream collective ops run on, or None: the current stream."""
        value = ctypes.c_int()
        _capi.call("sg_context_communication_stream", self.handle, ctypes.byref(value))
        return None if value.value < 0 else value.value

    @communication_stream.setter
    def communication_stream(self, index):
        """A side stream in [1, stream_count), or None for the current stream. Set it before capturing."""
        if index is None:
            index = -1
        else:
            index = _checks.check_int("communication_stream", index, *_checks.NON_NEGATIVE_INT32, "Context")
        _capi.call("sg_context_set_communication_stream", self.handle, index)

    def cuda_stream(self, index=0):
        """The cudaStream_t of stream `index` as an int (cuda only)."""
        index = _checks.check_int("index", index, *_checks.NON_NEGATIVE_INT32, "cuda_stream")
        value = ctypes.c_void_p()
        _capi.call("sg_context_cuda_stream", self.handle, index, ctypes.byref(value))
        return value.value or 0

    def synchronize(self):
        """Waits for all of this context's work (before another library reads its results)."""
        _capi.call("sg_context_synchronize", self.handle)

    def memory(self):
        """{"persistent_bytes", "eager_bytes", "eager_peak_bytes"}."""
        values = [ctypes.c_int64() for _ in range(3)]
        _capi.call("sg_context_memory", self.handle, *[ctypes.byref(v) for v in values])
        return dict(zip(("persistent_bytes", "eager_bytes", "eager_peak_bytes"), (v.value for v in values)))

    @contextlib.contextmanager
    def stream(self, index):
        """Ops called inside the block go to stream `index` (0 is the main stream)."""
        index = _checks.check_int("index", index, *_checks.NON_NEGATIVE_INT32, "stream")
        scope = _capi.new_handle()
        _capi.call("sg_stream_scope_enter", self.handle, index, ctypes.byref(scope))
        try:
            yield
        finally:
            _capi.call("sg_stream_scope_exit", scope)

    # --- tensors ------------------------------------------------------------------

    def tensor(self, shape, dtype="float32", name=None):
        """A zero-filled persistent tensor (a fixed address for the context's life)."""
        shape = _checks.check_shape("shape", shape, "tensor")
        dtype = as_dtype(dtype, "dtype", "tensor")
        name = _checks.check_name("name", f"tensor{next(_names)}" if name is None else name, "tensor")
        dims = (ctypes.c_int64 * max(len(shape), 1))(*shape)
        handle = _capi.new_handle()
        _capi.call("sg_tensor_create", self.handle, name, int(dtype), len(shape), dims, ctypes.byref(handle))
        return Tensor(handle)

    def from_numpy(self, array, dtype=None, name=None):
        """A persistent tensor holding a copy of `array` (converted to `dtype`, default the array's;
        a 0-d array gives a tensor of shape ())."""
        array = np.asarray(array)
        dtype = as_dtype(dtype if dtype is not None else array.dtype, "dtype", "from_numpy")
        data = to_storage(array, dtype, "from_numpy: array")  # refused before a tensor is made
        tensor = self.tensor(array.shape, dtype, name)
        tensor.copy_from(data.reshape(array.shape), "from_numpy: array")
        return tensor

    def wrap(self, array, name=None):
        """A persistent tensor over `array`'s own memory, no copy: torch tensors and objects with
        __cuda_array_interface__ (cupy) on cuda, numpy arrays (and other objects with
        __array_interface__) on host. The array must be contiguous (row-major) and writable.

        Checked here: the dtype, shape and strides, and that the view lies inside the memory
        behind the object where the object can tell: a numpy array's base buffer (an array that
        owns its data, or a bytes-like object at the end of its .base chain), a torch tensor's
        storage (untyped_storage().nbytes() from storage_offset), a cupy array's allocation
        (data.mem.size). An as_strided view larger than its buffer is refused.

        Trusted, since nothing can check it: an object whose buffer is unknown (an
        __array_interface__ or __cuda_array_interface__ of another library, a numpy view of
        memory numpy does not own) must describe memory it really has, readable and writable
        for the tensor's bytes. And the memory must stay alive and in place while StepGraph
        uses it: the Tensor keeps a reference to `array`, and a captured step that reads the
        tensor needs it as long as the graph lives. Resizing or freeing the memory behind the
        object's back (torch's resize_, a cupy memory pool released) is the caller's to avoid."""
        name = _checks.check_name("name", f"wrapped{next(_names)}" if name is None else name, "wrap")
        dtype, shape, strides, byte_strides, pointer, stream, contiguous = describe_array(array, self._device)
        if contiguous is False:
            raise StepGraphError("cannot wrap a non-contiguous torch tensor: StepGraph reads dense rows; "
                                 "call .contiguous() first")
        _extent.check_fits(array, _is_torch(array), pointer, shape, byte_strides, dtype.itemsize)
        if stream is not None:
            # The producer's stream: wait for its pending writes (the array interface's stream rule).
            # 0 is the legacy default stream: torch's current stream unless one was chosen.
            stream = _checks.check_int("the array interface's stream", stream, 0, 2**64 - 1, "wrap")
            _capi.call("sg_cuda_stream_synchronize", ctypes.c_void_p(stream))
        dims = (ctypes.c_int64 * max(len(shape), 1))(*shape)
        stride_array = (ctypes.c_int64 * max(len(strides), 1))(*strides) if strides is not None else None
        handle = _capi.new_handle()
        _capi.call("sg_tensor_wrap", self.handle, name, int(dtype), len(shape), dims, stride_array,
                   ctypes.c_void_p(pointer), ctypes.byref(handle))
        tensor = Tensor(handle, owner=array)
        tensor._source_stream = stream
        return tensor
