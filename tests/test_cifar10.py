"""Tests for keras_multigpu.data.cifar10 (no network; real subset read in place)."""

import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest

from keras_multigpu.data import cifar10
from keras_multigpu.data.cifar10 import find_cifar10, load_cifar10, read_batch

BATCH_FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


def _shared_folder():
    candidates = []
    if os.environ.get("KERAS_MULTIGPU_DATA"):
        env = Path(os.environ["KERAS_MULTIGPU_DATA"])
        candidates += [env, env / "cifar-10-batches-py"]
    beside_repo = Path(__file__).resolve().parents[2] / "shared" / "data"
    candidates += [
        beside_repo / "cifar-10-batches-py",
        Path("/work/shared/data/cifar-10-batches-py"),
    ]
    for folder in candidates:
        if all((folder / n).is_file() for n in BATCH_FILES):
            return folder
    return None


SHARED = _shared_folder()
needs_data = pytest.mark.skipif(
    SHARED is None,
    reason="shared CIFAR-10 subset not found ($KERAS_MULTIGPU_DATA, ../shared/data)",
)


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


@needs_data
def test_loads_shared_subset():
    (x_train, y_train), (x_test, y_test) = load_cifar10(SHARED, download=False)
    assert x_train.shape == (5085, 32, 32, 3) and x_test.shape == (1017, 32, 32, 3)
    assert x_train.dtype == np.uint8 and x_test.dtype == np.uint8
    assert y_train.shape == (5085,) and y_test.shape == (1017,)
    assert y_train.dtype == np.int32 and y_test.dtype == np.int32
    for y in (y_train, y_test):
        assert y.min() >= 0 and y.max() <= 9 and len(np.unique(y)) == 10
    assert x_train.flags.c_contiguous and 50 < x_train.mean() < 200


@needs_data
def test_channels_last_layout_matches_raw_rows():
    with open(SHARED / "data_batch_1", "rb") as f:
        raw = pickle.load(f, encoding="bytes")
    x, y = read_batch(SHARED / "data_batch_1")
    row = np.asarray(raw[b"data"][3])
    np.testing.assert_array_equal(x[3, :, :, 0].ravel(), row[:1024])  # red plane
    np.testing.assert_array_equal(x[3, :, :, 2].ravel(), row[2048:])  # blue plane
    assert list(y) == list(raw[b"labels"])


@needs_data
def test_limit():
    (x_train, y_train), (x_test, y_test) = load_cifar10(SHARED, limit=1500, download=False)
    assert x_train.shape == (1500, 32, 32, 3) and y_train.shape == (1500,)
    assert x_test.shape == (1017, 32, 32, 3)
    (x_train, _), (x_test, y_test) = load_cifar10(SHARED, limit=7, download=False)
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


def test_incomplete_folder_names_missing_file(tmp_path):
    folder = _fake_folder(tmp_path)
    (folder / "test_batch").unlink()
    with pytest.raises(FileNotFoundError, match="test_batch"):
        load_cifar10(folder, download=False)
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


@needs_data
def test_truncated_file(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name in BATCH_FILES:
        shutil.copyfile(SHARED / name, folder / name)
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
    for protocol in (2, 4, 5):
        x, y = read_batch(_write_batch(tmp_path / f"b{protocol}", batch, protocol))
        assert x.shape == (6, 32, 32, 3) and y.dtype == np.int32


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
