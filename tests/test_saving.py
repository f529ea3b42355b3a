"""Files written by a ParallelModel are plain Keras files of the template."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import keras
import numpy as np
import pytest

import keras_multigpu as kmg
from conftest import TORCH_WORLD, classification_data, engine_gpus

# On torch, each test runs in TORCH_WORLD forked processes, one per device (conftest), and
# every model in it is wrapped on those; process 0 writes each file, every process reads it.
pytestmark = pytest.mark.ranks(TORCH_WORLD)

# Runs in a fresh process that never imports keras_multigpu, on one CPU device.
LOAD_WITHOUT_LIBRARY = """
import json, sys
import numpy as np
import keras
model = keras.saving.load_model(sys.argv[1])
x = np.load(sys.argv[2])
import jax
print(json.dumps({
    "library_imported": "keras_multigpu" in sys.modules,
    "devices": len(jax.devices()),
    "layers": [layer.__class__.__name__ for layer in model.layers],
    "compiled": bool(model.compiled),
    "optimizer": model.optimizer.__class__.__name__ if model.optimizer else None,
    "prediction": model.predict(x, verbose=0).tolist(),
}))
"""


def load_elsewhere(path, x, tmp_path):
    np.save(tmp_path / "x.npy", x)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KERAS_MULTIGPU", "XLA"))}
    env["KERAS_BACKEND"] = "jax"
    result = subprocess.run(
        [sys.executable, "-c", LOAD_WITHOUT_LIBRARY, str(path), str(tmp_path / "x.npy")],
        capture_output=True, text=True, env=env, timeout=180, check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def trained_parallel(dense_model, gpus=4):
    x, y = classification_data(30)
    parallel = kmg.multi_gpu_model(dense_model(), gpus=engine_gpus(gpus))
    parallel.compile(optimizer="adam", loss="categorical_crossentropy", metrics=["accuracy"])
    parallel.fit(x, y, batch_size=7, epochs=2, verbose=0)
    return parallel, x, y


# A ParallelModel's `save`, and Keras's functions handed one (which a Keras program calls as
# well: `keras.saving.save_model(model, path)`; before, they wrote the wrapper's class, which
# only this library loads, and on TensorFlow lost the optimizer's state).
SAVES = {"save": lambda model, path: model.save(path),
         "keras.saving.save_model": lambda model, path: keras.saving.save_model(model, path)}


@pytest.mark.parametrize("save", list(SAVES))
def test_saved_file_loads_without_the_library_on_one_cpu(dense_model, tmp_path, save):
    parallel, x, _ = trained_parallel(dense_model)
    SAVES[save](parallel, tmp_path / "model.keras")
    loaded = load_elsewhere(tmp_path / "model.keras", x, tmp_path)
    assert loaded["library_imported"] is False
    assert loaded["devices"] == 1
    assert loaded["layers"] == ["Dense", "Dense"]  # the template, not a wrapper
    assert loaded["compiled"] and loaded["optimizer"] == "Adam"
    np.testing.assert_allclose(loaded["prediction"], parallel.predict(x, verbose=0), atol=1e-6)
    if save != "save":  # its other name writes the same file
        keras.models.save_model(parallel, tmp_path / "again.keras")
        with zipfile.ZipFile(tmp_path / "again.keras") as archive:
            assert json.loads(archive.read("config.json"))["class_name"] == "Sequential"


def test_keras_save_model_arguments_by_position(dense_model, tmp_path):
    """`keras.saving.save_model(model, path, overwrite, zipped)`: Keras's unzipped folder,
    and overwrite=False refused (where plain Keras asks at the terminal)."""
    parallel, x, _ = trained_parallel(dense_model)
    keras.saving.save_model(parallel, tmp_path / "folder", True, False)
    loaded = keras.saving.load_model(tmp_path / "folder")
    np.testing.assert_allclose(loaded.predict(x, verbose=0), parallel.predict(x, verbose=0),
                               atol=1e-6)
    for path in ("folder", "model.keras"):
        if path.endswith(".keras"):
            parallel.save(tmp_path / path)
        with pytest.raises(FileExistsError, match="overwrite=False"):
            keras.saving.save_model(parallel, tmp_path / path, False, path == "model.keras")


def _swap_save_model(old, new):
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("keras") and getattr(
                module, "save_model", None) is old:
            module.save_model = new


def test_keras_save_model_of_the_wrapper_counts_once_whichever_was_installed_first(
        dense_model, tmp_path):
    """Keras's save function replaced for the wrapper (its template) before the processes'
    (process 0 writes) wrapped it: process 0 counted the wrapper's save and its template's,
    the others one, and the next save's outcome read was another's (a refusal ignored)."""
    from keras_multigpu import _face, processes

    parallel, x, _ = trained_parallel(dense_model)
    keras_own = keras.saving.save_model
    while hasattr(keras_own, "__wrapped__"):
        keras_own = keras_own.__wrapped__
    installed = keras.saving.save_model
    _swap_save_model(installed, keras_own)  # as before either was installed
    try:
        _face.save_templates()
        if processes.count() > 1:
            processes._install_saves()
        for _ in range(2):
            keras.saving.save_model(parallel, tmp_path / "model.keras")
        with pytest.raises(FileExistsError, match="overwrite=False"):
            keras.saving.save_model(parallel, tmp_path / "model.keras", False)
        parallel.predict(x, verbose=0)  # every process in step
    finally:
        _swap_save_model(keras.saving.save_model, installed)


def test_reload_and_rewrap_never_nests(dense_model, tmp_path):
    parallel, x, y = trained_parallel(dense_model)
    path = tmp_path / "model.keras"
    for round_ in range(3):
        parallel.save(path)
        model = keras.saving.load_model(path)
        assert [type(layer).__name__ for layer in model.layers] == ["Dense", "Dense"], round_
        parallel = kmg.multi_gpu_model(model, gpus=engine_gpus([1, 2, 3]))
        # The loaded model was compiled: the wrapper resumes with its optimizer.
        assert parallel.optimizer is model.optimizer
        parallel.fit(x, y, batch_size=6, epochs=1, verbose=0)
    again = kmg.multi_gpu_model(parallel, gpus=engine_gpus(2))
    assert again.template is parallel.template


def test_resumed_training_keeps_optimizer_state(dense_model, tmp_path):
    parallel, x, y = trained_parallel(dense_model)
    iterations = int(parallel.optimizer.iterations.numpy())
    parallel.save(tmp_path / "model.keras")
    resumed = kmg.multi_gpu_model(keras.saving.load_model(tmp_path / "model.keras"),
                                 gpus=engine_gpus(2))
    assert int(resumed.optimizer.iterations.numpy()) == iterations
    resumed.fit(x, y, batch_size=7, epochs=1, verbose=0)
    assert int(resumed.optimizer.iterations.numpy()) == iterations + 5


@pytest.mark.parametrize("save", ["save_weights", "keras.saving.save_weights"])
def test_weights_load_into_a_plain_model(dense_model, tmp_path, save):
    parallel, x, _ = trained_parallel(dense_model)
    if save == "save_weights":
        parallel.save_weights(tmp_path / "w.weights.h5")
    else:
        keras.saving.save_weights(parallel, tmp_path / "w.weights.h5")
    plain = dense_model(seed=7)
    plain.load_weights(tmp_path / "w.weights.h5")
    expected = parallel.predict(x, verbose=0)
    np.testing.assert_allclose(plain.predict(x, verbose=0), expected, atol=1e-6)
    other = kmg.multi_gpu_model(dense_model(seed=9), gpus=engine_gpus(3))
    other.load_weights(tmp_path / "w.weights.h5")
    np.testing.assert_allclose(other.predict(x, verbose=0), plain.predict(x, verbose=0), atol=1e-6)


@pytest.mark.parametrize("name", ["model.h5", "model.hdf5"])
def test_legacy_hdf5_saves_are_the_templates_as_on_one_device(dense_model, tmp_path, name):
    # Keras's `Model.save` and a `ModelCheckpoint` take `.h5` too (its legacy format, with a
    # warning): older programs checkpoint so, after their first epoch.
    parallel, x, y = trained_parallel(dense_model)
    parallel.save(tmp_path / name)
    checkpoint = keras.callbacks.ModelCheckpoint(tmp_path / "best.h5")  # .h5 alone
    parallel.fit(x, y, batch_size=7, epochs=1, verbose=0, callbacks=[checkpoint])
    assert sorted(os.listdir(tmp_path)) == sorted([name, "best.h5"])  # no temporaries
    for path in (tmp_path / name, tmp_path / "best.h5"):
        loaded = keras.saving.load_model(path)
        assert [type(layer).__name__ for layer in loaded.layers] == ["Dense", "Dense"]
        assert loaded.optimizer.__class__.__name__ == "Adam"
    np.testing.assert_allclose(loaded.predict(x, verbose=0), parallel.predict(x, verbose=0),
                               atol=1e-6)


def test_failed_save_leaves_the_previous_file_intact(dense_model, tmp_path, monkeypatch):
    from keras.src.saving import saving_lib

    from keras_multigpu import processes

    parallel, _, _ = trained_parallel(dense_model)
    path = tmp_path / "model.keras"
    parallel.save(path)
    before = path.read_bytes()

    def broken_save(model, filepath, **kwargs):  # Keras's writer fails half-way
        with open(filepath, "wb") as f:
            f.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(saving_lib, "save_model", broken_save)
    # With several processes (torch), process 0 writes; the others raise its error.
    error = OSError if processes.rank() == 0 else RuntimeError
    with pytest.raises(error, match="disk full"):
        parallel.save(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["model.keras"]  # no temporary file left


def test_saved_files_get_ordinary_permissions(dense_model, tmp_path):
    parallel = kmg.multi_gpu_model(dense_model(), gpus=engine_gpus(2))
    parallel.save(tmp_path / "model.keras")
    parallel.save_weights(tmp_path / "w.weights.h5")
    mask = os.umask(0)
    os.umask(mask)
    for name in ("model.keras", "w.weights.h5"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~mask, name


def test_copies_clones_and_json_are_the_templates_as_a_plain_model(dense_model):
    """What a ParallelModel shows is its template's (`save` writes the template): so are a
    `copy.deepcopy` (Keras pickles a model through its saving library), a
    `keras.models.clone_model` and `to_json`. They failed: the config named ParallelModel,
    which no one could rebuild."""
    import copy

    parallel, x, _ = trained_parallel(dense_model, gpus=2)
    template = parallel.template
    copied = copy.deepcopy(parallel)
    assert type(copied) is type(template)
    np.testing.assert_allclose(copied.predict(x, verbose=0), parallel.predict(x, verbose=0),
                               atol=1e-6)
    for rebuilt in (keras.models.clone_model(parallel),
                    keras.models.model_from_json(parallel.to_json())):
        assert type(rebuilt) is type(template)
        assert [layer.name for layer in rebuilt.layers] == [layer.name for layer in template.layers]
        assert rebuilt.count_params() == template.count_params()


class _Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)


@pytest.mark.ranks(1)
def test_a_subclassed_templates_clone_says_how_to_clone_it():
    model = _Subclassed()
    model(np.zeros((1, 3), "float32"))
    parallel = kmg.multi_gpu_model(model, gpus=1)
    with pytest.raises(TypeError, match=r"keras.models.clone_model\(parallel.template\)"):
        keras.models.clone_model(parallel)


@pytest.mark.ranks(1)
def test_an_export_replaces_the_earlier_one_whole_or_not_at_all(dense_model, tmp_path,
                                                                  monkeypatch):
    """An export is written beside its path and renamed in: one that fails halfway leaves
    the earlier export as it was, one that succeeds replaces it whole, and a temporary
    folder that a killed export left is removed by the next."""
    parallel, _, _ = trained_parallel(dense_model, gpus=1)
    path = tmp_path / "served"

    def export(filepath, fail=False, **kwargs):  # stands for a SavedModel's writer
        os.makedirs(filepath)
        (Path(filepath) / "saved_model.pb").write_text("new")
        if fail:
            raise OSError("No space left on device")

    monkeypatch.setattr(parallel.template, "export", export)
    parallel.export(path)
    (path / "stale.txt").write_text("from an older export")
    leftover = tmp_path / ".served.tmp-999999999-killed"
    leftover.mkdir()
    (path / "saved_model.pb").write_text("old")
    with pytest.raises(OSError, match="No space"):
        parallel.export(path, fail=True)
    assert (path / "saved_model.pb").read_text() == "old"
    parallel.export(path)
    assert sorted(p.name for p in path.iterdir()) == ["saved_model.pb"]
    assert (path / "saved_model.pb").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["served"]


def test_export_writes_the_template_once(dense_model, tmp_path):
    """`export` (a SavedModel for serving) exports the template, on the first process; it
    failed ("The model provided has never called"), the wrapper never being called. On
    torch, Keras's own export may fail (Keras 3.15.1 on torch 2.13, one device too): then
    process 0 raises it, and every other process an error naming process 0."""
    pytest.importorskip("tensorflow")
    parallel, x, _ = trained_parallel(dense_model, gpus=2)
    path = tmp_path / "served"
    try:
        parallel.export(path, format="tf_saved_model", verbose=False)
    except Exception as error:  # noqa: BLE001 - which error is the test's question
        assert keras.backend.backend() == "torch", error
        rank = int(os.environ.get("RANK", "0"))
        assert rank == 0 or "Process 0 could not export" in str(error), error
        return
    assert (path / "saved_model.pb").exists()
    if keras.backend.backend() != "torch":
        import tensorflow as tf

        loaded = tf.saved_model.load(str(path))  # held: its variables live with it
        np.testing.assert_allclose(np.asarray(loaded.serve(x[:3])),
                                   parallel.predict(x[:3], verbose=0), atol=1e-5)
