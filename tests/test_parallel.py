"""N devices give one device's results: weights, logs, evaluate and predict, on every
engine (on torch, each test runs in TORCH_WORLD processes; see conftest)."""

import gc
import warnings
import weakref

import keras
import numpy as np
import pytest

import keras_multigpu as kmg
from conftest import (
    TORCH_WORLD,
    assert_weights_close,
    classification_data,
    comparable_keys,
    engine_gpus,
    rotated,
)

pytestmark = pytest.mark.ranks(TORCH_WORLD)
# The device counts of the sweep. torch runs a process per device: its counts above one are
# all TORCH_WORLD processes. TensorFlow traces each replica's step apart (an 8-device case
# takes as long as the 1 to 3 together): it sweeps an even and an odd count.
GPUS = {"torch": [1, TORCH_WORLD], "tensorflow": [1, 2, 3]}.get(keras.backend.backend(),
                                                              [1, 2, 3, 4, 8])


def compile_sgd(model, lr=0.1, **kwargs):
    model.compile(
        optimizer=keras.optimizers.SGD(lr, momentum=0.9),
        loss="categorical_crossentropy",
        metrics=["accuracy"],
        **kwargs,
    )
    return model


def train_both(build, x, y, gpus, batch_size, epochs=2, **fit_kwargs):
    """Trains one reference model on one device and one ParallelModel."""
    reference = compile_sgd(build())
    ref_history = reference.fit(
        x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, **fit_kwargs
    )
    template = build()
    parallel = compile_sgd(kmg.multi_gpu_model(template, gpus=engine_gpus(gpus)))
    history = parallel.fit(
        x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, **fit_kwargs
    )
    return reference, ref_history, template, parallel, history


def assert_history_close(a, b):
    assert a.history.keys() == b.history.keys()
    for key in a.history:
        np.testing.assert_allclose(a.history[key], b.history[key], rtol=1e-5, err_msg=key)


@pytest.mark.parametrize(
    ("gpus", "num_samples", "batch_size"),
    rotated(GPUS, [(100, 30), (64, 16), (10, 3), (7, 16), (33, 8)]),
    ids=lambda v: str(v),
)
def test_training_equals_one_device(dense_model, gpus, num_samples, batch_size):
    x, y = classification_data(num_samples)
    reference, ref_history, template, parallel, history = train_both(
        dense_model, x, y, gpus, batch_size
    )
    assert parallel.num_replicas == engine_gpus(gpus)
    assert_weights_close(reference.get_weights(), template.get_weights())
    assert_history_close(ref_history, history)
    np.testing.assert_allclose(
        reference.evaluate(x, y, batch_size=batch_size, verbose=0),
        parallel.evaluate(x, y, batch_size=batch_size, verbose=0),
        rtol=1e-5,
    )
    expected = reference.predict(x, batch_size=batch_size, verbose=0)
    predicted = parallel.predict(x, batch_size=batch_size, verbose=0)
    assert predicted.shape == (num_samples, 3)
    np.testing.assert_allclose(expected, predicted, atol=1e-6)



def test_steps_per_execution_equals_one_device(dense_model):
    """Keras's steps_per_execution (several steps per train_function call), with a padded
    last batch, still gives one device's results. On TensorFlow, Keras's multi-step loop
    fails under tf.distribute (keras-team/keras#19246): the steps run one per execution,
    with a warning that says so. Keras 3.15's torch trainer refuses it, the next Keras's
    runs it."""
    x, y = classification_data(100)
    reference = compile_sgd(dense_model(), steps_per_execution=3)
    template = dense_model()
    parallel = kmg.multi_gpu_model(template, gpus=engine_gpus(3))
    try:
        ref_history = reference.fit(x, y, batch_size=30, epochs=2, shuffle=False, verbose=0)
    except ValueError as refused:  # Keras 3.15's torch trainer refuses it: so do we
        assert keras.backend.backend() == "torch", refused
        assert "steps_per_execution` must be 1" in str(refused), refused
        with pytest.raises(ValueError, match="steps_per_execution` must be 1"):
            compile_sgd(parallel, steps_per_execution=3).fit(x, y, batch_size=30, epochs=1,
                                                             verbose=0)
        return
    if keras.backend.backend() == "tensorflow":
        with pytest.warns(UserWarning, match=r"steps_per_execution=3 runs as 1 .*#19246"):
            compile_sgd(parallel, steps_per_execution=3)
    else:
        compile_sgd(parallel, steps_per_execution=3)
    history = parallel.fit(x, y, batch_size=30, epochs=2, shuffle=False, verbose=0)
    assert parallel.steps_per_execution == (1 if keras.backend.backend() == "tensorflow" else 3)
    assert_weights_close(reference.get_weights(), template.get_weights())
    assert_history_close(ref_history, history)


@pytest.mark.ranks(1)
def test_steps_per_execution_on_one_device_is_keras_own(dense_model):
    """One device runs as plain Keras, multi-step loop included (on TensorFlow, without a
    strategy): the same weights, no warning, and the batch hooks at the same steps (Keras
    3.15's torch trainer refuses it: so does the wrapper)."""
    x, y = classification_data(100)
    seen = {}

    def hooks(name):
        return keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: seen.setdefault(name, []).append(batch))

    reference = compile_sgd(dense_model(), steps_per_execution=4)
    template = dense_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parallel = compile_sgd(kmg.multi_gpu_model(template, gpus=1), steps_per_execution=4)
    try:
        reference.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0,
                      callbacks=[hooks("one")])
    except ValueError as refused:
        assert keras.backend.backend() == "torch", refused
        with pytest.raises(ValueError, match="steps_per_execution` must be 1"):
            parallel.fit(x, y, batch_size=10, epochs=1, verbose=0)
        return
    parallel.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0,
                 callbacks=[hooks("wrapped")])
    assert parallel.steps_per_execution == 4
    assert seen["wrapped"] == seen["one"], seen
    assert_weights_close(reference.get_weights(), template.get_weights())


@pytest.mark.parametrize("num_samples, batch_size, gpus", [(9, 4, 8), (1, 1, 3)])
def test_padded_batchnorm_steps_stay_finite(conv_bn_model, num_samples, batch_size, gpus):
    """The old multi_gpu_model left GPUs empty and BatchNorm produced NaN."""
    x, y = classification_data(num_samples, features=(8, 8, 3))
    template = conv_bn_model()
    parallel = compile_sgd(kmg.multi_gpu_model(template, gpus=engine_gpus(gpus)))
    history = parallel.fit(x, y, batch_size=batch_size, epochs=3, verbose=0)
    for weight in template.get_weights():
        assert np.all(np.isfinite(weight))
    assert np.all(np.isfinite(history.history["loss"]))
    assert np.all(np.isfinite(parallel.predict(x, verbose=0)))


def _fit_beside_one_device(template, x, y, **fit):
    """A copy of `template` fit on one device, and `template` fit on 3 (on torch, on the
    test's processes); the weights after are equal. Returns (the copy, the wrapper)."""
    reference = keras.models.clone_model(template)
    reference.set_weights(template.get_weights())
    compile_sgd(reference).fit(x, y, shuffle=False, verbose=0, **fit)
    parallel = compile_sgd(kmg.multi_gpu_model(template, gpus=engine_gpus(3)))
    parallel.fit(x, y, shuffle=False, verbose=0, **fit)
    assert_weights_close(reference.get_weights(), template.get_weights())
    return reference, parallel


def test_every_convolution_and_pooling_kind_trains_with_a_device_left_empty():
    """A replica dealt no rows convolves and pools zero rows. TensorFlow's CPU convolution
    (oneDNN, AVX-512) gave them its input's shape, and the next layer failed; its max
    pooling's gradient aborted the process ("Check failed" in MklMaxPoolingGradOp)."""
    keras.utils.set_random_seed(0)
    x, y = classification_data(2, features=(8, 8, 3))
    template = keras.Sequential([
        keras.Input((8, 8, 3)),
        keras.layers.Conv2D(4, 3, padding="same"),
        keras.layers.DepthwiseConv2D(3, depth_multiplier=2, padding="same"),
        keras.layers.SeparableConv2D(5, 3, padding="same"),
        keras.layers.MaxPooling2D(1),
        keras.layers.AveragePooling2D(1),
        keras.layers.Reshape((64, 5)),
        keras.layers.Conv1D(3, 3),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(3, activation="softmax"),
    ])
    _, parallel = _fit_beside_one_device(template, x, y, batch_size=2, epochs=1)
    assert parallel.predict(x, verbose=0).shape == (2, 3)


class _RowsOfFour(keras.layers.Layer):
    def call(self, t):
        return keras.ops.reshape(t, (keras.ops.shape(t)[0], -1, 4))


def test_transposed_convolutions_reshapes_and_time_distributed_with_a_device_left_empty():
    """TensorFlow, a replica dealt no rows: a strided Conv2DTranspose's gradient (oneDNN's
    convolution) gave the layer before it its input's shape ("ReluGrad ... [0,16,16,4] !=
    [0,8,8,4]"), and TimeDistributed over a time axis of unknown length (TensorFlow's
    vectorized_map) failed ("Tried to stack elements of an empty list"); torch could not
    size the -1 of `ops.reshape(t, (rows, -1, 4))` on no rows. 13 rows in batches of 4 on 3
    devices: the last batch leaves two replicas empty (a probe's U-Net, ViT and
    character-level LSTM, adapted from keras.io)."""
    keras.utils.set_random_seed(0)
    x, y = classification_data(13, features=(8, 8, 2))
    template = keras.Sequential([
        keras.Input((8, 8, 2)),
        keras.layers.Conv2D(4, 3, padding="same", activation="relu"),
        keras.layers.Conv2DTranspose(4, 3, strides=2, padding="same"),
        _RowsOfFour(),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(3, activation="softmax"),
    ])
    _fit_beside_one_device(template, x, y, batch_size=4, epochs=1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(13, 6, 3)).astype("float32")
    y = keras.utils.to_categorical(rng.integers(0, 3, (13, 6)), 3)
    template = keras.Sequential([
        keras.Input((None, 3)),
        keras.layers.LSTM(4, return_sequences=True),
        keras.layers.TimeDistributed(keras.layers.Dense(3, activation="softmax")),
    ])
    reference, parallel = _fit_beside_one_device(template, x, y, batch_size=4, epochs=1)
    for length in (4, 5):  # one row: two replicas empty, at two lengths (a trace each)
        np.testing.assert_allclose(parallel.predict(x[:1, :length], verbose=0),
                                   reference.predict(x[:1, :length], verbose=0), atol=1e-6)


def test_a_convolution_evaluates_and_predicts_with_a_device_left_empty():
    """As above, in steps without gradients: there TensorFlow's graph optimizer took the
    guard's one padded row away again (`conv(pad(x))[:0]` became `conv(x)`), and the
    convolution's bias failed on the misshaped output (9 rows in batches of 8 on 3 devices:
    the last batch leaves two empty)."""
    keras.utils.set_random_seed(0)
    x, y = classification_data(9, features=(8, 8, 3))
    template = keras.Sequential([
        keras.Input((8, 8, 3)),
        keras.layers.Conv2D(4, 3, activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(3, activation="softmax"),
    ])
    reference = compile_sgd(keras.models.clone_model(template))
    reference.set_weights(template.get_weights())
    parallel = compile_sgd(kmg.multi_gpu_model(template, gpus=engine_gpus(3)))
    np.testing.assert_allclose(parallel.evaluate(x, y, batch_size=8, verbose=0),
                               reference.evaluate(x, y, batch_size=8, verbose=0), rtol=1e-5)
    np.testing.assert_allclose(parallel.predict(x, batch_size=8, verbose=0),
                               reference.predict(x, batch_size=8, verbose=0), atol=1e-6)


class _MinusRowMin(keras.layers.Layer):
    def call(self, h):
        return h - keras.ops.min(h, axis=-1, keepdims=True)


def test_augmentation_and_global_max_pooling_train_with_a_device_left_empty():
    """Keras's torch `max` and `min` refuse any tensor with an empty dimension, so a
    process dealt no rows failed in GlobalMaxPooling2D ("Cannot compute the max of an empty
    tensor"), though the reduction is over the other axes; its `affine_transform` (RandomZoom,
    RandomRotation) stacks images one by one, and failed on none (3 rows in batches of 2:
    the last batch leaves a device empty on 2 devices or 3). JAX pads every device's share,
    so none is empty there, and compiling the rotation costs 13 s: it runs elsewhere."""
    keras.utils.set_random_seed(0)
    x, y = classification_data(3, features=(6, 6, 3))
    rotation = [] if keras.backend.backend() == "jax" else [
        keras.layers.RandomRotation(0.1, seed=2)]
    template = keras.Sequential([
        keras.Input((6, 6, 3)),
        *rotation,
        keras.layers.Conv2D(4, 3, activation="relu"),
        keras.layers.GlobalMaxPooling2D(),
        _MinusRowMin(),
        keras.layers.Dense(3, activation="softmax"),
    ])
    reference, parallel = _fit_beside_one_device(template, x, y, batch_size=2, epochs=2)
    np.testing.assert_allclose(parallel.predict(x, batch_size=2, verbose=0),
                               reference.predict(x, batch_size=2, verbose=0), atol=1e-6)


class RowMaxPenalty(keras.Model):
    """A loss with a term over the batch's rows: a replica dealt none reduces an empty
    tensor."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training=training)
        return loss + 0.1 * keras.ops.max(keras.ops.abs(y_pred))


def test_a_reduction_over_the_rows_on_a_device_left_empty_is_its_identity():
    """Keras's torch `max` refused a process dealt no rows ("Cannot compute the max of an
    empty tensor") where the step reduces over the rows. It is the reduction's identity
    there, as TensorFlow's is, which the rules weigh by no rows: a batch of one row leaves
    every device but one empty, and that one's step is one device's."""

    def build():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((6,))
        outputs = keras.layers.Dense(3, activation="softmax")(keras.layers.Dense(4)(inputs))
        return compile_sgd(RowMaxPenalty(inputs, outputs))

    x, y = classification_data(3)
    reference = build()
    parallel = compile_sgd(kmg.multi_gpu_model(build(), gpus=engine_gpus(3)))
    histories = [model.fit(x, y, batch_size=1, epochs=2, shuffle=False, verbose=0).history
                 for model in (reference, parallel)]
    assert_weights_close(reference.get_weights(), parallel.get_weights())
    np.testing.assert_allclose(histories[1]["loss"], histories[0]["loss"], rtol=1e-5)
    np.testing.assert_allclose(parallel.evaluate(x, y, batch_size=1, verbose=0),
                               reference.evaluate(x, y, batch_size=1, verbose=0), rtol=1e-5)


def test_template_is_the_trained_model(dense_model):
    x, y = classification_data(40)
    template = dense_model()
    before = template.predict(x, verbose=0)
    parallel = compile_sgd(kmg.multi_gpu_model(template, gpus=engine_gpus(4)))
    parallel.fit(x, y, batch_size=8, epochs=2, verbose=0)
    after = template.predict(x, verbose=0)
    assert not np.allclose(before, after)
    np.testing.assert_allclose(after, parallel.predict(x, verbose=0), atol=1e-6)


def test_no_distribution_left_behind(dense_model):
    x, y = classification_data(40)
    parallel = compile_sgd(kmg.multi_gpu_model(dense_model(), gpus=engine_gpus(4)))
    parallel.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert keras.distribution.distribution() is None
    # A plain model trained next to it behaves as if the library were absent.
    plain, other = compile_sgd(dense_model(seed=1)), compile_sgd(dense_model(seed=1))
    plain.fit(x, y, batch_size=7, epochs=1, shuffle=False, verbose=0)
    parallel.fit(x, y, batch_size=8, epochs=1, verbose=0)
    other.fit(x, y, batch_size=7, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(plain.get_weights(), other.get_weights(), atol=0)


def test_a_model_the_user_drops_is_freed(dense_model):
    """A wrapped model that fit (with validation), evaluate and predict have used is freed
    once the user drops it, as a Keras model is: a process that wraps model after model (a
    hyperparameter search) would otherwise keep each one, and its device memory. On
    TensorFlow, the pipeline's tf.numpy_function held the model for the whole process."""
    x, y = classification_data(30)

    def used():
        template = dense_model()
        parallel = compile_sgd(kmg.multi_gpu_model(template, gpus=engine_gpus(2)))
        parallel.fit(x, y, batch_size=8, epochs=1, validation_data=(x, y), verbose=0)
        parallel.evaluate(x, y, batch_size=8, verbose=0)
        parallel.predict(x, batch_size=8, verbose=0)
        return weakref.ref(template), weakref.ref(parallel)

    template, parallel = used()
    gc.collect()
    assert (template(), parallel()) == (None, None)


def test_sample_and_class_weights_equal_one_device(dense_model):
    x, y = classification_data(50)
    weights = np.random.default_rng(1).uniform(0.1, 2.0, size=50).astype("float32")
    for kwargs in ({"sample_weight": weights}, {"class_weight": {0: 0.5, 1: 2.0, 2: 1.0}}):
        reference, ref_history, template, _, history = train_both(
            dense_model, x, y, gpus=3, batch_size=16, **kwargs
        )
        assert_weights_close(reference.get_weights(), template.get_weights())
        assert_history_close(ref_history, history)


def test_weighted_metrics_equal_one_device(dense_model):
    x, y = classification_data(45)
    weights = np.random.default_rng(2).uniform(0.1, 2.0, size=45).astype("float32")

    def compile_weighted(model):
        model.compile(
            optimizer="sgd",
            loss="categorical_crossentropy",
            metrics=["accuracy"],
            weighted_metrics=["categorical_accuracy", keras.metrics.AUC(name="auc")],
        )
        return model

    reference = compile_weighted(dense_model())
    expected = reference.fit(
        x, y, sample_weight=weights, batch_size=10, epochs=2, shuffle=False, verbose=0
    )
    parallel = compile_weighted(kmg.multi_gpu_model(dense_model(), gpus=engine_gpus(4)))
    history = parallel.fit(
        x, y, sample_weight=weights, batch_size=10, epochs=2, shuffle=False, verbose=0
    )
    assert_history_close(expected, history)


def test_validation_split_equals_one_device(dense_model):
    x, y = classification_data(60)
    _, ref_history, _, _, history = train_both(
        dense_model, x, y, gpus=4, batch_size=9, validation_split=0.25
    )
    assert "val_loss" in history.history
    assert_history_close(ref_history, history)


def test_drop_remainder_skips_the_partial_batch(dense_model):
    x, y = classification_data(50)
    parallel = compile_sgd(kmg.multi_gpu_model(dense_model(), gpus=engine_gpus(4)))
    counter = keras.callbacks.LambdaCallback()
    steps = []
    counter.on_train_batch_end = lambda batch, logs=None: steps.append(batch)
    parallel.fit(x, y, batch_size=16, epochs=1, drop_remainder=True, verbose=0, callbacks=[counter])
    assert len(steps) == 3  # 50 // 16; the 2 leftover samples are dropped.


@pytest.mark.skipif(keras.backend.backend() == "torch",
                    reason="Keras's torch trainer runs its steps eagerly: nothing is traced")
def test_one_compiled_step_per_shape(dense_model, monkeypatch):
    """Tracing happens once per batch shape, not once per epoch."""
    traces = []
    original = keras.Model.compute_loss

    def counting(self, *args, **kwargs):
        traces.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(keras.Model, "compute_loss", counting)
    x, y = classification_data(50)
    parallel = compile_sgd(kmg.multi_gpu_model(dense_model(), gpus=engine_gpus(4)))
    parallel.fit(x, y, batch_size=16, epochs=1, verbose=0)
    after_one_epoch = len(traces)
    assert after_one_epoch > 0
    # Epoch 1 saw both shapes (16 rows, and the last 2 padded to 4): later
    # epochs and later fit calls reuse the compiled steps.
    parallel.fit(x, y, batch_size=16, epochs=4, verbose=0)
    assert len(traces) == after_one_epoch


def test_multi_input_multi_output_equals_one_device():
    def build():
        keras.utils.set_random_seed(0)
        a = keras.Input((4,), name="a")
        b = keras.Input((3,), name="b")
        h = keras.layers.Dense(8, activation="relu")(keras.layers.Concatenate()([a, b]))
        out_class = keras.layers.Dense(3, activation="softmax", name="cls")(h)
        out_reg = keras.layers.Dense(1, name="reg")(h)
        model = keras.Model({"a": a, "b": b}, {"cls": out_class, "reg": out_reg})
        return model

    def compile_two(model):
        model.compile(
            optimizer="sgd",
            loss={"cls": "categorical_crossentropy", "reg": "mse"},
            loss_weights={"cls": 1.0, "reg": 0.5},
            metrics={"cls": ["accuracy"], "reg": ["mae"]},
        )
        return model

    rng = np.random.default_rng(0)
    n = 37
    x = {"a": rng.normal(size=(n, 4)).astype("float32"),
         "b": rng.normal(size=(n, 3)).astype("float32")}
    y = {"cls": keras.utils.to_categorical(rng.integers(0, 3, n), 3),
         "reg": rng.normal(size=(n, 1)).astype("float32")}
    reference = compile_two(build())
    expected = reference.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    template = build()
    parallel = compile_two(kmg.multi_gpu_model(template, gpus=engine_gpus(3)))
    history = parallel.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(reference.get_weights(), template.get_weights())
    assert {"cls_loss", "reg_loss"} <= set(history.history)
    for key in comparable_keys(history.history, reference):
        np.testing.assert_allclose(expected.history[key], history.history[key], rtol=1e-5)
    predicted = parallel.predict(x, batch_size=10, verbose=0)
    np.testing.assert_allclose(predicted["reg"], reference.predict(x, verbose=0)["reg"], atol=1e-5)
    assert predicted["cls"].shape == (n, 3)


class Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(3, activation="softmax")

    def call(self, inputs):
        return self.out(self.hidden(inputs))


def test_unbuilt_subclassed_model_is_built_on_first_fit():
    keras.utils.set_random_seed(0)
    template = Subclassed()
    x, y = classification_data(20)
    parallel = compile_sgd(kmg.multi_gpu_model(template, gpus=engine_gpus(2)))
    parallel.fit(x, y, batch_size=5, epochs=1, verbose=0)
    assert template.built
    assert parallel.predict(x, verbose=0).shape == (20, 3)


@pytest.mark.ranks(1)
def test_one_device_and_zero_give_a_parallel_model(dense_model):
    last = kmg.list_devices()[-1].id  # 7 of JAX's and TensorFlow's 8; torch's one, 0
    for gpus in (0, 1, [last]):
        parallel = kmg.multi_gpu_model(dense_model(), gpus=gpus)
        assert isinstance(parallel, kmg.ParallelModel)
        assert parallel.num_replicas == 1
    assert kmg.multi_gpu_model(dense_model(), gpus=[last]).devices[0].id == last


def test_tf_keras_callers_run_unchanged(dense_model):
    """`tf.keras.utils.multi_gpu_model(model, gpus, cpu_merge, cpu_relocation)`: code written
    for it (its docs' saving example passes `cpu_relocation=True`) trains as it is."""
    x, y = classification_data(10)
    reference = compile_sgd(dense_model())
    ref_history = reference.fit(x, y, batch_size=3, epochs=2, shuffle=False, verbose=0)
    old = compile_sgd(kmg.multi_gpu_model(dense_model(), gpus=engine_gpus(2), cpu_merge=False,
                                          cpu_relocation=True))
    old_history = old.fit(x, y, batch_size=3, epochs=2, shuffle=False, verbose=0)
    assert_history_close(ref_history, old_history)
    assert_weights_close(reference.get_weights(), old.get_weights())


def test_model_like_surface(dense_model):
    template = dense_model()
    parallel = kmg.multi_gpu_model(template, gpus=engine_gpus(2))
    assert parallel.template is template
    assert parallel.layers == template.layers
    assert parallel.inputs == template.inputs and parallel.outputs == template.outputs
    assert [w.path for w in parallel.weights] == [w.path for w in template.weights]
    weights = [w + 1.0 for w in parallel.get_weights()]
    parallel.set_weights(weights)
    assert_weights_close(template.get_weights(), weights, atol=0)
    parallel.summary(print_fn=lambda *args, **kwargs: None)


def test_on_batch_methods_equal_one_device(dense_model):
    x, y = classification_data(7)
    reference = compile_sgd(dense_model())
    template = dense_model()
    parallel = compile_sgd(kmg.multi_gpu_model(template, gpus=engine_gpus(4)))
    np.testing.assert_allclose(
        reference.train_on_batch(x, y), parallel.train_on_batch(x, y), rtol=1e-5
    )
    assert_weights_close(reference.get_weights(), template.get_weights())
    np.testing.assert_allclose(
        reference.test_on_batch(x, y), parallel.test_on_batch(x, y), rtol=1e-5
    )
    np.testing.assert_allclose(
        reference.predict_on_batch(x), parallel.predict_on_batch(x), atol=1e-6
    )


@pytest.mark.parametrize("rows", [8, 7], ids=["even", "padded"])
def test_train_on_batch_draws_what_one_device_draws(rows):
    """Dropout in `train_on_batch`, with a batch that divides the devices and one that
    does not: the same masks, so the same weights, as one device."""
    x, y = classification_data(rows)

    def build():
        keras.utils.set_random_seed(0)
        return compile_sgd(keras.Sequential([keras.Input((6,)), keras.layers.Dense(8),
                                             keras.layers.Dropout(0.5),
                                             keras.layers.Dense(3, activation="softmax")]))

    reference = build()
    keras.utils.set_random_seed(5)
    expected = reference.train_on_batch(x, y)
    template = build()
    parallel = compile_sgd(kmg.multi_gpu_model(template, gpus=engine_gpus(4)))
    keras.utils.set_random_seed(5)
    np.testing.assert_allclose(parallel.train_on_batch(x, y), expected, rtol=1e-5)
    assert_weights_close(reference.get_weights(), template.get_weights())
