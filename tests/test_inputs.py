"""Every input Keras accepts gives the same training as NumPy arrays."""

import gc
import importlib.util

import keras
import numpy as np
import pytest

import keras_multigpu as kmg
from conftest import TORCH_WORLD, assert_weights_close, classification_data, engine_gpus

pytestmark = pytest.mark.ranks(TORCH_WORLD)  # on torch: one forked process per device

X, Y = classification_data(45)
BATCH = 10


def batches():
    for start in range(0, len(X), BATCH):
        yield X[start : start + BATCH], Y[start : start + BATCH]


class Batches(keras.utils.PyDataset):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)

    def __len__(self):
        return -(-len(X) // BATCH)

    def __getitem__(self, index):
        s = slice(index * BATCH, (index + 1) * BATCH)
        return X[s], Y[s]


def train(dense_model, data, gpus=4, epochs=1, **kwargs):
    template = dense_model()
    parallel = kmg.multi_gpu_model(template, gpus=engine_gpus(gpus))
    parallel.compile(optimizer="sgd", loss="categorical_crossentropy", metrics=["accuracy"])
    history = parallel.fit(data, epochs=epochs, verbose=0, **kwargs)
    return template, parallel, history


class Reiterable:
    """Iterated afresh each epoch and of known length, like tf.data or a DataLoader."""

    def __len__(self):
        return -(-len(X) // BATCH)

    def __iter__(self):
        return batches()


@pytest.fixture
def reference(dense_model):
    template, _, history = train(dense_model, X, gpus=1, y=Y, batch_size=BATCH, shuffle=False)
    return template.get_weights(), history.history


@pytest.mark.parametrize(
    "make_data",
    [batches, Batches, lambda: Reiterable()],
    ids=["generator", "py_dataset", "reiterable-with-len"],
)
def test_streaming_inputs_equal_arrays(dense_model, reference, make_data):
    template, parallel, history = train(dense_model, make_data(), shuffle=False)
    weights, logs = reference
    assert_weights_close(weights, template.get_weights())
    np.testing.assert_allclose(logs["loss"], history.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(logs["accuracy"], history.history["accuracy"], rtol=1e-5)
    assert parallel.predict(make_data(), verbose=0).shape == (45, 3)
    np.testing.assert_allclose(
        parallel.evaluate(make_data(), verbose=0), parallel.evaluate(X, Y, batch_size=BATCH,
                                                                     verbose=0),
        rtol=1e-5,
    )


# (A PyDataset read every epoch: test_semantics's shuffling test compares its 3 epochs with Keras.)
def test_a_reiterable_is_read_every_epoch(dense_model):
    _, _, history = train(dense_model, Reiterable(), epochs=3)
    assert len(history.history["loss"]) == 3
    # Same data each epoch: plain SGD on a convex-ish problem keeps lowering it.
    assert history.history["loss"][2] < history.history["loss"][0]


def test_validation_data_as_py_dataset(dense_model):
    _, _, history = train(dense_model, X, y=Y, batch_size=BATCH, validation_data=Batches())
    assert "val_loss" in history.history and np.isfinite(history.history["val_loss"][0])


def test_predict_keeps_row_order_for_streams(dense_model):
    template, parallel, _ = train(dense_model, X, y=Y, batch_size=BATCH)
    expected = template.predict(X, verbose=0)
    np.testing.assert_allclose(parallel.predict(batches(), verbose=0), expected, atol=1e-6)


def test_threaded_py_dataset_trains_and_predicts_in_order(dense_model):
    # Keras's threaded enqueuer (workers > 1) changes the first epoch's batch
    # order for plain models too, so weights are not compared here; every
    # prediction must still come back once, in order.
    template, parallel, history = train(dense_model, Batches(workers=2), epochs=2)
    assert np.all(np.isfinite(history.history["loss"]))
    np.testing.assert_allclose(
        parallel.predict(Batches(workers=2), verbose=0), template.predict(X, verbose=0), atol=1e-6
    )


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None,
                    reason="tf.data needs TensorFlow, which is not installed")
def _sparse(kind, x):
    if kind == "scipy":
        return pytest.importorskip("scipy.sparse").coo_matrix(x)
    if kind == "tensorflow":
        return pytest.importorskip("tensorflow").sparse.from_dense(x)
    from jax.experimental import sparse

    return sparse.BCOO.fromdense(x)


# (Keras's torch backend has no sparse tensors of its own.)
@pytest.mark.parametrize("kind", ["scipy"] + [
    backend for backend in [keras.backend.backend()] if backend != "torch"])
def test_a_sparse_matrix_equals_its_dense_arrays(dense_model, reference, kind):
    """A SciPy sparse x (a TF-IDF matrix), or this backend's sparse tensor, which Keras's own
    adapter takes, was refused as a stream ("it must yield the targets"): its rows are
    gathered per batch, served dense."""
    template, parallel, history = train(dense_model, _sparse(kind, X), y=Y, batch_size=BATCH,
                                        shuffle=False)
    weights, logs = reference
    assert_weights_close(weights, template.get_weights())
    np.testing.assert_allclose(history.history["loss"], logs["loss"], rtol=1e-5)
    np.testing.assert_allclose(parallel.predict(_sparse(kind, X), batch_size=7, verbose=0),
                               template.predict(X, verbose=0), atol=1e-6)


def test_tf_data_equals_arrays(dense_model, reference):
    import tensorflow as tf

    def dataset():
        return tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH)

    template, parallel, history = train(dense_model, dataset())
    weights, logs = reference
    assert_weights_close(weights, template.get_weights())
    np.testing.assert_allclose(logs["loss"], history.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(parallel.predict(dataset(), verbose=0),
                               template.predict(X, verbose=0), atol=1e-6)


@pytest.mark.skipif(keras.backend.backend() != "tensorflow",
                    reason="tf.data iterators run on the TensorFlow backend only")
def test_the_iterators_a_call_drops_have_no_autotuning_to_wait_for(dense_model, monkeypatch):
    # Keras drops each epoch's tf.data iterators; each waited for its autotuning thread's
    # sleep (up to a minute) and stood TensorFlow still, 0.7-11 s a time. The pipelines Keras
    # makes for the call run without autotuning: MirroredStrategy's per device, and ours,
    # which one device iterates itself (with several, TensorFlow's C++ iterates it).
    import tensorflow as tf
    from tensorflow.python.data.ops import iterator_ops

    made = []
    init = iterator_ops.OwnedIterator.__init__

    def recording(self, dataset=None, **kwargs):
        if dataset is not None:  # an unset option reads None: autotuning on
            made.append(dataset.options().autotune.enabled is False)
        return init(self, dataset, **kwargs)

    monkeypatch.setattr(iterator_ops.OwnedIterator, "__init__", recording)
    user = tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH)
    for gpus, data, kwargs in [(4, X, {"y": Y, "batch_size": BATCH}), (4, user, {}),
                               (1, X, {"y": Y, "batch_size": BATCH})]:
        made.clear()
        train(dense_model, data, gpus=gpus, epochs=2, **kwargs)
        assert made and all(made), (gpus, made)


@pytest.mark.skipif(keras.backend.backend() != "tensorflow",
                    reason="tf.data iterators run on the TensorFlow backend only")
def test_a_generators_calls_leave_no_tf_data_iterator_to_a_later_collection(dense_model):
    # Keras's epoch iterator and a generator hold each other; the tf.data iterators of such a
    # call, freed by a later collection mid-trace, each stood the process still for up to a
    # minute (their autotuning threads' period). The calls must free them as they end.
    def alive():
        names = {"OwnedIterator", "OwnedMultiDeviceIterator", "DistributedIterator"}
        return sorted(type(o).__name__ for o in gc.get_objects() if type(o).__name__ in names)

    gc.collect()
    gc.disable()
    try:
        _, parallel, _ = train(dense_model, batches(), validation_data=batches())
        after_fit = alive()
        parallel.predict(batches(), verbose=0)
        parallel.evaluate(batches(), verbose=0)
        after_all = alive()
    finally:
        gc.enable()
    assert after_fit == [] and after_all == []
