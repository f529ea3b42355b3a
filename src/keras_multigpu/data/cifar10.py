"""Locate and read CIFAR-10 in its python format (``cifar-10-batches-py/``).

Batch files are read with a restricted unpickler that only rebuilds NumPy arrays
from bytes the file holds, so a tampered or damaged file can neither run code nor
make the loader allocate more than the file's size; every file is validated (n >= 1
images of 3,072 uint8 values, n labels in 0..9) and every error names the file.
"""

import io
import logging
import numbers
import os
from pathlib import Path

import numpy as np

from keras_multigpu.data._unpickle import (  # noqa: F401 (_ALLOWED_GLOBALS: the tests)
    _ALLOWED_GLOBALS,
    IMAGE_BYTES,
    _ForbiddenGlobalError,
    _PickledArray,
    _RefusedError,
    _SafeUnpickler,
    _scan,
)

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

NUM_CLASSES = 10
# A real batch of 10,000 images is about 31 MB; far larger files are refused unread.
_MAX_FILE_BYTES = 1 << 30
def _check(folder, looked):
    """Returns ``folder`` if it holds every batch file, else notes why not."""
    missing = [n for n in (*TRAIN_FILES, TEST_FILE) if not (folder / n).is_file()]
    if not missing:
        return folder
    if not folder.is_dir():
        why = "a file, not a folder" if folder.exists() else "does not exist"
        looked.append(f"{folder} ({why})")
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
            raise _not_found([f"{label}={given}: " + "; ".join(looked)])
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
