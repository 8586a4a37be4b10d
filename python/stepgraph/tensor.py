"""Tensor: a handle to a StepGraph tensor, viewable by NumPy, torch and CuPy without copies."""

import ctypes

import numpy as np

from stepgraph import _capi, _checks
from stepgraph._library import StepGraphError
from stepgraph.dtypes import DType, as_dtype, bf16_bits_to_float32, from_typestr, numpy_storage, to_storage, typestr

STORAGE_NAMES = {0: "persistent", 1: "eager", 2: "traced", 3: "pool", 4: "unavailable"}


class _Interface:
    """An array-interface view of a tensor (another type string), keeping the tensor alive."""

    def __init__(self, tensor, interface_name, interface):
        self._tensor = tensor
        setattr(self, interface_name, interface)


class Tensor:
    """A StepGraph tensor. Made by a Context (create, wrap, from_numpy), by layers
    (outputs), by captured steps (outputs) or by parameters.

    On cuda it exposes `__cuda_array_interface__`, on host `__array_interface__`
    (bf16 and fp8 as opaque '<V2' / '|V1'); `.torch()` and `.numpy()` give
    typed views without a copy where the memory is reachable.
    """

    # The stream a wrapped array was produced on (torch's current stream, or the
    # array interface's stream), which may reuse its memory once it is dropped:
    # a replay that copies from this tensor orders it after the copy.
    _source_stream = None

    def __init__(self, handle, owner=None):
        self._handle = None
        self._handle = _checks.check_handle(handle, "a Tensor is made by a Context (tensor, wrap, from_numpy), a "
                                                    "layer or a captured step")  # c_void_p, owned
        self._owner = owner  # the wrapped object whose memory this tensor uses

    def __del__(self):
        _capi.destroy("sg_tensor_destroy", getattr(self, "_handle", None))
        self._handle = None

    @classmethod
    def _adopt(cls, handle):
        """A Tensor owning a handle just returned by the C API (None stays None)."""
        return cls(handle) if handle.value else None

    def _get(self, name, ctype):
        value = ctype()
        _capi.call(name, self._handle, ctypes.byref(value))
        return value.value

    @property
    def shape(self):
        rank = self._get("sg_tensor_rank", ctypes.c_int)
        dims = (ctypes.c_int64 * max(rank, 1))()
        _capi.call("sg_tensor_dims", self._handle, dims, rank)
        return tuple(dims[i] for i in range(rank))

    @property
    def dtype(self):
        return DType(self._get("sg_tensor_dtype", ctypes.c_int))

    @property
    def device(self):
        return "cuda" if self._get("sg_tensor_device", ctypes.c_int) == 0 else "host"

    @property
    def storage(self):
        """"persistent", "eager", "traced" or "pool"."""
        return STORAGE_NAMES[self._get("sg_tensor_storage", ctypes.c_int)]

    @property
    def numel(self):
        return self._get("sg_tensor_numel", ctypes.c_int64)

    @property
    def nbytes(self):
        return self._get("sg_tensor_bytes", ctypes.c_int64)

    @property
    def data_ptr(self):
        """The data's address (device memory on cuda); an error for a traced value."""
        return self._get("sg_tensor_data", ctypes.c_void_p) or 0

    @property
    def name(self):
        return _capi.string_out("sg_tensor_name", self._handle)

    @name.setter
    def name(self, value):
        _capi.call("sg_tensor_set_name", self._handle, _checks.check_name("name", value, "Tensor"))

    def __repr__(self):
        try:
            return f"Tensor('{self.name}', {list(self.shape)}, {self.dtype.short_name}, {self.device}, {self.storage})"
        except StepGraphError as error:
            return f"Tensor(<{error.message}>)"

    # --- zero-copy views -------------------------------------------------------

    def _interface(self, type_string):
        # Always dense row-major: strides None.
        return {"shape": self.shape, "typestr": type_string, "data": (self.data_ptr, False), "strides": None,
                "version": 3}

    @property
    def __cuda_array_interface__(self):
        if self.device != "cuda":
            raise AttributeError("a host tensor has no __cuda_array_interface__; use __array_interface__")
        interface = self._interface(typestr(self.dtype))
        interface["stream"] = None  # StepGraph synchronizes its streams itself; see Context.synchronize
        return interface

    @property
    def __array_interface__(self):
        if self.device != "host":
            raise AttributeError("a cuda tensor has no __array_interface__; use .numpy() for a host copy")
        return self._interface(typestr(self.dtype))

    def numpy(self):
        """The data as a NumPy array: a view (no copy) on host, a copy from cuda.
        bf16 comes as uint16 bits and fp8 as uint8 bits (see to_float32)."""
        storage = numpy_storage(self.dtype)
        if self.numel == 0:  # no memory to view (its address may be null): an empty array
            return np.empty(self.shape, dtype=storage)
        if self.device == "host":
            view = _Interface(self, "__array_interface__", self._interface(storage.str))
            return np.asarray(view)
        out = np.empty(self.shape, dtype=storage)
        _capi.call("sg_tensor_copy_to_host", self._handle, out.ctypes.data_as(ctypes.c_void_p), out.nbytes)
        return out

    def to_float32(self):
        """A float32 NumPy copy of the values (bf16 converted exactly)."""
        data = self.numpy()
        if self.dtype == DType.BFLOAT16:
            return bf16_bits_to_float32(data).reshape(self.shape)
        return np.array(data, dtype=np.float32)

    def item(self):
        """The value of a one-element tensor."""
        if self.numel != 1:
            raise StepGraphError(f"item() needs one element; {self!r} has {self.numel}")
        return self.to_float32().reshape(()).item()

    def torch(self):
        """A torch tensor over the same memory (no copy), with the same dtype."""
        import torch  # imported here: torch is optional

        dtype = self.dtype
        # Raw bits torch reads from an array interface (int16: every torch version has it), then
        # viewed as the real type.
        bits = "<i2" if dtype == DType.BFLOAT16 else numpy_storage(dtype).str
        name = "__cuda_array_interface__" if self.device == "cuda" else "__array_interface__"
        if self.numel == 0:  # no memory to view (its address may be null): an empty tensor
            raw = torch.from_numpy(np.empty(self.shape, dtype=bits)).to("cuda" if self.device == "cuda" else "cpu")
        elif self.device == "cuda":
            raw = torch.as_tensor(_Interface(self, name, self._interface(bits)), device="cuda")
        else:
            raw = torch.from_numpy(np.asarray(_Interface(self, name, self._interface(bits))))
        torch_dtype = _torch_view_dtype(torch, dtype)
        return raw.view(torch_dtype) if torch_dtype is not None else raw

    def copy_from(self, array, name="copy_from: array"):
        """Copies host data in. The array's shape must be this tensor's shape exactly; its values are
        converted to this tensor's dtype as dtypes.to_storage says (floats to bf16 bits for bf16,
        integer arrays only for int32/int64, values that fit)."""
        _checks.check_instance("name", name, str, "a str (the array's name in messages)", "copy_from")
        array = _checks.check_array_shape(name, array, self.shape, self.dtype.short_name)
        data = to_storage(array, self.dtype, name)
        _capi.call("sg_tensor_copy_from_host", self._handle, data.ctypes.data_as(ctypes.c_void_p), data.nbytes)


def _torch_view_dtype(torch, dtype):
    """The torch dtype the raw bits are viewed as (None: they already are it). Looked up only for
    the dtype at hand: torch < 2.1 has no float8 types, and its other tensors still convert."""
    names = {DType.BFLOAT16: "bfloat16", DType.FLOAT8_E4M3: "float8_e4m3fn", DType.FLOAT8_E5M2: "float8_e5m2"}
    if dtype not in names:
        return None
    found = getattr(torch, names[dtype], None)
    if found is None:
        raise StepGraphError(f"torch(): torch {getattr(torch, '__version__', '?')} has no torch.{names[dtype]} "
                             f"for this {dtype.short_name} tensor (float8 types came with torch 2.1); use .numpy() "
                             f"for its raw bits, or a newer torch")
    return found


# --- wrapping other libraries' arrays ---------------------------------------------


def _is_torch(obj):
    return type(obj).__module__.split(".")[0] == "torch"


def describe_array(obj, device):
    """(dtype, shape, strides in elements or None, byte strides or None, pointer, stream to wait for
    or None, torch's is_contiguous or None) of an array to wrap on `device`; a clear error for what
    cannot be wrapped."""
    if _is_torch(obj):
        on_cuda = obj.device.type == "cuda"
        if on_cuda != (device == "cuda"):
            raise StepGraphError(f"cannot wrap a torch tensor on {obj.device} in a {device} context; "
                                 f"move it with .to('{'cuda' if device == 'cuda' else 'cpu'}') first")
        stream = None
        if on_cuda:
            import torch

            # torch's current stream (0 is the legacy default stream, which StepGraph's
            # non-blocking streams do not wait for): synchronized before the wrap.
            stream = torch.cuda.current_stream(obj.device).cuda_stream
        strides = tuple(obj.stride())
        return (as_dtype(obj.dtype, "array.dtype", "wrap"), tuple(obj.shape), strides,
                tuple(s * obj.element_size() for s in strides), obj.data_ptr(), stream, obj.is_contiguous())
    if device == "cuda":
        if not hasattr(obj, "__cuda_array_interface__"):
            raise TypeError(f"wrap: a cuda context wraps objects with __cuda_array_interface__ (torch, cupy); "
                            f"got {type(obj).__name__}")
        interface = obj.__cuda_array_interface__
    else:
        if not hasattr(obj, "__array_interface__"):
            raise TypeError(f"wrap: a host context wraps objects with __array_interface__ (numpy); "
                            f"got {type(obj).__name__}")
        interface = obj.__array_interface__
    if not isinstance(interface, dict) or not all(key in interface for key in ("data", "typestr", "shape")):
        raise TypeError(f"wrap: the {type(obj).__name__}'s array interface is not a dict with data, typestr and "
                        f"shape")
    if interface.get("mask") is not None:
        raise StepGraphError("wrap: cannot wrap a masked array interface; StepGraph reads every element")
    if not isinstance(interface["data"], tuple) or len(interface["data"]) != 2:
        raise StepGraphError("wrap: the array interface's data is not a (pointer, read_only) pair (an array "
                             "exporting a buffer instead); pass np.asarray(obj) or a copy")
    pointer, readonly = interface["data"]
    if readonly:
        raise StepGraphError("cannot wrap a read-only array: StepGraph may write the tensors it is given; "
                             "pass a writable copy")
    pointer = _checks.check_int("the array's address", pointer or 0, 0, 2**64 - 1, "wrap")
    dtype = from_typestr(interface["typestr"])
    shape = _checks.check_shape("shape", interface["shape"], "wrap")
    strides = interface.get("strides")
    byte_strides = None
    if strides is not None:
        byte_strides = tuple(_checks.check_int(f"strides[{i}]", s, *_checks.INT64, "wrap")
                             for i, s in enumerate(strides))
        if len(byte_strides) != len(shape):
            raise StepGraphError(f"wrap: the array interface has {len(byte_strides)} strides for shape {list(shape)}")
        if any(s % dtype.itemsize for s in byte_strides):
            raise StepGraphError(f"strides {byte_strides} (bytes) are not whole elements of {dtype.short_name}")
        strides = tuple(s // dtype.itemsize for s in byte_strides)
    stream = interface.get("stream") if device == "cuda" else None
    return dtype, shape, strides, byte_strides, pointer, stream, None
