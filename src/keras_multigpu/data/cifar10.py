"""Locate and read CIFAR-10 in its python format (``cifar-10-batches-py/``).

Batch files are read with a restricted unpickler that only rebuilds NumPy arrays
from bytes the file holds, so a tampered or damaged file can neither run code nor
make the loader allocate more than the file's size; every file is validated (n >= 1
images of 3,072 uint8 values, n labels in 0..9) and every error names the file.
"""

import io
import logging
import math
import numbers
import os
import pickle
import pickletools
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_SHA256 = "6d958be074577803d12ecdefd02955f39262c83c16fe9348329d7fe0b5c001ce"
FOLDER = "cifar-10-batches-py"
ENV_VAR = "KERAS_MULTIGPU_DATA"
TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILE = "test_batch"
_HINT = (
    f"Delete the {FOLDER} folder and download it again from {CIFAR10_URL}, "
    f"or point --data-dir PATH or {ENV_VAR}=PATH at a good copy."
)

IMAGE_BYTES = 32 * 32 * 3  # one image: 1,024 red, 1,024 green, 1,024 blue values
NUM_CLASSES = 10
# A real batch of 10,000 images is about 31 MB; far larger files are refused unread.
_MAX_FILE_BYTES = 1 << 30
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


def _check(folder, looked):
    """Returns ``folder`` if it holds every batch file, else notes why not."""
    missing = [n for n in (*TRAIN_FILES, TEST_FILE) if not (folder / n).is_file()]
    if not missing:
        return folder
    if not folder.is_dir():
        looked.append(f"{folder} (does not exist)")
    elif len(missing) == len(TRAIN_FILES) + 1:
        looked.append(f"{folder} (no CIFAR-10 batch files)")
    else:
        looked.append(f"{folder} (incomplete: missing {', '.join(missing)})")
    return None


def _resolve(path, looked):
    """Returns the dataset folder at ``path`` or ``path/cifar-10-batches-py``."""
    path = Path(path).expanduser()
    return _check(path, looked) or _check(path / FOLDER, looked)


def _keras_home():
    return Path(os.environ.get("KERAS_HOME") or Path("~/.keras").expanduser())


def _not_found(looked):
    places = "\n".join(f"  - {p}" for p in looked)
    return FileNotFoundError(
        f"CIFAR-10 ({FOLDER}/ with {', '.join(TRAIN_FILES)}, {TEST_FILE}) not found. "
        f"Looked in:\n{places}\nPoint at a copy with --data-dir PATH or {ENV_VAR}=PATH "
        f"(PATH may be the {FOLDER} folder or its parent), or download {CIFAR10_URL}."
    )


def find_cifar10(data_dir=None, download=True):
    """Finds the ``cifar-10-batches-py`` folder, downloading it as a last resort.

    Search order: ``data_dir``, ``$KERAS_MULTIGPU_DATA``, the Keras cache
    (``$KERAS_HOME`` or ``~/.keras``, under ``datasets/``), then a download with
    ``keras.utils.get_file``. Each given path may be the folder or its parent. A
    ``data_dir`` or environment variable that is set but holds no complete copy is
    an error; nothing later is tried, so a typo never triggers a download.

    Args:
        data_dir: Optional path to the dataset folder or its parent.
        download: Whether to try downloading when no local copy is found.

    Returns:
        The ``pathlib.Path`` of the folder holding the batch files.

    Raises:
        FileNotFoundError: No complete copy was found (and the download was
            disabled or failed); the message lists every place looked in.
    """
    looked = []
    for given, label in ((data_dir, "data_dir"), (os.environ.get(ENV_VAR), ENV_VAR)):
        if given is None or given == "":
            continue
        found = _resolve(given, looked)
        if found is None:
            raise _not_found([f"{label}={given}:", *looked])
        return found
    datasets = _keras_home() / "datasets"
    for folder in (datasets / FOLDER, datasets / f"{FOLDER}-target" / FOLDER):
        found = _check(folder, looked)
        if found is not None:
            return found
    if not download:
        looked.append("download skipped (download=False)")
        raise _not_found(looked)
    try:
        import keras

        path = keras.utils.get_file(
            fname=f"{FOLDER}-target",
            origin=CIFAR10_URL,
            extract=True,
            file_hash=CIFAR10_SHA256,
            cache_dir=str(_keras_home()),
        )
    except Exception as exc:  # network errors surface as plain Exception
        logger.warning("Downloading CIFAR-10 from %s failed: %s", CIFAR10_URL, exc)
        looked.append(f"download from {CIFAR10_URL} failed: {exc}")
        raise _not_found(looked) from exc
    found = _resolve(path, looked)
    if found is None:
        raise _not_found(looked)
    return found


def _bad(path, problem):
    return ValueError(f"{path}: {problem}. {_HINT}")


def _num(value):
    """Formats an int for a message; a huge one from a damaged file stays short."""
    if abs(value) >= 10**15:
        return "-huge" if value < 0 else "huge"
    return f"{value:,}"


def _get(batch, key, path):
    for k in (key, key.encode()):
        if k in batch:
            return batch[k]
    named = [k for k in batch if isinstance(k, (str, bytes)) and len(k) <= 40]
    keys = sorted(str(k) for k in named[:20])
    if len(batch) > len(keys):
        keys.append(f"... {len(batch) - len(keys)} more")
    raise _bad(path, f"no {key!r} entry (keys: {keys}), so it is not a CIFAR-10 batch")


def _images(data, path, file_size):
    """Checks ``data`` and returns it as an ``(n, 3072)`` integer array, n >= 1."""
    if isinstance(data, _PickledArray):
        if data.array is None:
            raise _bad(path, "'data' is an array without contents; the file is damaged")
        data = data.array
    if isinstance(data, (bytes, bytearray)):
        if len(data) % IMAGE_BYTES:
            raise _bad(
                path,
                f"'data' holds {len(data):,} bytes, which is not a whole number "
                f"of {IMAGE_BYTES:,}-byte images",
            )
        data = np.frombuffer(data, np.uint8).reshape(-1, IMAGE_BYTES)
    if not isinstance(data, np.ndarray) or data.ndim != 2 or data.shape[1] != IMAGE_BYTES:
        got = f"shape {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise _bad(
            path,
            f"'data' must be an (n, {IMAGE_BYTES}) uint8 array (n images of 32x32x3), got {got}",
        )
    n = len(data)
    if n == 0:
        raise _bad(
            path,
            f"holds 0 images ('data' has shape {data.shape}); a CIFAR-10 batch holds at least one",
        )
    if n * IMAGE_BYTES > file_size:  # arrays are built from the file's bytes, so never true
        raise _bad(
            path,
            f"declares {n:,} images ({n * IMAGE_BYTES:,} bytes) but the file "
            f"has only {file_size:,} bytes",
        )
    if data.dtype != np.uint8 and not (
        np.issubdtype(data.dtype, np.integer) and data.min() >= 0 and data.max() <= 255
    ):
        raise _bad(path, f"'data' must hold uint8 pixel values, got dtype {data.dtype}")
    return data


def _labels(labels, n, path):
    """Checks ``labels`` (n ints in 0..9) and returns them as an int32 array."""
    if isinstance(labels, _PickledArray):
        labels = labels.array
    if isinstance(labels, np.ndarray):
        if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
            raise _bad(
                path,
                f"'labels' must be a flat list of ints, got an array of "
                f"{labels.dtype} with shape {labels.shape}",
            )
    elif not isinstance(labels, (list, tuple)):
        raise _bad(path, f"'labels' must be a list of ints, got {type(labels).__name__}")
    if len(labels) != n:  # before any conversion: nested lists could expand enormously
        raise _bad(path, f"{len(labels):,} labels for {n:,} images; the counts must match")
    if isinstance(labels, np.ndarray):
        low, high = int(labels.min()), int(labels.max())
    else:
        for i, label in enumerate(labels):
            if type(label) is not int:  # no bool, float, nested list or array
                raise _bad(
                    path,
                    f"'labels' must be a flat list of ints, found "
                    f"{type(label).__name__} at index {i}",
                )
        low, high = min(labels), max(labels)
    if low < 0 or high >= NUM_CLASSES:
        raise _bad(path, f"labels must be in 0..{NUM_CLASSES - 1}, found {_num(low)}..{_num(high)}")
    return np.asarray(labels, dtype=np.int32)


def read_batch(path):
    """Reads one CIFAR-10 batch file safely.

    The file is checked before anything large is built: the pickle's opcodes are
    scanned without running them, every array must carry exactly the bytes its
    shape declares (arrays are views of those bytes, never allocated from a
    declared size), and the batch must hold n >= 1 images of 3,072 uint8 values
    with n labels in 0..9.

    Args:
        path: Path of a batch file such as ``data_batch_1``.

    Returns:
        ``(x, y)``: uint8 images of shape ``(n, 32, 32, 3)`` and int32 labels ``(n,)``.

    Raises:
        FileNotFoundError: The file does not exist.
        ValueError: The file cannot be read, is truncated or corrupted, is not a
            CIFAR-10 batch, holds no images, or refers to objects other than NumPy
            arrays. The message names the file and says what to do.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: CIFAR-10 batch file is missing. {_HINT}")
    try:
        size = path.stat().st_size
        if size > _MAX_FILE_BYTES:
            raise _bad(
                path,
                f"is {size:,} bytes, far larger than a CIFAR-10 batch (a full "
                "one of 10,000 images is about 31 MB)",
            )
        raw = path.read_bytes()
    except OSError as exc:
        raise _bad(path, f"cannot be read ({exc})") from exc
    try:
        _scan(raw)
        batch = _SafeUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except _ForbiddenGlobalError as exc:
        raise _bad(path, f"refused to unpickle it ({exc}); it is no CIFAR-10 batch") from exc
    except _RefusedError as exc:
        raise _bad(
            path, f"refused to unpickle it: {exc}; it is damaged or no CIFAR-10 batch"
        ) from exc
    except Exception as exc:  # truncated, corrupted, or not a pickle at all
        raise _bad(path, f"truncated or corrupted ({type(exc).__name__}: {exc})") from exc
    if not isinstance(batch, dict):
        raise _bad(path, f"holds a {type(batch).__name__} instead of a dict")
    data = _images(_get(batch, "data", path), path, len(raw))
    labels = _labels(_get(batch, "labels", path), len(data), path)
    x = data.astype(np.uint8, copy=False).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return np.ascontiguousarray(x), labels


def load_cifar10(data_dir=None, limit=None, download=True):
    """Loads CIFAR-10 as channels-last uint8 images and int32 labels.

    Args:
        data_dir: Optional path to ``cifar-10-batches-py`` or its parent; see
            `find_cifar10` for the search order.
        limit: Keep at most the first ``limit`` training and ``limit`` test
            images (positive int), or ``None`` for all of them.
        download: Whether to try downloading when no local copy is found.

    Returns:
        ``((x_train, y_train), (x_test, y_test))`` with x uint8 ``(n, 32, 32, 3)``
        and y int32 ``(n,)``.

    Raises:
        ValueError: Bad ``limit`` or a bad batch file.
        FileNotFoundError: No dataset found, or a batch file is missing.
    """
    if limit is not None and (
        isinstance(limit, bool) or not isinstance(limit, numbers.Integral) or limit < 1
    ):
        raise ValueError(f"limit must be a positive integer or None. Received: limit={limit!r}")
    folder = find_cifar10(data_dir, download=download)
    logger.info("Loading CIFAR-10 from %s", folder)
    train = []
    for name in TRAIN_FILES:  # with a limit, stop reading once enough images are in
        train.append(read_batch(folder / name))
        if limit is not None and sum(len(y) for _, y in train) >= limit:
            break
    x_train = np.concatenate([x for x, _ in train])[:limit]
    y_train = np.concatenate([y for _, y in train])[:limit]
    x_test, y_test = read_batch(folder / TEST_FILE)
    return (x_train, y_train), (x_test[:limit], y_test[:limit])
