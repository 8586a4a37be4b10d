"""Does an array's view fit inside the memory that backs it? Internal; Context.wrap asks.

An array interface is a promise (address, shape, strides) that nothing checks: numpy's
as_strided, or a hand-made __array_interface__, can describe more bytes than the buffer holds,
and StepGraph would then read and write past it. Where the object can tell us the extent of
its buffer, the view must lie inside it:

    numpy arrays   the base buffer at the end of the .base chain: an array that owns its data,
                   or an object with the buffer protocol (bytes, bytearray, mmap, ctypes arrays)
    torch tensors  untyped_storage(): data_ptr() and nbytes()
    cupy arrays    data.mem: ptr and size (the allocation)

Elsewhere (a base object that only has an array interface, other CUDA libraries) the caller is
trusted, as Context.wrap's docstring says. buffer_extent returns None there.
"""

import numpy as np

from stepgraph._library import ArgumentError


def view_bounds(pointer, shape, byte_strides, itemsize):
    """[low, high) of the bytes a view touches; None for a view of no elements."""
    if any(d == 0 for d in shape):
        return None
    if byte_strides is None:  # row-major
        count = 1
        for d in shape:
            count *= d
        return pointer, pointer + count * itemsize
    low = high = pointer
    for d, s in zip(shape, byte_strides):
        reach = (d - 1) * s
        if reach < 0:
            low += reach
        else:
            high += reach
    return low, high + itemsize


def _numpy_extent(obj):
    """(start, nbytes) of the buffer at the root of a numpy array's base chain, or None."""
    try:
        array = np.asarray(obj)  # no copy for an array or an array-interface object
    except Exception:  # noqa: BLE001 - an interface numpy cannot read: nothing to tell
        return None
    root = array
    while getattr(root, "base", None) is not None:
        root = root.base
    if isinstance(root, np.ndarray):
        if not root.flags.owndata:
            return None
        bounds = view_bounds(root.__array_interface__["data"][0], root.shape,
                             root.__array_interface__["strides"], root.itemsize)
        return (bounds[0], bounds[1] - bounds[0]) if bounds else (root.__array_interface__["data"][0], 0)
    try:
        memory = memoryview(root)
    except TypeError:  # not a buffer (an object with only an array interface): trusted
        return None
    with memory:
        if not memory.contiguous or memory.nbytes == 0:
            return None
        start = np.frombuffer(memory.cast("B"), np.uint8).__array_interface__["data"][0]
        return start, memory.nbytes


def _torch_extent(tensor):
    storage_of = getattr(tensor, "untyped_storage", None)
    if storage_of is not None:
        storage = storage_of()
        return storage.data_ptr(), storage.nbytes()
    storage = tensor.storage()  # torch < 2.0: a typed storage
    return storage.data_ptr(), storage.size() * tensor.element_size()


def _cupy_extent(obj):
    memory = getattr(getattr(obj, "data", None), "mem", None)
    if memory is None or not hasattr(memory, "ptr") or not hasattr(memory, "size"):
        return None
    return int(memory.ptr), int(memory.size)


def buffer_extent(obj, is_torch):
    """(start address, bytes) of the buffer behind `obj`, or None where the object cannot tell."""
    if is_torch:
        return _torch_extent(obj)
    if type(obj).__module__.split(".")[0] == "cupy":
        return _cupy_extent(obj)
    if hasattr(obj, "__array_interface__"):
        return _numpy_extent(obj)
    return None


def check_fits(obj, is_torch, pointer, shape, byte_strides, itemsize, owner="wrap"):
    """ArgumentError when the view (pointer, shape, byte strides) reaches outside the buffer
    behind `obj`; nothing where the buffer's extent is unknown (see the module docstring)."""
    bounds = view_bounds(pointer, shape, byte_strides, itemsize)
    if bounds is None:
        return
    extent = buffer_extent(obj, is_torch)
    if extent is None:
        return
    start, size = extent
    low, high = bounds
    if low < start or high > start + size:
        layout = f"strides {list(byte_strides)} (bytes)" if byte_strides is not None else "row-major layout"
        raise ArgumentError(
            f"{owner}: the array's shape {list(shape)} and {layout} reach bytes [{low - start}, {high - start}) of "
            f"its buffer, which holds {size} bytes; "
            f"StepGraph would read and write outside it. Wrap a view that fits (not an as_strided view "
            f"larger than its buffer), or pass a copy")
