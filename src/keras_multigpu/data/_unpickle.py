"""The restricted unpickler CIFAR-10's batch files are read with: it only rebuilds NumPy
arrays from bytes the file holds (no other global, no code), after a scan of the opcodes
that refuses a lying header before anything is allocated."""

import math
import pickle
import pickletools

import numpy as np

IMAGE_BYTES = 32 * 32 * 3  # one image: 1,024 red, 1,024 green, 1,024 blue values
# Pickle opcodes allowed per image the file could hold (a real batch uses about 2).
_OPS_PER_IMAGE = 64

# Element types an array in a batch file may have (names as NumPy pickles them).
_DTYPE_NAMES = frozenset(["b1", "u1", "i1", "u2", "i2", "u4", "i4", "u8", "i8", "f2", "f4", "f8"])


class _RefusedError(pickle.UnpicklingError):
    """A pickle asked for something a CIFAR-10 batch never needs."""


class _ForbiddenGlobalError(_RefusedError):
    """A pickle referenced a global outside the allow-list."""


def _shape_of(shape):
    """Returns ``shape`` as a tuple of sizes, or raises `_RefusedError`."""
    if (
        not isinstance(shape, tuple)
        or len(shape) > 32
        or not all(type(d) is int and 0 <= d < 2**63 for d in shape)
    ):
        raise _RefusedError(f"array shape must be a tuple of sizes, got {type(shape).__name__}")
    return shape


class _PickledDType:
    """What ``numpy.dtype(name, align, copy)`` gives while unpickling: a checked name.

    Only plain numeric element types are allowed; no object, structured or
    sub-array types, whose items could be references or arbitrarily large.
    """

    __slots__ = ("dtype",)

    def __init__(self, name):
        if isinstance(name, bytes):
            name = name.decode("latin1")
        if not isinstance(name, str) or name not in _DTYPE_NAMES:
            shown = name if isinstance(name, str) and len(name) < 20 else type(name).__name__
            raise _RefusedError(f"disallowed array element type {shown!r}")
        self.dtype = np.dtype(name)

    def __setstate__(self, state):
        if not isinstance(state, tuple) or len(state) < 2:
            raise _RefusedError("malformed dtype state")
        endian = state[1]
        if isinstance(endian, bytes):
            endian = endian.decode("latin1")
        if endian not in ("<", ">", "|", "="):
            raise _RefusedError("malformed dtype byte order")
        if any(part is not None for part in state[2:5]):  # sub-array, names, fields
            raise _RefusedError("disallowed structured or sub-array dtype")
        if endian in ("<", ">"):
            self.dtype = self.dtype.newbyteorder(endian)


def _array_from_bytes(buffer, dtype, shape, order):
    """Views ``buffer`` as an array, after checking that it holds exactly ``shape``.

    Nothing is allocated: the array shares the bytes that were read from the file.
    """
    shape = _shape_of(shape)
    if not isinstance(dtype, _PickledDType):
        raise _RefusedError(f"array element type must be a numpy.dtype, got {type(dtype).__name__}")
    if not isinstance(buffer, (bytes, bytearray)):
        raise _RefusedError(f"array data must be bytes, got {type(buffer).__name__}")
    dtype = dtype.dtype
    declared = math.prod(shape) * dtype.itemsize
    if declared != len(buffer):
        raise _RefusedError(
            f"an array declares shape {shape} of {dtype} ({declared:,} bytes) "
            f"but holds {len(buffer):,} bytes"
        )
    array = np.frombuffer(buffer, dtype=dtype)
    return array.reshape(shape, order="F" if order in ("F", b"F") else "C")


class _PickledArray:
    """What ``_reconstruct`` gives while unpickling: a placeholder for an array.

    NumPy pickles an array as an empty placeholder plus a state of (shape, dtype,
    is_fortran, bytes); `__setstate__` checks that state and views its bytes.
    """

    __slots__ = ("array",)

    def __init__(self):
        self.array = None

    def __setstate__(self, state):
        if not isinstance(state, tuple) or len(state) not in (4, 5):
            raise _RefusedError("malformed array state")
        shape, dtype, is_fortran, raw = state[-4:]
        self.array = _array_from_bytes(raw, dtype, shape, "F" if is_fortran else "C")


class _Global:
    """A global an allowed pickle may name: a stateless, callable singleton.

    No ``__dict__`` and a refusing ``__setstate__``, so a pickle's BUILD cannot
    change how it (or the next file read) behaves.
    """

    __slots__ = ()

    def __setstate__(self, state):
        raise _RefusedError(f"the file tries to modify {self}")

    def __repr__(self):
        return type(self).__doc__.split(":")[0]


class _NDArrayName(_Global):
    """numpy.ndarray: only a name to pass to _reconstruct.

    Calling it would allocate an array of any declared shape from no data.
    """

    __slots__ = ()

    def __call__(self, *args, **kwargs):
        shape = args[0] if args else kwargs.get("shape")
        try:
            size = f"shape {_shape_of(shape if isinstance(shape, tuple) else (shape,))}"
        except _RefusedError:
            size = "an unknown shape"
        raise _RefusedError(
            f"the file calls numpy.ndarray with {size}, which conjures an array "
            "without reading its bytes"
        )


class _Reconstruct(_Global):
    """numpy.core.multiarray._reconstruct: gives an empty placeholder for BUILD to fill."""

    __slots__ = ()

    def __call__(self, subtype, shape, dtype):
        if subtype is not _NDARRAY:
            raise _RefusedError("_reconstruct may only rebuild numpy.ndarray")
        return _PickledArray()


class _FromBuffer(_Global):
    """numpy.core.numeric._frombuffer: views checked bytes (protocol 5 pickles)."""

    __slots__ = ()

    def __call__(self, buffer, dtype, shape, order):
        return _array_from_bytes(buffer, dtype, shape, order)


class _DType(_Global):
    """numpy.dtype: gives a checked element type."""

    __slots__ = ()

    def __call__(self, name, align=False, copy=False):
        return _PickledDType(name)


class _Latin1Encode(_Global):
    """_codecs.encode: latin1 only, as protocol 2 stores bytes; other codecs refused."""

    __slots__ = ()

    def __call__(self, text, encoding="latin1", errors="strict"):
        if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
            shown = repr(encoding) if isinstance(encoding, str) and len(encoding) < 40 else "..."
            raise _RefusedError(f"disallowed codec call _codecs.encode(..., {shown})")
        return text.encode("latin1")


class _EmptyBytes(_Global):
    """bytes: only bytes(), as protocol 2 stores b''; bytes(n) is refused."""

    __slots__ = ()

    def __call__(self, *args):
        if args:
            raise _RefusedError("disallowed call bytes(...) with arguments")
        return b""


_NDARRAY = _NDArrayName()
_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"): _Reconstruct(),
    ("numpy._core.multiarray", "_reconstruct"): _Reconstruct(),
    ("numpy.core.numeric", "_frombuffer"): _FromBuffer(),
    ("numpy._core.numeric", "_frombuffer"): _FromBuffer(),
    ("numpy", "ndarray"): _NDARRAY,
    ("numpy", "dtype"): _DType(),
    ("_codecs", "encode"): _Latin1Encode(),
    ("__builtin__", "bytes"): _EmptyBytes(),
    ("builtins", "bytes"): _EmptyBytes(),
}


class _SafeUnpickler(pickle.Unpickler):
    """Unpickler that rebuilds only NumPy arrays, and only from bytes in the file.

    Every global resolves to a checked stand-in, so the pickle can neither run
    code nor allocate an array larger than the data it carries.
    """

    def find_class(self, module, name):
        try:
            return _ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            shown = f"{module}.{name}"
            shown = shown if len(shown) <= 100 else shown[:100] + "..."
            raise _ForbiddenGlobalError(f"disallowed global {shown}") from None


def _scan(raw):
    """Walks the pickle's opcodes without running them, before anything is built.

    Refuses declared lengths beyond the end of the file, memo indexes that would
    make the unpickler allocate a huge table, and far more opcodes than a batch
    of this size has, so a lying header fails here, fast and without allocating.
    """
    max_ops = 1024 + _OPS_PER_IMAGE * (len(raw) // IMAGE_BYTES)
    count = 0
    for count, (op, arg, pos) in enumerate(pickletools.genops(raw), 1):
        if op.name in ("PUT", "BINPUT", "LONG_BINPUT") and arg > count:
            raise _RefusedError(f"memo index {arg:,} at byte {pos:,} is out of range")
        if op.name == "FRAME" and arg > len(raw) - pos:
            raise _RefusedError(
                f"frame of {arg:,} bytes at byte {pos:,} runs past the end of the file"
            )
        if count > max_ops:
            raise _RefusedError(f"more than {max_ops:,} pickle opcodes")
