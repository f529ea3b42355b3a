"""Keras's standard callbacks work on a ParallelModel, as on a plain model."""

import csv
import importlib.util

import keras
import numpy as np
import pytest

import keras_multigpu as kmg
from conftest import TORCH_WORLD, assert_weights_close, classification_data, engine_gpus

pytestmark = pytest.mark.ranks(TORCH_WORLD)  # on torch: one forked process per device


def parallel_model(dense_model, gpus=3, lr=0.05):
    parallel = kmg.multi_gpu_model(dense_model(), gpus=engine_gpus(gpus))
    parallel.compile(
        optimizer=keras.optimizers.SGD(lr), loss="categorical_crossentropy", metrics=["accuracy"]
    )
    return parallel


def test_model_checkpoint_writes_loadable_template(dense_model, tmp_path):
    x, y = classification_data(40)
    parallel = parallel_model(dense_model)
    path = tmp_path / "best.keras"
    checkpoint = keras.callbacks.ModelCheckpoint(path, monitor="val_loss", save_best_only=True)
    parallel.fit(x, y, batch_size=8, epochs=3, validation_data=(x[:9], y[:9]),
                 callbacks=[checkpoint], verbose=0)
    loaded = keras.saving.load_model(path)
    assert [type(layer).__name__ for layer in loaded.layers] == ["Dense", "Dense"]
    assert loaded.predict(x, verbose=0).shape == (40, 3)


def test_model_checkpoint_weights_only(dense_model, tmp_path):
    x, y = classification_data(20)
    parallel = parallel_model(dense_model)
    path = tmp_path / "epoch{epoch}.weights.h5"
    parallel.fit(x, y, batch_size=8, epochs=2, verbose=0,
                 callbacks=[keras.callbacks.ModelCheckpoint(path, save_weights_only=True)])
    plain = dense_model(seed=3)
    plain.load_weights(tmp_path / "epoch2.weights.h5")
    assert_weights_close(plain.get_weights(), parallel.get_weights(), atol=0)


def test_early_stopping_restores_best_weights(dense_model):
    x, y = classification_data(40)
    parallel = parallel_model(dense_model, lr=2.0)  # diverges quickly: stops early
    seen = {}

    class Snapshot(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen[epoch] = (logs["val_loss"], self.model.get_weights())

    stop = keras.callbacks.EarlyStopping(patience=1, restore_best_weights=True)
    parallel.fit(x, y, batch_size=8, epochs=30, validation_data=(x, y), verbose=0,
                 callbacks=[Snapshot(), stop])
    assert len(seen) < 30
    best_epoch = min(seen, key=lambda e: seen[e][0])
    assert_weights_close(parallel.template.get_weights(), seen[best_epoch][1], atol=0)


def test_learning_rate_callbacks_change_the_shared_optimizer(dense_model):
    x, y = classification_data(24)
    parallel = parallel_model(dense_model)
    schedule = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.01 * (epoch + 1))
    plateau = keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0,
                                                min_delta=10.0)
    history = parallel.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[schedule, plateau])
    assert history.history["learning_rate"][0] == pytest.approx(0.01)
    # ReduceLROnPlateau (min_delta=10: never an improvement) halved the last rate.
    assert float(parallel.optimizer.learning_rate.numpy()) == pytest.approx(0.015)
    assert parallel.template.optimizer is parallel.optimizer


def test_a_callback_reads_the_optimizer_as_python_numbers(dense_model):
    """`int(self.model.optimizer.iterations)` and `float(...learning_rate)` in a callback, as
    on one device (TensorFlow's distributed variables refused `int()`: a TypeError)."""
    x, y = classification_data(22)
    parallel = parallel_model(dense_model)
    read = []
    reader = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: read.append(
        (int(parallel.optimizer.iterations), float(parallel.optimizer.learning_rate))))
    parallel.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[reader])
    assert read == [(3, pytest.approx(0.05)), (6, pytest.approx(0.05))]


class ScaledModel(keras.Model):  # no leading _: TensorFlow's scope names refuse it
    """A model whose output is scaled by `scale`, a plain attribute its `call` reads."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)
        self.scale = 1.0

    def call(self, x):
        return self.dense(x) * self.scale


class Anneal(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.model.scale = 1.0 + epoch


def test_an_attribute_a_callback_sets_on_the_model_reaches_its_steps():
    """A callback's `self.model.scale = ...` (an annealed weight of a loss, a temperature):
    the model's steps read it from the template, where it is now written; it was left on the
    wrapper, and the steps trained on with the first value (torch's losses 3.82 and 3.17 in
    the 2nd and 3rd epochs against one device's 5.57 and 4.44). Steps run eagerly, where a
    traced step reads the attribute again, as on one device."""

    def run(gpus):
        keras.utils.set_random_seed(0)
        model = ScaledModel()
        if gpus:
            model = kmg.multi_gpu_model(model, gpus=engine_gpus(gpus))
        model.compile(optimizer="sgd", loss="mse", run_eagerly=True)
        x = np.random.default_rng(0).normal(size=(20, 3)).astype("float32")
        history = model.fit(x, x.sum(axis=1, keepdims=True), batch_size=5, epochs=3,
                            verbose=0, callbacks=[Anneal()])
        return model, history.history["loss"]

    parallel, losses = run(2)
    np.testing.assert_allclose(losses, run(None)[1], rtol=1e-5)
    assert parallel.template.scale == parallel.scale == 3.0
    assert "scale" not in vars(parallel)


def test_csv_logger_and_history(dense_model, tmp_path):
    x, y = classification_data(24)
    parallel = parallel_model(dense_model)
    history = parallel.fit(x, y, batch_size=5, epochs=2, verbose=0,
                           callbacks=[keras.callbacks.CSVLogger(tmp_path / "log.csv")])
    with open(tmp_path / "log.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == [0, 1]
    np.testing.assert_allclose([float(r["loss"]) for r in rows], history.history["loss"],
                               rtol=1e-6)


def test_backup_and_restore_resumes_after_interruption(dense_model, tmp_path):
    x, y = classification_data(24)
    backup = tmp_path / "backup"

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("worker died")

    parallel = parallel_model(dense_model)
    with pytest.raises(RuntimeError, match="worker died"):
        parallel.fit(x, y, batch_size=8, epochs=4, verbose=0,
                     callbacks=[keras.callbacks.BackupAndRestore(backup), Interrupt()])
    resumed = parallel_model(dense_model)
    history = resumed.fit(x, y, batch_size=8, epochs=4, verbose=0,
                          callbacks=[keras.callbacks.BackupAndRestore(backup)])
    assert len(history.epoch) == 2  # epochs 2 and 3: 0 and 1 were restored


@pytest.mark.skipif(
    not all(importlib.util.find_spec(name) for name in ("tensorflow", "tensorboard")),
    reason="keras.callbacks.TensorBoard writes through TensorFlow and TensorBoard, not installed",
)
def test_tensorboard_writes_logs(dense_model, tmp_path):
    x, y = classification_data(16)
    parallel = parallel_model(dense_model)
    parallel.fit(x, y, batch_size=8, epochs=1, verbose=0,
                 callbacks=[keras.callbacks.TensorBoard(tmp_path / "tb")])
    assert any((tmp_path / "tb").rglob("events.out.tfevents.*"))


def test_epoch_stats_leaves_steps_unsynchronised(dense_model):
    """EpochStats has no batch hook, so Keras keeps dispatching steps without waiting for
    each step's metrics on the host (its async callback dispatch stays on)."""
    from keras_multigpu.callbacks import EpochStats

    class PerBatch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            pass

    if not keras.src.backend.IS_THREAD_SAFE:
        pytest.skip(f"Keras dispatches callbacks asynchronously only on a thread-safe backend "
                    f"(JAX), not on {keras.backend.backend()}")
    model = parallel_model(dense_model)
    assert keras.callbacks.CallbackList([EpochStats(10)], model=model)._async_train
    assert not keras.callbacks.CallbackList([PerBatch()], model=model)._async_train
