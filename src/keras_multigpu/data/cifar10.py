"""Locate and read CIFAR-10 in its python format (``cifar-10-batches-py/``).

Batch files are read with a restricted unpickler that only reconstructs NumPy
arrays, so a tampered file cannot run code, and every file is validated.
"""

import codecs
import logging
import numbers
import os
import pickle
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

try:  # NumPy >= 2
    from numpy._core.multiarray import _reconstruct
    from numpy._core.numeric import _frombuffer
except ImportError:  # pragma: no cover - NumPy 1.x
    from numpy.core.multiarray import _reconstruct
    from numpy.core.numeric import _frombuffer

_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy.core.numeric", "_frombuffer"): _frombuffer,
    ("numpy._core.numeric", "_frombuffer"): _frombuffer,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): codecs.encode,
}


class _ForbiddenGlobalError(pickle.UnpicklingError):
    """A pickle referenced a global outside the allow-list."""


class _SafeUnpickler(pickle.Unpickler):
    """Unpickler that resolves only the globals NumPy arrays need."""

    def find_class(self, module, name):
        try:
            return _ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            raise _ForbiddenGlobalError(f"disallowed global {module}.{name}") from None


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


def _get(batch, key, path):
    for k in (key, key.encode()):
        if k in batch:
            return batch[k]
    keys = sorted(str(k) for k in batch)
    raise _bad(path, f"no {key!r} entry (keys: {keys}), so it is not a CIFAR-10 batch")


def read_batch(path):
    """Reads one CIFAR-10 batch file safely.

    Args:
        path: Path of a batch file such as ``data_batch_1``.

    Returns:
        ``(x, y)``: uint8 images of shape ``(n, 32, 32, 3)`` and int32 labels ``(n,)``.

    Raises:
        FileNotFoundError: The file does not exist.
        ValueError: The file cannot be read, is truncated or corrupted, is not a
            CIFAR-10 batch, or refers to objects other than NumPy arrays.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: CIFAR-10 batch file is missing. {_HINT}")
    try:
        with open(path, "rb") as f:
            batch = _SafeUnpickler(f, encoding="bytes").load()
    except _ForbiddenGlobalError as exc:
        raise _bad(path, f"refused to unpickle it ({exc}); it is no CIFAR-10 batch") from exc
    except OSError as exc:
        raise _bad(path, f"cannot be read ({exc})") from exc
    except Exception as exc:
        raise _bad(path, f"truncated or corrupted ({type(exc).__name__}: {exc})") from exc
    if not isinstance(batch, dict):
        raise _bad(path, f"holds a {type(batch).__name__} instead of a dict")
    data, labels = _get(batch, "data", path), _get(batch, "labels", path)
    if not isinstance(data, np.ndarray) or data.ndim != 2 or data.shape[1] != 3072:
        shape = getattr(data, "shape", type(data).__name__)
        raise _bad(path, f"'data' must be an (n, 3072) array, got {shape}")
    if data.dtype != np.uint8 and not (
        np.issubdtype(data.dtype, np.integer)
        and (data.size == 0 or (data.min() >= 0 and data.max() <= 255))
    ):
        raise _bad(path, f"'data' must hold uint8 pixel values, got dtype {data.dtype}")
    try:
        labels = np.asarray(labels)
    except Exception as exc:
        raise _bad(path, f"'labels' is not a list of ints ({exc})") from exc
    if labels.ndim != 1 or not (labels.size == 0 or np.issubdtype(labels.dtype, np.integer)):
        raise _bad(path, f"'labels' must be a flat list of ints, got {labels.dtype}")
    if len(labels) != len(data):
        raise _bad(path, f"{len(labels)} labels for {len(data)} images; the counts must match")
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise _bad(path, f"labels must be in 0..9, found {labels.min()}..{labels.max()}")
    x = data.astype(np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return np.ascontiguousarray(x), labels.astype(np.int32)


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
