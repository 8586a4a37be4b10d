"""Element types, and bf16 <-> float32 conversions in NumPy (numpy has no bf16)."""

import enum

import numpy as np

from stepgraph import _checks


class DType(enum.IntEnum):
    """The engine's element types (sg_dtype)."""

    FLOAT32 = 0
    BFLOAT16 = 1
    FLOAT16 = 2
    FLOAT8_E4M3 = 3
    FLOAT8_E5M2 = 4
    INT32 = 5
    INT64 = 6

    @property
    def itemsize(self):
        return _ITEMSIZE[self]

    @property
    def short_name(self):
        return _SHORT[self]


_ITEMSIZE = {DType.FLOAT32: 4, DType.BFLOAT16: 2, DType.FLOAT16: 2, DType.FLOAT8_E4M3: 1, DType.FLOAT8_E5M2: 1,
             DType.INT32: 4, DType.INT64: 8}
_SHORT = {DType.FLOAT32: "fp32", DType.BFLOAT16: "bf16", DType.FLOAT16: "fp16", DType.FLOAT8_E4M3: "fp8_e4m3",
          DType.FLOAT8_E5M2: "fp8_e5m2", DType.INT32: "int32", DType.INT64: "int64"}
_BY_NAME = {}
for _dtype in DType:
    _BY_NAME[_dtype.name.lower()] = _dtype
    _BY_NAME[_SHORT[_dtype]] = _dtype
_BY_NAME.update({"float8_e4m3fn": DType.FLOAT8_E4M3, "half": DType.FLOAT16, "float": DType.FLOAT32})

# NumPy dtypes that hold each element type: the type itself, or raw bits of
# the same size where NumPy has none (bf16 as uint16, fp8 as uint8).
_NUMPY_STORAGE = {DType.FLOAT32: np.float32, DType.BFLOAT16: np.uint16, DType.FLOAT16: np.float16,
                  DType.FLOAT8_E4M3: np.uint8, DType.FLOAT8_E5M2: np.uint8, DType.INT32: np.int32,
                  DType.INT64: np.int64}
# Array-interface type strings (bf16 and fp8 are opaque: '<V2', '|V1').
_TYPESTR = {DType.FLOAT32: "<f4", DType.BFLOAT16: "<V2", DType.FLOAT16: "<f2", DType.FLOAT8_E4M3: "|V1",
            DType.FLOAT8_E5M2: "|V1", DType.INT32: "<i4", DType.INT64: "<i8"}
_FROM_TYPESTR = {"f4": DType.FLOAT32, "f2": DType.FLOAT16, "i4": DType.INT32, "i8": DType.INT64}


def as_dtype(value, name="dtype", owner=None):
    """A DType from a DType, a name ("bf16", "bfloat16", "float32"...), a torch dtype or a numpy dtype.
    ArgumentError (a ValueError) for an unknown name, TypeError for other kinds of values (an int,
    None, a bool), naming the argument `name`."""
    where = f"{owner}: {name}" if owner else name
    if isinstance(value, DType):
        return value
    if isinstance(value, str):
        key = value.lower()
    elif type(value).__module__.split(".")[0] == "torch" and str(value).startswith("torch."):
        key = str(value)[len("torch."):]  # torch.bfloat16 -> "bfloat16"
    elif isinstance(value, np.dtype) or (isinstance(value, type) and issubclass(value, np.generic)):
        key = str(np.dtype(value))
    else:
        raise TypeError(f"{where} must be a dtype name such as 'bf16' or 'float32', a stepgraph DType, a torch "
                        f"dtype or a numpy dtype, got {type(value).__name__} {value!r}")
    if key not in _BY_NAME:
        raise _checks.ArgumentError(f"{where}: unknown dtype {value!r}; use one of {sorted(set(_BY_NAME))}")
    return _BY_NAME[key]


def numpy_storage(dtype):
    """The NumPy dtype holding `dtype`'s elements (raw bits for bf16 and fp8)."""
    return np.dtype(_NUMPY_STORAGE[as_dtype(dtype)])


def typestr(dtype):
    return _TYPESTR[as_dtype(dtype)]


def from_typestr(text):
    """DType of an array-interface type string ('<f4', '|i4', ...), little-endian only."""
    byteorder, code = text[0], text[1:]
    if byteorder == ">" or code not in _FROM_TYPESTR:
        raise TypeError(f"array type {text!r} has no StepGraph dtype; StepGraph takes little-endian float32, "
                        f"float16, int32 and int64 arrays (and torch bfloat16 tensors)")
    return _FROM_TYPESTR[code]


def _real_array(name, values):
    array = np.asarray(values)
    if array.dtype.kind not in "iuf":
        raise TypeError(f"{name} must be a real (integer or float) array, got {array.dtype}")
    return array


def _check_fits_float32(name, array):
    """ArgumentError for finite values that float32 cannot hold (they would become infinities)."""
    if array.dtype.kind == "f" and array.dtype.itemsize > 4 and array.size:
        with np.errstate(over="ignore"):
            overflow = np.isfinite(array) & ~np.isfinite(array.astype(np.float32))
        if overflow.any():
            index = tuple(int(i) for i in np.argwhere(overflow)[0])
            raise _checks.ArgumentError(
                f"{name}: {array[index]!r} at index {index[0] if len(index) == 1 else index} overflows float32 "
                f"(largest finite 3.4028235e+38; {int(overflow.sum())} value(s)); scale it, or clip it yourself")


def float32_to_bf16_bits(values):
    """bf16 bit patterns (uint16) of float32 values, rounding to nearest even like the device.
    Integer and float arrays; finite values beyond float32's range are refused."""
    values = _real_array("float32_to_bf16_bits: values", values)
    _check_fits_float32("float32_to_bf16_bits: values", values)
    shape = values.shape
    values = np.ascontiguousarray(values, dtype=np.float32)
    bits = values.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(0x7FC0), rounded).reshape(shape)


def bf16_bits_to_float32(bits):
    """float32 values of bf16 bit patterns (exact): an integer array of values in [0, 65535]."""
    bits = np.asarray(bits)
    if bits.dtype.kind not in "iu":
        raise TypeError(f"bf16_bits_to_float32: bits must be an integer array of bf16 bit patterns (uint16), got "
                        f"{bits.dtype}")
    _checks.check_values("bits", bits, 0, 2**16 - 1, owner="bf16_bits_to_float32")
    bits = np.ascontiguousarray(bits, dtype=np.uint16)
    return (bits.astype(np.uint32) << 16).view(np.float32)


def to_storage(array, dtype, name="array"):
    """`array` converted to the NumPy storage of `dtype`, refusing what would change values silently:
    float tensors (fp32, fp16) take integer and float arrays (rounded to the tensor's precision);
    bf16 takes uint16 arrays as raw bits, integer and float arrays rounded to bf16 bits; fp8 takes
    uint8 raw bits only; int32 and int64 tensors take integer arrays whose values fit (floats
    would truncate, larger integers wrap). Bool, complex and other arrays are refused (TypeError)."""
    dtype = as_dtype(dtype)
    array = np.asarray(array)
    # np.ascontiguousarray makes a 0-d array 1-d: the result keeps the array's own shape.
    return _convert(array, dtype, name).reshape(array.shape)


def _convert(array, dtype, name):
    storage = numpy_storage(dtype)
    kind = array.dtype.kind
    if dtype in (DType.FLOAT8_E4M3, DType.FLOAT8_E5M2):
        if array.dtype != np.uint8:
            raise TypeError(f"{name}: fp8 tensors take their raw bits (uint8 arrays), got {array.dtype}; "
                            f"NumPy has no fp8 type")
        return np.ascontiguousarray(array)
    if dtype in (DType.INT32, DType.INT64):
        if kind not in "iu":
            raise TypeError(f"{name} must be an integer array for a {dtype.short_name} tensor, got {array.dtype} "
                            f"(floats would be truncated, bools are not integers); convert it with "
                            f".astype(np.{storage.name}) if you mean that")
        info = np.iinfo(storage)
        _checks.check_values(name, array, int(info.min), int(info.max))
        return np.ascontiguousarray(array, dtype=storage)
    if kind not in "iuf":
        raise TypeError(f"{name} must be a real (integer or float) array for a {dtype.short_name} tensor, got "
                        f"{array.dtype}")
    if dtype == DType.BFLOAT16 and array.dtype == np.uint16:
        return np.ascontiguousarray(array)  # raw bits
    with np.errstate(over="ignore"):
        if dtype == DType.BFLOAT16:
            converted = float32_to_bf16_bits(array.astype(np.float32))
            finite = (converted & np.uint16(0x7F80)) != np.uint16(0x7F80)
        else:
            converted = np.ascontiguousarray(array, dtype=storage)
            finite = np.isfinite(converted)
    _check_stays_finite(name, array, finite, dtype)
    return converted


def _check_stays_finite(name, array, finite, dtype):
    """ArgumentError for finite values that `dtype` cannot hold: they would become infinities."""
    if not array.size:
        return
    overflow = (np.isfinite(array) if array.dtype.kind == "f" else True) & ~finite
    if overflow.any():
        index = tuple(int(i) for i in np.argwhere(overflow)[0])
        largest = {DType.FLOAT32: "3.4028235e+38", DType.BFLOAT16: "3.3895314e+38", DType.FLOAT16: "65504"}[dtype]
        raise _checks.ArgumentError(
            f"{name}: {array[index]!r} at index {index[0] if len(index) == 1 else index} overflows "
            f"{dtype.short_name} (largest finite {largest}; {int(overflow.sum())} value(s)); scale it, or clip it "
            f"yourself")
