"""User-facing errors through the public API: clear, early, never JAX-internal. On every
engine; on torch each test runs in TORCH_WORLD processes, each wrapping its own model."""

import re
import signal
import time
import zipfile

import keras
import numpy as np
import pytest

import keras_multigpu as kmg
from conftest import TORCH_WORLD, PerProcess, engine_gpus, per_process, stateful_model
from keras_multigpu import interrupt, processes

pytestmark = pytest.mark.ranks(TORCH_WORLD)


def _data(n, features=6, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    y = keras.utils.to_categorical(rng.integers(0, classes, n), classes)
    return x, y


@pytest.fixture
def model(dense_model):
    return dense_model()


@pytest.fixture
def parallel(model):
    def make():
        p = kmg.multi_gpu_model(model, gpus=engine_gpus(2))
        p.compile(optimizer="sgd", loss="categorical_crossentropy", metrics=["accuracy"])
        return p

    return per_process(make)


@pytest.fixture
def no_training(monkeypatch, parallel):
    """Fails the test if Keras's training loop is entered; checks nothing moved."""

    def started(*args, **kwargs):
        raise AssertionError("Keras's fit was called: the error came too late")

    def before():
        model = parallel.get() if isinstance(parallel, PerProcess) else parallel
        return model, _weights(model)

    def unmoved(state):
        model, weights = state
        assert int(model.optimizer.iterations.value) == 0
        for a, b in zip(weights, _weights(model)):
            np.testing.assert_array_equal(a, b)

    monkeypatch.setattr(keras.Model, "fit", started)
    check = per_process(before, unmoved)
    yield check
    if not isinstance(check, PerProcess):
        unmoved(check)


def _weights(parallel):
    return [keras.ops.convert_to_numpy(v.value) for v in parallel.template.variables]


# -- multi_gpu_model ---------------------------------------------------------------


@pytest.mark.parametrize("bad", [keras.optimizers.SGD(), "MinibatchStd", int])
def test_mixes_rows_refuses_what_is_no_layer_class(bad):
    with pytest.raises(TypeError, match=f"Layer subclass.*Received: {re.escape(repr(bad))}"):
        kmg.mixes_rows(bad)


@pytest.mark.parametrize(
    "bad, type_name",
    [
        (keras.layers.Dense(2), "Dense"),
        ("model.keras", "str"),
        (None, "NoneType"),
        (np.zeros(3), "ndarray"),
    ],
)
def test_multi_gpu_model_refuses_a_non_model(bad, type_name):
    with pytest.raises(TypeError, match=rf"Received: model of type {type_name}\.") as info:
        kmg.multi_gpu_model(bad)
    assert type(info.value) is TypeError
    assert "keras.Model" in str(info.value)
    # a path: what to do with it
    assert ("keras.saving.load_model('model.keras')" in str(info.value)) == (type_name == "str")


@pytest.mark.parametrize(
    "gpus, error, shown",
    [
        (9, ValueError, r"gpus=9"),
        (-1, ValueError, r"gpus=-1"),
        ([0, 0], ValueError, r"gpus=\[0, 0\]"),
        ([8], ValueError, r"unknown device id\(s\) \[8\]"),
        ([], ValueError, r"gpus is an empty list"),
        ("2", TypeError, r"gpus='2'"),
        (2.0, TypeError, r"gpus=2\.0"),
        (True, TypeError, r"gpus=True"),
        ([0, "1"], TypeError, r"gpus=\[0, '1'\]"),
    ],
)
def test_multi_gpu_model_refuses_bad_gpus(model, gpus, error, shown):
    with pytest.raises(error, match=shown) as info:
        kmg.multi_gpu_model(model, gpus=gpus)
    assert type(info.value) is error


def test_too_many_gpus_lists_what_exists(model):
    with pytest.raises(ValueError) as info:
        kmg.multi_gpu_model(model, gpus=9)
    assert ", ".join(str(d.id) for d in kmg.list_devices()) in str(info.value)  # 0, 1, ... 7
    assert "gpus=None" in str(info.value)


def test_a_stateful_rnn_is_refused_where_each_device_sees_its_share():
    """A stateful RNN's state holds a row per sample of its fixed batch; a TensorFlow
    replica or torch process sees its share of each batch (Keras failed deep in the graph,
    or on "Expected batch size: 6"). JAX's devices run one step on the whole batch, where it
    trains as on one device (test_semantics)."""
    from keras_multigpu import backends

    if backends.has(backends.current(), "whole_batch"):
        pytest.skip("each step sees the whole batch: test_semantics trains one")
    with pytest.raises(ValueError, match=r"stateful layer\(s\) \['stateful_lstm'\].*gpus=1"):
        kmg.multi_gpu_model(stateful_model(), gpus=engine_gpus(2))


class _FixedBatchNoise(keras.layers.Layer):
    """Noise for a batch of `rows` rows, a constant: keras-io's DDIM draws its noise as
    `keras.random.normal((batch_size, ...))` in its `train_step`."""

    def __init__(self, rows, **kwargs):
        super().__init__(**kwargs)
        self.rows = rows
        self.seed = keras.random.SeedGenerator(1)

    def call(self, x, training=False):
        if not training:
            return x
        return x + 0.01 * keras.random.normal((self.rows, x.shape[-1]), seed=self.seed)


def test_a_shape_fixed_to_the_global_batch_is_explained_where_each_device_sees_its_share():
    """On one device the noise's 12 rows meet the batch's 12. A TensorFlow replica or torch
    process sees its share of the batch, and failed on the shapes alone (TensorFlow's
    "Incompatible shapes: [6,3] vs. [12,3]"); the error now says why and what to do. JAX's
    devices run one step on the whole batch, where the model trains."""
    from keras_multigpu import backends

    inputs = keras.Input((6,))
    outputs = keras.layers.Dense(3)(_FixedBatchNoise(12)(inputs))
    parallel = kmg.multi_gpu_model(keras.Model(inputs, outputs), gpus=engine_gpus(2))
    parallel.compile(optimizer="sgd", loss="mse")
    x, y = _data(24)
    if backends.has(backends.current(), "whole_batch"):
        parallel.fit(x, y, batch_size=12, epochs=1, verbose=0)
        return
    with pytest.raises(Exception) as info:
        parallel.fit(x, y, batch_size=12, epochs=1, verbose=0)
    notes = getattr(info.value, "__notes__", [])
    assert any("2 replicas ran this step on its share of the global batch" in note
               and "keras.ops.shape(x)[0]" in note for note in notes), (info.value, notes)


class _BuiltByItsStep(keras.Model):
    """No `call`: its step calls layers it has not built (Keras's TensorFlow trainer, with
    no strategy, lets one device build them there)."""

    def __init__(self):
        super().__init__()
        self.encoder = keras.layers.Dense(4, name="encoder")
        self.decoder = keras.layers.Dense(6, name="decoder")

    def train_step(self, *args):
        raise AssertionError("the model is refused before its first step")


def test_layers_its_step_would_build_are_named_with_what_to_do():
    x = _data(12)[0]
    parallel = kmg.multi_gpu_model(_BuiltByItsStep(), gpus=engine_gpus(2))
    parallel.compile(optimizer="sgd")
    with pytest.raises(RuntimeError, match=r"these of its layers are not built: encoder, "
                                           r"decoder\. .* Build them before fit"):
        parallel.fit(x, batch_size=4, epochs=1, verbose=0)


# -- fit: refused before any training ---------------------------------------------


@pytest.mark.parametrize("batch_size", [0, -3])
def test_fit_non_positive_batch_size(parallel, no_training, batch_size):
    x, y = _data(16)
    with pytest.raises(ValueError, match=rf"Received: batch_size={batch_size}\.") as info:
        parallel.fit(x, y, batch_size=batch_size, verbose=0)
    assert type(info.value) is ValueError


def test_fit_str_batch_size(parallel, no_training):
    x, y = _data(16)
    with pytest.raises(TypeError, match=r"batch_size must be an int\. Received: batch_size='32'"):
        parallel.fit(x, y, batch_size="32", verbose=0)


def test_fit_float_batch_size(parallel, no_training):
    x, y = _data(16)
    with pytest.raises(TypeError, match=r"batch_size=8\.0"):
        parallel.fit(x, y, batch_size=8.0, verbose=0)


def test_a_numpy_int_batch_size_is_taken(parallel):
    """`batch_size=np.int64(6)`, as `len(x) // 4` on an array gives: torch's samplers refuse
    all but Python's int ("should be a positive integer value, but got batch_size=6")."""
    x, y = _data(16)
    history = parallel.fit(x, y, batch_size=np.int64(6), epochs=1, verbose=0)
    assert len(history.history["loss"]) == 1
    assert np.isfinite(parallel.evaluate(x, y, batch_size=np.int32(6), verbose=0)).all()


@pytest.mark.parametrize("call", ["fit", "train_on_batch", "evaluate", "test_on_batch"])
def test_a_call_before_compile_says_to_compile(model, call):
    """Keras's torch trainer read the missing optimizer first (an AttributeError) in
    `evaluate`; Keras's own message for `fit` did not say where to compile."""
    parallel = kmg.multi_gpu_model(model, gpus=engine_gpus(2))
    x, y = _data(8)
    with pytest.raises(ValueError, match=rf"compile\(\)` before `{call}\(\)`"):
        getattr(parallel, call)(x, y)


def test_fit_x_and_y_of_different_lengths(parallel, no_training):
    x, y = _data(16)
    with pytest.raises(ValueError, match=r"x has 16 rows but y has 10") as info:
        parallel.fit(x, y[:10], batch_size=4, verbose=0)
    assert type(info.value) is ValueError


def test_fit_sample_weight_of_another_length(parallel, no_training):
    x, y = _data(16)
    with pytest.raises(ValueError, match=r"x has 16 rows but sample_weight has 15"):
        parallel.fit(x, y, sample_weight=np.ones(15), batch_size=4, verbose=0)


@pytest.mark.parametrize("name", ["y", "sample_weight"])
def test_a_python_list_of_numbers_says_to_make_it_an_array(parallel, no_training, name):
    """A Python list of numbers is a list of inputs to Keras, each a number of no axis: the
    error names it (it was an IndexError from counting the rows)."""
    x, y = _data(16)
    given = {"y": y, "sample_weight": None, name: [1.0] * 16}
    with pytest.raises(ValueError, match=rf"{name} must be arrays .* np.asarray"):
        parallel.fit(x, given["y"], sample_weight=given["sample_weight"], batch_size=4,
                     verbose=0)


def test_fit_empty_arrays(parallel, no_training):
    x, y = _data(16)
    with pytest.raises(ValueError, match=r"0 rows") as info:
        parallel.fit(x[:0], y[:0], batch_size=4, verbose=0)
    assert type(info.value) is ValueError


@pytest.mark.parametrize("fraction", [1.5, 1.0, -0.2])
def test_fit_validation_split_out_of_range(parallel, no_training, fraction):
    x, y = _data(16)
    with pytest.raises(ValueError, match=rf"validation_split={fraction}") as info:
        parallel.fit(x, y, validation_split=fraction, batch_size=4, verbose=0)
    assert type(info.value) is ValueError


def test_fit_validation_split_leaving_an_empty_set(parallel, no_training):
    x, y = _data(3)
    with pytest.raises(ValueError, match=r"validation_split=0\.8 of 3 samples"):
        parallel.fit(x, y, validation_split=0.8, batch_size=4, verbose=0)


def test_fit_validation_split_with_a_generator(parallel, no_training):
    def batches():
        yield _data(4)

    with pytest.raises(ValueError, match=r"validation_split needs array inputs"):
        parallel.fit(batches(), validation_split=0.5, verbose=0)


def test_fit_without_x(parallel, no_training):
    with pytest.raises(ValueError, match=r"x=None"):
        parallel.fit(None, verbose=0)


def test_fit_drop_remainder_leaving_no_batch(parallel, no_training):
    x, y = _data(5)
    with pytest.raises(ValueError, match=r"drop_remainder=True with 5 samples and batch_size=8"):
        parallel.fit(x, y, batch_size=8, drop_remainder=True, verbose=0)


def test_fit_str_x(parallel, no_training):
    with pytest.raises(TypeError, match=r"x of type str"):
        parallel.fit("train.csv", verbose=0)


# -- evaluate / predict ---------------------------------------------------------------


def test_evaluate_bad_batch_size(parallel):
    x, y = _data(8)
    with pytest.raises(ValueError, match=r"batch_size=0"):
        parallel.evaluate(x, y, batch_size=0, verbose=0)


def test_predict_bad_batch_size(parallel):
    x, _ = _data(8)
    with pytest.raises(TypeError, match=r"batch_size='4'"):
        parallel.predict(x, batch_size="4", verbose=0)


# -- save ----------------------------------------------------------------------------------


def test_save_refuses_another_suffix(parallel, tmp_path):
    target = tmp_path / "model.pt"
    with pytest.raises(ValueError, match=r"must end in '\.keras' or '\.h5' or '\.hdf5'") \
            as info:
        parallel.save(target)
    assert "model.pt" in str(info.value)
    assert list(tmp_path.iterdir()) == []  # no file, no leftover temporary


def test_save_weights_refuses_another_suffix(parallel, tmp_path):
    with pytest.raises(ValueError, match=r"must end in '\.weights\.h5'"):
        parallel.save_weights(tmp_path / "model.h5")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("method, suffixes", [("save", "'.keras' or '.h5' or '.hdf5'"),
                                              ("save_weights", "'.weights.h5'")])
def test_a_path_that_is_not_one_is_refused(parallel, method, suffixes):
    with pytest.raises(TypeError, match=rf"must be a path ending in {re.escape(suffixes)}\. "
                                        r"Received: filepath=None of type NoneType"):
        getattr(parallel, method)(None)


def test_save_without_overwrite_onto_an_existing_file(parallel, tmp_path):
    # A file per process (torch's share tmp_path): one's write_bytes truncates the file
    # another reads. Each refuses before any process writes.
    target = tmp_path / f"model-{processes.rank()}.keras"
    target.write_bytes(b"keep me")
    with pytest.raises(FileExistsError, match=r"overwrite=False") as info:
        parallel.save(target, overwrite=False)
    assert target.name in str(info.value)
    assert target.read_bytes() == b"keep me"
    assert all(p.name.startswith("model-") for p in tmp_path.iterdir())  # no temporary


def test_weights_of_another_model_name_the_variable_not_its_values(parallel, dense_model,
                                                                 tmp_path):
    """Keras's error prints each variable it names with every value (a screenful)."""
    target = tmp_path / "other.weights.h5"  # (on torch, process 0 writes it for every one)
    dense_model(inputs=5).save_weights(target)
    with pytest.raises(ValueError, match=r"other\.weights\.h5 does not fit this model") as info:
        parallel.load_weights(target)
    assert "shape=(6, 8)" in str(info.value) and "value=" not in str(info.value), info.value


@pytest.mark.parametrize("method, name", [("save", "new.keras"),
                                          ("save_weights", "new.weights.h5")])
def test_save_without_overwrite_onto_a_new_path_writes_it_on_every_process(
        parallel, tmp_path, method, name):
    """Every process looks before any writes: process 0 wrote and went on, and a process
    behind it found the file and raised alone (torch: the others then waited for it)."""
    target = tmp_path / name
    if processes.rank() == 1:
        time.sleep(1)
    getattr(parallel, method)(target, overwrite=False)
    assert target.exists()
    with pytest.raises(FileExistsError, match="overwrite=False"):
        getattr(parallel, method)(target, overwrite=False)


def test_save_weights_without_overwrite_onto_an_existing_file(parallel, tmp_path):
    target = tmp_path / f"model-{processes.rank()}.weights.h5"  # as above
    target.write_bytes(b"keep me")
    with pytest.raises(FileExistsError, match=r"overwrite=False"):
        parallel.save_weights(target, overwrite=False)
    assert target.read_bytes() == b"keep me"


@pytest.mark.skipif(keras.backend.backend() != "torch",
                    reason="several processes: torch's (JAX and TensorFlow run one here)")
def test_checkpoints_that_differ_between_processes_are_named_before_training(
        parallel, tmp_path):
    """A folder per process: the second fit, process 0 resumed and the others started
    afresh, and waited for each other's collectives until the timeout. Saves at other steps
    made gloo abort the processes."""
    from keras_multigpu.callbacks import Checkpoint

    x, y = _data(24)
    own = Checkpoint(tmp_path / f"process-{processes.rank()}")
    parallel.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[own])  # alike: afresh
    with pytest.raises(ValueError, match=r"Checkpoints differ: process 1 has Checkpoint\(.*"
                       r"process-1', save_freq='epoch'\) and starts afresh; process 0 has .*"
                       r"and resumes after 3 step\(s\) of epoch 1\. Pass the same Checkpoint"):
        parallel.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[own])
    with pytest.raises(ValueError, match=r"process 1 has Checkpoint\(.*process-1'.*starts "
                       r"afresh; process 0 has .*resumes after 3 step\(s\) of epoch 1"):
        parallel.fit(x, y, batch_size=8, epochs=3, steps_per_epoch=3, verbose=0,
                     callbacks=[own])  # as a generator's fit asks
    often = Checkpoint(tmp_path / "shared", save_freq=2 + processes.rank())
    with pytest.raises(ValueError, match=r"save_freq=3\) and starts afresh; process 0 has "
                       r"Checkpoint\(.*shared', save_freq=2\)"):
        parallel.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[often])
    alone = [Checkpoint(tmp_path / "alone")] if processes.rank() == 0 else []
    with pytest.raises(ValueError, match=r"process 1 has no Checkpoint; process 0 has "):
        parallel.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=alone)


# -- compile ----------------------------------------------------------------------------------


def test_compile_loss_without_reduction(model):
    parallel = kmg.multi_gpu_model(model, gpus=engine_gpus(2))
    loss = keras.losses.CategoricalCrossentropy(reduction=None)
    with pytest.raises(ValueError, match=r"reduction=None") as info:
        parallel.compile(optimizer="sgd", loss=loss)
    assert type(info.value) is ValueError
    assert "sum_over_batch_size" in str(info.value)


# -- data Keras would refuse, refused early and at the user's level -----------------------


def test_a_generator_yielding_bare_arrays_is_refused_as_keras_does(parallel):
    x, _ = _data(10)

    def inputs_only():
        for start in range(0, 10, 5):
            yield x[start:start + 5]

    with pytest.raises(ValueError, match=r"the generator must return a tuple.*Received: "
                                         r"ndarray of shape \(5, 6\)"):
        parallel.fit(inputs_only(), epochs=1, verbose=0)


@pytest.mark.parametrize("kind", ["generator", "tf.data"])
def test_a_dataset_of_single_samples_says_to_batch_it(parallel, kind):
    """A tf.data dataset or generator of single samples (`.batch()` forgotten): its targets
    are scalars, and reading their rows raised a bare IndexError from inside the library.
    (Keras's own TensorFlow generator adapter names it first, on that backend.)"""
    x, y = _data(10)
    labels = np.argmax(y, axis=1)
    if kind == "tf.data":
        tf = pytest.importorskip("tensorflow")
        data = tf.data.Dataset.from_tensor_slices((x, labels))
    else:
        data = ((x[i], labels[i]) for i in range(10))
    keras_own = "must be at least rank 1. Received: 1 of rank 0"
    ours = (r"holds a scalar.*dataset\.batch\(32\).*Received: a batch of shapes "
            r"\[\(6,\), \(\)\]")
    with pytest.raises(ValueError, match=ours if kind == "tf.data" or
                       keras.backend.backend() != "tensorflow" else keras_own):
        parallel.fit(data, epochs=1, verbose=0)


def test_a_batch_whose_arrays_differ_in_rows_is_named(parallel):
    """x of 10 rows and y of 9 in one batch of a generator: an IndexError from inside the
    library, or on TensorFlow, where the batch is served on tf.data's threads, a graph
    execution error that ended in the library's message."""
    x, y = _data(20)

    def batches():
        yield x[:10], y[:9]
        yield x[10:], y[10:]

    with pytest.raises(ValueError, match=r"A batch's x has 10 rows but its y has 9"):
        parallel.fit(batches(), epochs=1, verbose=0)


def test_fit_without_targets_for_a_compiled_loss_is_refused(parallel, no_training):
    x, _ = _data(10)
    with pytest.raises(ValueError, match=r"fit received inputs but no targets \(y=None\)"):
        parallel.fit(x, epochs=1, verbose=0)


class _OwnStep(keras.Model):
    def train_step(self, data):  # never reached: the batch is refused first
        raise AssertionError("the step ran")


class _StackedPairs(keras.utils.PyDataset):
    """Anchors and positives stacked on the first axis, as keras-io's metric learning
    example feeds its model's own train_step (`data[0]`, `data[1]`)."""

    def __len__(self):
        return 2

    def __getitem__(self, index):
        return np.random.default_rng(index).normal(size=(2, 4, 6)).astype("float32")


def test_x_of_another_feature_count_names_both_shapes(parallel):
    """One line naming the rows' shapes, where Keras wraps its error in the model's call
    (ANSI codes, an "Arguments received" block, a batch's shape for x's)."""
    parallel = parallel.get() if isinstance(parallel, PerProcess) else parallel
    x, y = _data(24, features=5)
    with pytest.raises(ValueError) as raised:
        parallel.fit(x, y, batch_size=6, epochs=1, verbose=0)
    said = str(raised.value)
    assert re.search(r"each row of x has the shape \(5,\), and the model's input takes rows of "
                     r"the shape \(6,\)", said), said
    assert "\x1b" not in said and "Arguments received" not in said


def test_validation_x_of_another_feature_count_is_refused_before_training(parallel):
    """Validation data is fed after an epoch; its rows are checked against the model's
    inputs before the first step, and the weights stay as they were."""
    parallel = parallel.get() if isinstance(parallel, PerProcess) else parallel
    x, y = _data(24)
    before = [np.copy(w) for w in parallel.get_weights()]
    with pytest.raises(ValueError) as raised:
        parallel.fit(x, y, batch_size=6, epochs=1, verbose=0,
                     validation_data=_data(12, features=5))
    said = str(raised.value)
    assert re.search(r"fit's validation_data: x does not fit .* each row of x has the shape "
                     r"\(5,\), and the model's input takes rows of the shape \(6,\)", said), said
    for was, now in zip(before, parallel.get_weights()):
        np.testing.assert_array_equal(was, now)


def test_y_of_another_width_names_both_shapes(parallel):
    """One line naming the rows' shapes, where the framework's error comes from inside the
    loss (JAX's "sub got incompatible shapes", torch's "The size of tensor a")."""
    parallel = parallel.get() if isinstance(parallel, PerProcess) else parallel
    x, y = _data(24)
    with pytest.raises(ValueError, match=r"each row of y has the shape \(5,\), and the model's "
                                         r"output gives rows of the shape \(3,\)"):
        parallel.fit(x, np.concatenate([y, y[:, :2]], axis=1), batch_size=6, epochs=1,
                     verbose=0)
    # Class indices for a sparse loss are y's own business: left to Keras.
    parallel.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    parallel.fit(x, y.argmax(1)[:, None], batch_size=6, epochs=1, verbose=0)


def _two_by_two(cls_loss="binary_crossentropy"):
    tokens, aux = keras.Input((8,), name="tokens"), keras.Input((4,), name="aux")
    joined = keras.layers.Concatenate()([tokens, aux])
    model = keras.Model([tokens, aux], [keras.layers.Dense(4, name="reg")(joined),
                                        keras.layers.Dense(10, name="cls")(joined)])
    parallel = kmg.multi_gpu_model(model, gpus=engine_gpus(2))
    parallel.compile(optimizer="sgd", loss={"reg": "mse", "cls": cls_loss})
    return parallel


def test_dicts_are_matched_by_name_in_the_shapes_named():
    """x and y as dicts, keyed in another order than the model declares them: an array that
    does not fit is named in the model's order; a loss's own shape error, where y fits, is
    left as Keras raised it (not blamed on y)."""
    rng = np.random.default_rng(0)
    y = {"cls": rng.random((12, 10), "float32"), "reg": rng.random((12, 4), "float32")}
    x = {"aux": rng.random((12, 5), "float32"), "tokens": rng.random((12, 8), "float32")}
    with pytest.raises(ValueError, match=r"each row of x has the shape \[\(8,\), \(5,\)\], and "
                                         r"the model's input takes rows of the shape "
                                         r"\[\(8,\), \(4,\)\]"):
        _two_by_two().fit(x, y, batch_size=4, epochs=1, verbose=0)

    def failing(y_true, y_pred):
        raise ValueError("a shape this loss refuses")

    x["aux"] = x["aux"][:, :4]
    with pytest.raises(ValueError, match="a shape this loss refuses") as raised:
        _two_by_two(failing).fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert "does not have the rows" not in str(raised.value)


def test_a_batch_whose_first_axis_is_not_its_samples_is_named():
    inputs = keras.Input((6,))
    parallel = kmg.multi_gpu_model(_OwnStep(inputs, keras.layers.Dense(4)(inputs)),
                                   gpus=engine_gpus(2))
    parallel.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    with pytest.raises(ValueError, match=r"_OwnStep has its own train_step.*x of shape "
                                         r"\(\w+, 4, 6\).*cannot be split"):
        parallel.fit(_StackedPairs(), epochs=1, verbose=0)


@pytest.mark.parametrize("x, dtype", [
    (np.array([["a"] * 6] * 10), "str"),
    (np.array([[1, "b", None, 2, 3, 4]] * 10, dtype=object), "object"),
], ids=["strings", "objects"])
def test_arrays_no_model_can_take_are_refused(parallel, no_training, x, dtype):
    _, y = _data(10)
    with pytest.raises(ValueError, match=rf"Invalid dtype: {dtype}\w* in x .*shape \(10, 6\)"):
        parallel.fit(x, y, epochs=1, verbose=0)


def test_class_weight_as_a_list_is_refused(parallel, no_training):
    x, y = _data(10)
    with pytest.raises(TypeError, match=r"class_weight must be a dict.*Received: class_weight "
                                        r"of type list: \[1.0, 2.0\]"):
        parallel.fit(x, y, class_weight=[1.0, 2.0], epochs=1, verbose=0)


def test_class_weight_naming_no_class_warns(parallel):
    x, y = _data(12)
    with pytest.warns(UserWarning, match=r"class_weight has key\(s\) \[7\] that name no class"):
        parallel.fit(x, y, class_weight={0: 1.0, 1: 1.0, 2: 1.0, 7: 2.0}, batch_size=6,
                     epochs=1, verbose=0)


# -- damaged and unwritable files ---------------------------------------------------------


@pytest.mark.parametrize("name", ["truncated.weights.h5", "junk.weights.h5", "truncated.keras",
                                  "empty.keras"])
def test_a_damaged_weights_file_is_named(parallel, tmp_path, name):
    """Including a whole zip without Keras's weights in it (empty.keras), which failed with
    zipfile's bare KeyError."""
    good = tmp_path / ("good.keras" if name.endswith(".keras") else "good.weights.h5")
    if name.endswith(".keras"):
        parallel.save(good)
    else:
        parallel.save_weights(good)
    damaged = tmp_path / name
    data = good.read_bytes()
    damaged.write_bytes(b"hello" if name.startswith("junk") else data[: len(data) // 2])
    if name == "empty.keras":
        zipfile.ZipFile(damaged, "w").close()
    before = _weights(parallel)
    with pytest.raises(ValueError, match=rf"{damaged}.*cannot be read as a Keras file: it is "
                                         "truncated or damaged"):
        parallel.load_weights(damaged)
    for a, b in zip(before, _weights(parallel)):
        np.testing.assert_array_equal(a, b)


SAVE_WITH_A_FILE_SIZE_LIMIT = r"""
import os, resource, signal, sys
os.environ.setdefault("KERAS_BACKEND", "jax")  # the test's own
import keras, numpy as np
import keras_multigpu as kmg
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(4096)])
parallel = kmg.multi_gpu_model(model, gpus=1)
path = sys.argv[1]
open(path, "wb").write(b"the last good file")
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
try:
    parallel.save(path)
except OSError as error:
    print("ERROR", error)
"""


@pytest.mark.ranks(1)  # a process of its own
def test_a_write_error_names_the_path_and_keeps_the_last_good_file(tmp_path):
    import subprocess
    import sys

    target = tmp_path / "model.keras"
    result = subprocess.run([sys.executable, "-c", SAVE_WITH_A_FILE_SIZE_LIMIT, str(target)],
                            capture_output=True, text=True, timeout=300)
    assert f"ERROR [Errno 27] Cannot write {target}: File too large" in result.stdout, (
        result.stdout + result.stderr[-2000:])
    assert "ulimit -f" in result.stdout
    assert target.read_bytes() == b"the last good file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.keras"]


KILLED_MID_SAVE = r"""
import os, sys, time
os.environ.setdefault("KERAS_BACKEND", "jax")  # the test's own
import keras
import keras_multigpu as kmg
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
parallel = kmg.multi_gpu_model(model, gpus=1)
original = keras.Model.save
def slow_save(self, filepath, *args, **kwargs):
    original(self, filepath, *args, **kwargs)
    print("WRITTEN", flush=True)
    time.sleep(60)  # killed here: the temporary file exists, not yet renamed
keras.Model.save = slow_save
parallel.save(sys.argv[1])
"""


@pytest.mark.ranks(1)  # a process of its own, then this one's save (on one torch process)
def test_a_save_killed_midway_leaves_nothing_after_the_next_save(parallel, tmp_path):
    import signal
    import subprocess
    import sys

    target = tmp_path / "model.keras"
    process = subprocess.Popen([sys.executable, "-c", KILLED_MID_SAVE, str(target)],
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "WRITTEN"
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "model.keras"]
    assert len(leftovers) == 1 and leftovers[0].startswith(".model.keras.tmp-")
    assert not target.exists()
    parallel.save(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.keras"]
    keras.saving.load_model(target)


@pytest.mark.parametrize("kwargs, match", [
    ({"epochs": "2"}, r"epochs must be an int >= 0\. Received: epochs='2' of type str"),
    ({"epochs": -1}, r"epochs must be an int >= 0\. Received: epochs=-1"),
    ({"initial_epoch": 1.5}, r"initial_epoch must be an int >= 0"),
    ({"validation_freq": 0}, r"validation_freq must be an int >= 1"),
    ({"steps_per_epoch": 0}, r"steps_per_epoch must be an int >= 1"),
    ({"callbacks": "early"}, r"callbacks must be a list of keras\.callbacks\.Callback"),
    ({"callbacks": [print]}, r"callbacks must be a list of keras\.callbacks\.Callback"),
    ({"sample_weight": np.ones((10, 5))}, r"sample_weight has shape \(10, 5\), which does not "
                                          r"match y's \(10, 3\)"),
    ({"validation_data": (np.zeros((4, 6), "float32"),)},
     r"fit's validation_data received inputs but no targets"),
    ({"validation_data": (np.zeros((4, 6), "float32"), np.zeros((5, 3), "float32"))},
     r"fit's validation_data: x has 4 rows but y has 5"),
], ids=["epochs-str", "epochs-negative", "initial-epoch-float", "validation-freq-0",
        "steps-0", "callbacks-str", "callbacks-function", "sample-weight-shape",
        "validation-without-targets", "validation-rows"])
def test_bad_fit_arguments_are_refused_before_training(parallel, no_training, kwargs, match):
    x, y = _data(10)
    with pytest.raises((ValueError, TypeError), match=match):
        parallel.fit(x, y, verbose=0, **kwargs)


class _Counted(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.batches = 0

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1

    on_test_batch_end = on_predict_batch_end = on_train_batch_end


def test_one_callback_or_nested_lists_are_taken_as_keras_takes_them(parallel):
    """Keras's CallbackList flattens what it is given: `callbacks=EarlyStopping(...)` alone,
    or lists of lists, work on one device; fit refused them ("callbacks must be a list"),
    and evaluate and predict failed on "object is not iterable"."""
    x, y = _data(10)
    one, first, second = _Counted(), _Counted(), _Counted()
    parallel.fit(x, y, batch_size=5, epochs=1, verbose=0, callbacks=one)
    parallel.fit(x, y, batch_size=5, epochs=1, verbose=0, callbacks=[[first], (second,)])
    parallel.evaluate(x, y, batch_size=5, verbose=0, callbacks=one)
    parallel.predict(x, batch_size=5, verbose=0, callbacks=one)
    assert (one.batches, first.batches, second.batches) == (6, 2, 2)


def test_a_missing_weights_file_is_named(parallel, tmp_path):
    missing = tmp_path / "nowhere.weights.h5"
    with pytest.raises(FileNotFoundError, match=rf"No such weights file: {missing}"):
        parallel.load_weights(missing)


@pytest.mark.parametrize("call", ["fit", "evaluate"])
def test_a_step_that_fails_leaves_the_model_as_it_was(parallel, call):
    """Keras's JAX trainer takes the variables' values out of them for a call's loop and does
    not put them back when a step raises: one batch of targets of another width left every
    variable empty, and each later call failed with "'NoneType' object is not callable"."""
    x, y = _data(20)
    parallel.fit(x, y, batch_size=5, epochs=1, verbose=0)
    weights, steps = _weights(parallel), int(parallel.optimizer.iterations.value)
    wrong = np.ones((20, 4), "float32")  # the model has 3 outputs
    with pytest.raises(Exception):  # noqa: B017 (the backend's own shape error, as on one device)
        getattr(parallel, call)(x, wrong, batch_size=5, verbose=0)
    for before, after in zip(weights, _weights(parallel), strict=True):
        np.testing.assert_array_equal(after, before)
    assert int(parallel.optimizer.iterations.value) == steps
    assert parallel.predict(x, batch_size=5, verbose=0).shape == (20, 3)
    parallel.fit(x, y, batch_size=5, epochs=1, verbose=0)
    assert int(parallel.optimizer.iterations.value) == steps + 4


class _StopsAfterTwoBatches(keras.callbacks.Callback):
    def __init__(self, error):
        super().__init__()
        self.error = error

    def on_test_batch_end(self, batch, logs=None):
        if batch == 1:
            raise self.error

    on_predict_batch_end = on_test_batch_end


@pytest.mark.parametrize("call", ["evaluate", "predict"])
@pytest.mark.parametrize("stop", ["sigterm", "callback"])
def test_a_call_stopped_between_steps_leaves_the_model_as_it_was(parallel, call, stop):
    """Keras's JAX `evaluate` and `predict` take the variables' values out of them for their
    loop, and put them back when it ends, but not when it raises between two steps: a Ctrl-C
    or SIGTERM at the step boundary (`Interrupted`, as `StopOnInterrupt` raises it), or a
    callback that fails. Every variable was left empty, and each later call failed with
    "'NoneType' object is not callable"."""
    x, y = _data(20)
    parallel.fit(x, y, batch_size=5, epochs=1, verbose=0)
    weights, steps = _weights(parallel), int(parallel.optimizer.iterations.value)
    error = (interrupt.Interrupted("Stopped by SIGTERM at a step boundary.", signal.SIGTERM)
             if stop == "sigterm" else RuntimeError("a callback failed"))
    with pytest.raises(type(error)):
        getattr(parallel, call)(*((x,) if call == "predict" else (x, y)), batch_size=5,
                                verbose=0, callbacks=[_StopsAfterTwoBatches(error)])
    for before, after in zip(weights, _weights(parallel), strict=True):
        np.testing.assert_array_equal(after, before)
    assert parallel.predict(x, batch_size=5, verbose=0).shape == (20, 3)
    parallel.fit(x, y, batch_size=5, epochs=1, verbose=0)
    assert int(parallel.optimizer.iterations.value) == steps + 4
