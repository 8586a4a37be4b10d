"""Argument checks shared by every call site of the binding. Internal.

ctypes converts Python ints into C integers by wrapping them (2**64 + 32 becomes
32) and floats into c_float by rounding (0.99999999 becomes 1.0), and NumPy
casts arrays without a word (int64 labels over 2**31 wrap, floats truncate).
These helpers refuse such values before they reach ctypes, naming the argument,
the value and the allowed range:

    TypeError      the wrong kind of value (a float or a bool where an int is meant, a string
                   where a number is meant, an object of another class)
    ArgumentError  the right kind out of range (a StepGraphError and a ValueError)

Strings reach C as NUL-terminated bytes, so a name with a NUL in it would be cut short
silently: check_name refuses it. Choices among names ("layernorm", "bulk", ...) go through
check_choice, objects the binding hands to C through check_instance.
"""

import ctypes
import math
import operator

import numpy as np

from stepgraph._library import ArgumentError

# The ranges of the C types the C API takes.
INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
UINT32 = (0, 2**32 - 1)
# The same with the engine's rule: counts, indices and sizes.
NON_NEGATIVE_INT32 = (0, INT32[1])
NON_NEGATIVE_INT64 = (0, INT64[1])
POSITIVE_INT64 = (1, INT64[1])


def _where(owner, name):
    return f"{owner}: {name}" if owner else name


def check_int(name, value, lo, hi, owner=None):
    """`value` as a Python int in [lo, hi]: TypeError for bools, floats and non-integers,
    ArgumentError out of range. Accepts Python and NumPy integers (anything with __index__)."""
    where = _where(owner, name)
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{where} must be an integer in [{lo}, {hi}], got the bool {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{where} must be an integer in [{lo}, {hi}], got {type(value).__name__} {value!r}"
                        + (f" (use {int(value)})" if isinstance(value, float) and value.is_integer() else "")) from None
    if not lo <= number <= hi:
        raise ArgumentError(f"{where} must be in [{lo}, {hi}], got {number}")
    return number


def check_flag(name, value, owner=None):
    """A C int used as a bool: True/False (or 0/1) only, so "no" or 2 are not silently true."""
    if isinstance(value, (bool, np.bool_)):
        return int(value)
    return check_int(name, value, 0, 1, owner)


def check_float32(name, value, lo, hi, hi_open=False, owner=None):
    """`value` as a Python float, finite and in [lo, hi] (or [lo, hi) with hi_open) after rounding to
    float32, which is what the C API stores: 0.99999999 rounds to 1.0 and 1e39 to inf."""
    where = _where(owner, name)
    interval = f">= {lo}" if hi == math.inf else f"in [{lo}, {hi})" if hi_open else f"in [{lo}, {hi}]"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{where} must be a real number {interval}, got {type(value).__name__} {value!r}")
    def allowed(number):
        return math.isfinite(number) and lo <= number and (number < hi if hi_open else number <= hi)

    try:
        with np.errstate(over="ignore"):
            stored = float(np.float32(value))
    except OverflowError:  # an int beyond even a double's range
        stored = math.inf if value > 0 else -math.inf
    if not allowed(stored):
        try:
            exact_allowed = allowed(float(value))
        except OverflowError:
            exact_allowed = False
        rounded = f" (stored as float32: {stored!r})" if exact_allowed or math.isinf(stored) else ""
        raise ArgumentError(f"{where} must be finite and {interval}, got {value!r}{rounded}")
    return stored


def check_real(name, value, lo, hi, owner=None):
    """`value` as a Python float (a C double), finite and in [lo, hi]: TypeError for bools, strings and
    other non-numbers, ArgumentError for NaN, infinities and values outside."""
    where = _where(owner, name)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{where} must be a real number in [{lo}, {hi}], got {type(value).__name__} {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond a double's range
        number = math.inf
    if not (math.isfinite(number) and lo <= number <= hi):
        raise ArgumentError(f"{where} must be finite and in [{lo}, {hi}], got {value!r}")
    return number


def check_shape(name, shape, owner=None):
    """A shape as a tuple of ints, each dimension in [0, 2**63 - 1] (int64_t, >= 0)."""
    where = _where(owner, name)
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise TypeError(f"{where} must be a sequence of dimensions such as (4, 8), got {type(shape).__name__} "
                        f"{shape!r}")
    return tuple(check_int(f"{name}[{i}]", d, *NON_NEGATIVE_INT64, owner) for i, d in enumerate(shape))


def check_array_shape(name, array, shape, storage, owner=None):
    """`array` (anything np.asarray takes) as a NumPy array of exactly `shape`: the same element
    count in another shape (a transposed batch) would scramble rows. `storage` names the dtype
    the tensor holds, for the message."""
    array = np.asarray(array)
    shape = tuple(shape)
    if array.shape != shape:
        raise ArgumentError(f"{_where(owner, name)} must have shape {list(shape)} ({storage}), got an array of shape "
                            f"{list(array.shape)} {array.dtype}; reshape or transpose it yourself, the binding "
                            f"does not guess")
    return array


def _outside(values, lo, hi):
    """A bool mask of the integer array's values outside [lo, hi], exact for int64 and uint64."""
    lo, hi = max(lo, INT64[0]), min(hi, INT64[1])
    if values.dtype.kind == "u":
        below = np.zeros(values.shape, bool) if lo <= 0 else values < np.uint64(lo)
        return below | (values > np.uint64(hi)) if hi >= 0 else np.ones(values.shape, bool)
    values = values.astype(np.int64, copy=False)
    return (values < np.int64(lo)) | (values > np.int64(hi))


def check_values(name, array, lo, hi, allowed=(), note="", owner=None):
    """Every value of the integer array `array` in [lo, hi] or in `allowed`; the error names the
    first value outside and its index, and ends with `note`."""
    values = np.asarray(array)
    if values.size == 0:
        return
    outside = _outside(values, lo, hi)
    for extra in allowed:
        outside &= _outside(values, extra, extra)
    if outside.any():
        index = tuple(int(i) for i in np.argwhere(outside)[0])
        extra = "".join(f" or {a}" for a in allowed)
        raise ArgumentError(f"{_where(owner, name)} must hold values in [{lo}, {hi}]{extra}, got {values[index]} at "
                            f"index {index[0] if len(index) == 1 else index} ({int(outside.sum())} value(s) outside)"
                            f"{note}")


def _describe(value):
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def check_instance(name, value, kinds, what, owner=None):
    """`value` if it is an instance of `kinds` (a class or a tuple of classes); TypeError naming the
    argument and `what` it must be ("a stepgraph Tensor (ctx.wrap or ctx.from_numpy)") otherwise."""
    if not isinstance(value, kinds):
        raise TypeError(f"{_where(owner, name)} must be {what}, got {_describe(value)}")
    return value


def check_choice(name, value, choices, owner=None):
    """`value`, a str among `choices` (a dict or another collection of strs): TypeError for another
    kind of value (a number, None, a list), ArgumentError for a str not among them."""
    allowed = ", ".join(repr(c) for c in choices)
    if not isinstance(value, str):
        raise TypeError(f"{_where(owner, name)} must be one of {allowed} (a str), got {_describe(value)}")
    if value not in choices:
        raise ArgumentError(f"{_where(owner, name)} must be one of {allowed}, got {value!r}")
    return value


def check_name(name, value, owner=None):
    """A name for C (a tensor's, a layer's, a cache key): a non-empty str without NUL characters, as
    UTF-8 bytes. A NUL would end the C string early, so "a\\0b" would silently become "a"."""
    where = _where(owner, name)
    if not isinstance(value, str):
        raise TypeError(f"{where} must be a str, got {_describe(value)}")
    if not value:
        raise ArgumentError(f"{where} must not be empty")
    if "\0" in value:
        raise ArgumentError(f"{where} must not contain a NUL character (C strings end there), got {value!r}")
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as error:  # a lone surrogate
        raise ArgumentError(f"{where} is not valid Unicode text ({error.reason}), got {value!r}") from None


def check_handle(value, made_by):
    """A handle from the C API (ctypes.c_void_p): the classes that wrap one (Tensor, CapturedStep,
    Saved, GraphedLayers) are made by the library, never from another value."""
    if not isinstance(value, ctypes.c_void_p):
        raise TypeError(f"{made_by}; it is not made from a {type(value).__name__}")
    return value


def check_callable(name, value, owner=None):
    if not callable(value):
        raise TypeError(f"{_where(owner, name)} must be callable (a function of no arguments returning the step's "
                        f"outputs), got {_describe(value)}")
    return value


def check_sequence(name, value, owner=None, length=None):
    """`value` (a list, tuple or other iterable, not a str, bytes or dict) as a list; with `length`,
    exactly that many items."""
    where = _where(owner, name)
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{where} must be a sequence{f' of {length}' if length is not None else ''}, got "
                        f"{_describe(value)}")
    items = list(value)
    if length is not None and len(items) != length:
        raise TypeError(f"{where} must hold exactly {length} items, got {len(items)}: {value!r}")
    return items
