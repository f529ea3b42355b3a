"""Tests for keras_multigpu.data.cifar10 (no network; synthetic folders in the dataset's format)."""

import codecs
import os
import pickle
import shutil
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from conftest import synthetic_cifar
from keras_multigpu.data import cifar10
from keras_multigpu.data.cifar10 import find_cifar10, load_cifar10, read_batch

BATCH_FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


ROWS = 320  # images per batch file of the synthetic folder: 1,600 training, 320 test


@pytest.fixture(scope="module")
def cifar(tmp_path_factory):
    """A CIFAR-10 folder in the dataset's own format (pickled batches of uint8 rows)."""
    return Path(synthetic_cifar(tmp_path_factory.mktemp("cifar"), rows=ROWS))


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """No env var, an empty Keras cache, and no real download in any test."""
    monkeypatch.delenv("KERAS_MULTIGPU_DATA", raising=False)
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras_home"))

    def no_network(*args, **kwargs):
        raise AssertionError("tests must not download")

    import keras

    monkeypatch.setattr(keras.utils, "get_file", no_network)


def _write_batch(path, batch, protocol=2):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(batch, f, protocol=protocol)
    return path


def _fake_batch(n=4, seed=0):
    rng = np.random.default_rng(seed)
    return {
        b"batch_label": b"fake",
        b"labels": [int(v) for v in rng.integers(0, 10, n)],
        b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
    }


def _fake_folder(root, n=4):
    folder = root / "cifar-10-batches-py"
    for i, name in enumerate(BATCH_FILES):
        _write_batch(folder / name, _fake_batch(n, seed=i))
    return folder


def test_loads_a_folder(cifar):
    (x_train, y_train), (x_test, y_test) = load_cifar10(cifar, download=False)
    assert x_train.shape == (5 * ROWS, 32, 32, 3) and x_test.shape == (ROWS, 32, 32, 3)
    assert x_train.dtype == np.uint8 and x_test.dtype == np.uint8
    assert y_train.shape == (5 * ROWS,) and y_test.shape == (ROWS,)
    assert y_train.dtype == np.int32 and y_test.dtype == np.int32
    for y in (y_train, y_test):
        assert y.min() >= 0 and y.max() <= 9 and len(np.unique(y)) == 10
    assert x_train.flags.c_contiguous and 50 < x_train.mean() < 200


def test_channels_last_layout_matches_raw_rows(cifar):
    with open(cifar / "data_batch_1", "rb") as f:
        raw = pickle.load(f, encoding="bytes")
    x, y = read_batch(cifar / "data_batch_1")
    row = np.asarray(raw[b"data"][3])
    np.testing.assert_array_equal(x[3, :, :, 0].ravel(), row[:1024])  # red plane
    np.testing.assert_array_equal(x[3, :, :, 2].ravel(), row[2048:])  # blue plane
    assert list(y) == list(raw[b"labels"])


def test_limit(cifar):
    (x_train, y_train), (x_test, y_test) = load_cifar10(cifar, limit=1500, download=False)
    assert x_train.shape == (1500, 32, 32, 3) and y_train.shape == (1500,)
    assert x_test.shape == (ROWS, 32, 32, 3)
    (x_train, _), (x_test, y_test) = load_cifar10(cifar, limit=7, download=False)
    assert len(x_train) == 7 and len(x_test) == 7 and len(y_test) == 7


@pytest.mark.parametrize("limit", [0, -3, 2.5, "10", True])
def test_bad_limit(limit, tmp_path):
    with pytest.raises(ValueError, match="limit"):
        load_cifar10(_fake_folder(tmp_path), limit=limit, download=False)


def test_parent_folder_and_env_var(tmp_path, monkeypatch):
    folder = _fake_folder(tmp_path / "a")
    assert find_cifar10(folder, download=False) == folder
    assert find_cifar10(folder.parent, download=False) == folder
    assert find_cifar10(str(folder.parent), download=False) == folder
    monkeypatch.setenv("KERAS_MULTIGPU_DATA", str(folder.parent))
    assert find_cifar10(download=False) == folder
    monkeypatch.setenv("KERAS_MULTIGPU_DATA", str(folder))
    assert find_cifar10(download=False) == folder


def test_argument_beats_env_var(tmp_path, monkeypatch):
    arg = _fake_folder(tmp_path / "arg", n=3)
    env = _fake_folder(tmp_path / "env", n=5)
    monkeypatch.setenv("KERAS_MULTIGPU_DATA", str(env))
    assert find_cifar10(arg, download=False) == arg
    (x, _), _ = load_cifar10(arg, download=False)
    assert len(x) == 5 * 3


def test_keras_cache_layouts(tmp_path):
    home = tmp_path / "keras_home"  # KERAS_HOME set by the autouse fixture
    new = _fake_folder(home / "datasets" / "cifar-10-batches-py-target")
    assert find_cifar10(download=False) == new
    old = _fake_folder(home / "datasets")
    assert find_cifar10(download=False) == old


def test_missing_everywhere_lists_places(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        find_cifar10(download=False)
    msg = str(info.value)
    assert str(tmp_path / "keras_home" / "datasets" / "cifar-10-batches-py") in msg
    assert "cifar-10-batches-py-target" in msg
    assert "--data-dir" in msg and "KERAS_MULTIGPU_DATA" in msg
    with pytest.raises(FileNotFoundError):
        load_cifar10(download=False)


def test_bad_argument_is_not_skipped(tmp_path, monkeypatch):
    good = _fake_folder(tmp_path / "good")
    monkeypatch.setenv("KERAS_MULTIGPU_DATA", str(good))
    missing = tmp_path / "typo"
    with pytest.raises(FileNotFoundError) as info:
        find_cifar10(missing)  # download=True, yet nothing is downloaded
    assert str(missing) in str(info.value) and "does not exist" in str(info.value)
    # One line for the place given, with what was found there (it was a bare heading).
    assert f"  - data_dir={missing}: {missing} (does not exist); {missing}/" in str(info.value)


def test_a_file_given_for_the_folder_is_called_a_file(tmp_path):
    not_a_folder = tmp_path / "data_batch_1"
    not_a_folder.write_bytes(b"")
    with pytest.raises(FileNotFoundError) as info:
        find_cifar10(not_a_folder, download=False)
    assert f"{not_a_folder} (a file, not a folder)" in str(info.value)


def test_incomplete_folder_names_missing_file(tmp_path):
    folder = _fake_folder(tmp_path)
    (folder / "test_batch").unlink()
    with pytest.raises(FileNotFoundError, match="missing test_batch") as info:
        load_cifar10(folder, download=False)
    msg = str(info.value)
    assert str(folder) in msg and "--data-dir" in msg and "KERAS_MULTIGPU_DATA" in msg
    with pytest.raises(FileNotFoundError, match="test_batch"):
        read_batch(folder / "test_batch")


def test_download_used_last_and_failure_reported(tmp_path, monkeypatch):
    import keras

    calls = []

    class FetchError(Exception):  # keras.utils.get_file raises a plain Exception
        pass

    def failing(**kwargs):
        calls.append(kwargs)
        raise FetchError("URL fetch failure: no network")

    monkeypatch.setattr(keras.utils, "get_file", failing)
    with pytest.raises(FileNotFoundError, match="no network") as info:
        find_cifar10()
    assert calls[0]["origin"] == cifar10.CIFAR10_URL and calls[0]["extract"] is True
    assert "--data-dir" in str(info.value)

    extracted = _fake_folder(tmp_path / "dl")
    monkeypatch.setattr(keras.utils, "get_file", lambda **kw: str(extracted.parent))
    assert find_cifar10() == extracted


def test_truncated_file(tmp_path, cifar):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name in BATCH_FILES:
        shutil.copyfile(cifar / name, folder / name)
    target = folder / "data_batch_3"
    with open(target, "r+b") as f:
        f.truncate(os.path.getsize(target) // 2)
    with pytest.raises(ValueError, match="data_batch_3") as info:
        load_cifar10(folder, download=False)
    assert "truncated or corrupted" in str(info.value)


@pytest.mark.parametrize("content", [b"", b"not a pickle at all", b"\x80\x02}q\x00(X"])
def test_garbage_file(tmp_path, content):
    path = tmp_path / "data_batch_1"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="data_batch_1"):
        read_batch(path)


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_disallowed_global_does_not_execute(tmp_path):
    marker = tmp_path / "pwned"
    batch = _fake_batch()
    batch[b"labels"] = _Evil(marker)
    path = _write_batch(tmp_path / "data_batch_1", batch)
    assert b"system" in path.read_bytes()  # the payload really is in the file
    with pytest.raises(ValueError, match="disallowed global") as info:
        read_batch(path)
    assert isinstance(info.value.__cause__, pickle.UnpicklingError)
    assert str(path) in str(info.value)
    assert not marker.exists()


def test_str_keys_and_protocols(tmp_path):
    batch = {k.decode(): v for k, v in _fake_batch(6).items()}
    batch["batch_label"] = b""  # protocol 2 stores b"" as a call to bytes()
    for protocol in (0, 1, 2, 3, 4, 5):
        x, y = read_batch(_write_batch(tmp_path / f"b{protocol}", batch, protocol))
        assert x.shape == (6, 32, 32, 3) and y.dtype == np.int32
        assert list(y) == batch["labels"]
        np.testing.assert_array_equal(x[2, :, :, 1].ravel(), batch["data"][2, 1024:2048])


@pytest.mark.parametrize(
    "change, message",
    [
        ({b"data": np.zeros((4, 3000), np.uint8)}, "3072"),
        ({b"data": np.zeros((4, 32, 32, 3), np.uint8)}, "3072"),
        ({b"data": np.zeros((4, 3072), np.float32)}, "uint8"),
        ({b"data": np.full((4, 3072), 300, np.int64)}, "uint8"),
        ({b"data": [[0] * 3072] * 4}, "3072"),
        ({b"labels": [0, 1, 2]}, "3 labels for 4 images"),
        ({b"labels": [0, 1, 2, 10]}, "0..9"),
        ({b"labels": [0, 1, 2, -1]}, "0..9"),
        ({b"labels": [0.5, 1, 2, 3]}, "labels"),
        ({b"data": None}, "3072"),
    ],
)
def test_bad_contents(tmp_path, change, message):
    batch = _fake_batch(4)
    batch.update(change)
    path = _write_batch(tmp_path / "data_batch_1", batch)
    with pytest.raises(ValueError, match=message) as info:
        read_batch(path)
    assert str(path) in str(info.value)


def test_wrong_keys_and_type(tmp_path):
    batch = _fake_batch()
    del batch[b"labels"]
    path = _write_batch(tmp_path / "data_batch_1", batch)
    with pytest.raises(ValueError, match="'labels'"):
        read_batch(path)
    path = _write_batch(tmp_path / "data_batch_2", [1, 2, 3])
    with pytest.raises(ValueError, match="data_batch_2.*list instead of a dict"):
        read_batch(path)


def test_int_data_in_range_is_accepted(tmp_path):
    batch = _fake_batch(4)
    batch[b"data"] = batch[b"data"].astype(np.int64)
    x, _ = read_batch(_write_batch(tmp_path / "data_batch_1", batch))
    assert x.dtype == np.uint8


# --- damaged and lying files: checked before anything large is allocated ---

N_LIE = 100_000  # images a lying file declares: 307 MB of pixels if it were believed
MAX_PEAK = 32 * 2**20  # bytes read_batch may allocate while refusing a lying file


class _Reduce:
    """Pickles as ``func(*args)``, then ``BUILD`` with ``state``: what a hand-made file holds."""

    def __init__(self, func, args, state=None):
        self.func, self.args, self.state = func, args, state

    def __reduce__(self):
        return (self.func, self.args) if self.state is None else (self.func, self.args, self.state)


def _np_global(module, name):
    for prefix in ("numpy._core", "numpy.core"):
        try:
            return getattr(__import__(f"{prefix}.{module}", fromlist=[name]), name)
        except ImportError:
            continue
    raise ImportError(name)


_reconstruct = _np_global("multiarray", "_reconstruct")
_frombuffer = _np_global("numeric", "_frombuffer")
U1 = np.dtype("u1")


def _read_refused(path, match):
    """Runs read_batch(path), expecting a ValueError; returns (message, peak traced bytes)."""
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        with pytest.raises(ValueError, match=match) as info:
            read_batch(path)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        if started:
            tracemalloc.stop()
    msg = str(info.value)
    assert str(path) in msg, msg
    assert "--data-dir" in msg and "KERAS_MULTIGPU_DATA" in msg, msg
    return msg, peak


def _lying_batches():
    """Small files whose pickle declares N_LIE images without holding their bytes."""
    n, pixels = N_LIE, (N_LIE, 3072)
    zeros = b"\0" * 3072
    return {
        # numpy.ndarray(shape, dtype): uninitialised (all-zero) arrays from ~240 bytes
        "ndarray_call": (
            {
                b"data": _Reduce(np.ndarray, (pixels, U1)),
                b"labels": _Reduce(np.ndarray, ((n,), np.dtype("i8"))),
            },
            r"numpy\.ndarray with shape \(100000, 3072\)",
        ),
        # numpy.ndarray(shape, dtype, buffer, offset, strides): 1 byte broadcast to 307 MB
        "zero_strides": (
            {
                b"data": _Reduce(np.ndarray, (pixels, U1, b"\0", 0, (0, 0))),
                b"labels": _Reduce(np.ndarray, ((n,), np.dtype("i8"), b"\0" * 8, 0, (0,))),
            },
            r"numpy\.ndarray with shape \(100000, 3072\)",
        ),
        # the normal array pickle, but its state declares more than its bytes
        "reconstruct_state": (
            {
                b"data": _Reduce(
                    _reconstruct, (np.ndarray, (0,), b"b"), (1, pixels, U1, False, zeros)
                ),
                b"labels": [0],
            },
            r"declares shape \(100000, 3072\) of uint8 \(307,200,000 bytes\) but holds 3,072",
        ),
        # the protocol-5 array pickle with the same lie
        "frombuffer": (
            {b"data": _Reduce(_frombuffer, (zeros, U1, pixels, "C")), b"labels": [0]},
            r"declares shape \(100000, 3072\) of uint8 \(307,200,000 bytes\) but holds 3,072",
        ),
    }


@pytest.mark.parametrize("kind", sorted(_lying_batches()))
def test_tiny_file_declaring_many_images(tmp_path, kind):
    batch, match = _lying_batches()[kind]
    path = _write_batch(tmp_path / "data_batch_1", batch)
    assert path.stat().st_size < 4000  # a few bytes pretending to be 100,000 images
    msg, peak = _read_refused(path, match)
    assert "refused to unpickle" in msg
    assert peak < MAX_PEAK, f"allocated {peak / 2**20:.0f} MiB while refusing {kind}"


def test_tiny_file_with_probe_payload_through_load_cifar10(tmp_path):
    folder = _fake_folder(tmp_path)
    batch, _ = _lying_batches()["ndarray_call"]
    _write_batch(folder / "data_batch_1", batch)
    with pytest.raises(ValueError, match="data_batch_1.*numpy.ndarray") as info:
        load_cifar10(folder, download=False)
    assert str(folder / "data_batch_1") in str(info.value)


def _raw_pickle(*chunks):
    return b"\x80\x02" + b"".join(chunks) + b"."


@pytest.mark.parametrize(
    "raw, match",
    [
        # BINBYTES8 declaring 2 GiB: CPython allocates the declared size before reading
        (_raw_pickle(b"\x8e" + struct.pack("<Q", 2**31) + b"abc"), "expected 2147483648 bytes"),
        # LONG_BINPUT at index 2**23: CPython grows (and zeroes) its memo table to fit
        (_raw_pickle(b"}r" + struct.pack("<I", 2**23)), "memo index 8,388,608"),
        # BINSTRING declaring 300 MB of pixels in a 20-byte file
        (_raw_pickle(b"T" + struct.pack("<i", 300_000_000) + b"\0" * 8), "expected 300000000"),
    ],
    ids=["bytes8_length", "memo_index", "string4_length"],
)
def test_lying_lengths_refused_before_allocating(tmp_path, raw, match):
    path = tmp_path / "data_batch_2"
    path.write_bytes(raw)
    _, peak = _read_refused(path, match)
    assert peak < MAX_PEAK, f"allocated {peak / 2**20:.0f} MiB for a {len(raw)}-byte file"


def test_nested_labels_are_not_expanded(tmp_path):
    """n entries sharing one k x k list: 2k opcodes that NumPy would expand to n*k*k ints."""
    n, k = 16, 800
    row = [0] * k
    batch = _fake_batch(n)
    batch[b"labels"] = [[row] * k] * n
    path = _write_batch(tmp_path / "data_batch_1", batch)
    assert path.stat().st_size < n * 3072 + 40 * k  # ~80 kB for 10 million labels
    _, peak = _read_refused(path, "flat list of ints, found list at index 0")
    assert peak < MAX_PEAK, f"allocated {peak / 2**20:.0f} MiB expanding nested labels"


def test_codec_chain_refused(tmp_path):
    """Each hex encode doubles its input; a chain in a tiny file would be a bomb."""
    label = b"ab"
    for _ in range(16):
        label = _Reduce(codecs.encode, (label, "hex"))
    batch = _fake_batch(2)
    batch[b"batch_label"] = label
    path = _write_batch(tmp_path / "data_batch_1", batch)
    _read_refused(path, r"disallowed codec call _codecs\.encode\(\.\.\., 'hex'\)")


def test_object_and_structured_dtypes_refused(tmp_path):
    state = (1, (3,), np.dtype("O"), False, [1, 2, 3])
    batch = _fake_batch(3)
    batch[b"labels"] = _Reduce(_reconstruct, (np.ndarray, (0,), b"b"), state)
    path = _write_batch(tmp_path / "data_batch_1", batch)
    _read_refused(path, "disallowed array element type 'O8'")
    batch = _fake_batch(3)
    batch[b"data"] = np.zeros(3, dtype=[("pixels", "u1", (3072,))])
    path = _write_batch(tmp_path / "data_batch_2", batch)
    _read_refused(path, "disallowed")


@pytest.mark.parametrize("cut", [0.02, 0.5, 0.999])
def test_truncated_fake_batch(tmp_path, cut):
    path = _write_batch(tmp_path / "data_batch_4", _fake_batch(8))
    raw = path.read_bytes()
    path.write_bytes(raw[: int(len(raw) * cut)])
    msg, _ = _read_refused(path, "truncated or corrupted")
    assert "Traceback" not in msg


@pytest.mark.parametrize(
    "content",
    [
        b"\x1f\x8b\x08\x00" + bytes(range(256)) * 20,  # the .tar.gz instead of its contents
        b"# CIFAR-10\n" * 500,  # a text file
        b"\x89PNG\r\n\x1a\n" + b"\0" * 5000,  # an image
        pickle.dumps({b"data": "x"}, protocol=2)[:-1],  # no STOP
    ],
    ids=["gzip", "text", "png", "no_stop"],
)
def test_non_pickle_file(tmp_path, content):
    path = tmp_path / "test_batch"
    path.write_bytes(content)
    _read_refused(path, "truncated or corrupted")


def test_zero_images_file_and_folder(tmp_path):
    path = _write_batch(tmp_path / "data_batch_1", _fake_batch(0))
    msg, _ = _read_refused(path, r"holds 0 images \('data' has shape \(0, 3072\)\)")
    folder = _fake_folder(tmp_path / "empty", n=0)
    with pytest.raises(ValueError, match="holds 0 images") as info:
        load_cifar10(folder, download=False)
    msg = str(info.value)
    assert str(folder / "data_batch_1") in msg and "--data-dir" in msg
    path = _write_batch(tmp_path / "data_batch_2", {b"data": b"", b"labels": []})
    _read_refused(path, r"holds 0 images")


def test_folder_without_batches_names_it(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    (folder / "batches.meta").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="no CIFAR-10 batch files") as info:
        load_cifar10(folder, download=False)
    msg = str(info.value)
    assert str(folder) in msg and "--data-dir" in msg and "KERAS_MULTIGPU_DATA" in msg


@pytest.mark.parametrize(
    "change, message",
    [
        ({b"data": np.zeros(4 * 3072, np.uint8)}, r"must be an \(n, 3072\).*got shape \(12288,\)"),
        ({b"data": np.zeros((3072, 4), np.uint8)}, r"got shape \(3072, 4\)"),
        ({b"data": b"\0" * (4 * 3072 - 1)}, "12,287 bytes, which is not a whole number"),
        ({b"data": np.zeros((4, 3072), bool)}, "uint8"),
        ({b"labels": np.arange(5)}, "5 labels for 4 images"),
        ({b"labels": np.zeros((4, 1), np.int64)}, "flat list of ints"),
        ({b"labels": np.array([0.0, 1, 2, 3])}, "flat list of ints"),
        ({b"labels": np.array([0, 1, 2, 12])}, r"0\.\.9, found 0\.\.12"),
        ({b"labels": [0, 1, True, 3]}, "found bool at index 2"),
        ({b"labels": [0, 1, 2, 2**200]}, r"0\.\.9, found 0\.\.huge"),
        ({b"labels": "0123"}, "must be a list of ints, got str"),
        ({b"labels": list(range(10)) * 4}, "40 labels for 4 images"),
    ],
)
def test_more_bad_contents(tmp_path, change, message):
    batch = _fake_batch(4)
    batch.update(change)
    path = _write_batch(tmp_path / "data_batch_1", batch)
    _read_refused(path, message)


def test_good_variants_accepted(tmp_path):
    batch = _fake_batch(5)
    want_x, _ = read_batch(_write_batch(tmp_path / "plain", batch))
    variants = {
        "bytes": {b"data": batch[b"data"].tobytes()},
        "fortran": {b"data": np.asfortranarray(batch[b"data"])},
        "big_endian_labels": {b"labels": np.array(batch[b"labels"], ">i8")},
        "tuple_labels": {b"labels": tuple(batch[b"labels"])},
    }
    for name, change in variants.items():
        x, y = read_batch(_write_batch(tmp_path / name, {**batch, **change}))
        np.testing.assert_array_equal(x, want_x)
        assert list(y) == batch[b"labels"] and y.dtype == np.int32


def test_oversized_file_refused_unread(tmp_path, monkeypatch):
    path = _write_batch(tmp_path / "data_batch_5", _fake_batch(4))
    monkeypatch.setattr(cifar10, "_MAX_FILE_BYTES", 10_000)
    _read_refused(path, "far larger than a CIFAR-10 batch")


def test_opcode_flood_refused(tmp_path):
    batch = _fake_batch(1)
    batch[b"batch_label"] = [0] * 20_000  # 40 kB of 2-byte opcodes
    path = _write_batch(tmp_path / "data_batch_1", batch)
    _read_refused(path, "pickle opcodes")


@pytest.mark.parametrize(
    "module, name",
    sorted(cifar10._ALLOWED_GLOBALS),
    ids=[".".join(k) for k in sorted(cifar10._ALLOWED_GLOBALS)],
)
def test_allowed_globals_cannot_be_modified(tmp_path, module, name):
    """BUILD on a global (state (None, {attr: value})) must not alter the next read."""
    attr = b"__setstate__"
    raw = _raw_pickle(
        f"c{module}\n{name}\n".encode(),
        b"N}X" + struct.pack("<I", len(attr)) + attr + b"c__builtin__\nbytes\n" + b"s\x86b",
    )
    path = tmp_path / "data_batch_1"
    path.write_bytes(raw)
    _read_refused(path, "refused to unpickle it: the file tries to modify")
    good = _fake_batch(3, seed=7)
    x, y = read_batch(_write_batch(tmp_path / "good", good))
    assert x.shape == (3, 32, 32, 3) and list(y) == good[b"labels"]
