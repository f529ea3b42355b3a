"""The engine contract, on whichever backend this pytest process runs (KERAS_BACKEND).

`scripts/test.sh` runs this file once per engine, each in its own process: the JAX suite
collects it with everything else, and a TensorFlow process runs it again. Every test
compares a `ParallelModel` with plain Keras on one device, on the same backend.
"""

import json
import os
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest

import keras_multigpu as kmg
from conftest import engine_gpus, rotated
from keras_multigpu import backends

pytestmark = pytest.mark.slow  # several processes or whole runs: not in the fast loop

BACKEND = keras.backend.backend()
RTOL, ATOL = 1e-5, 1e-6


def _bn_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.BatchNormalization(),
        keras.layers.Dense(3, activation="softmax"),
    ])


def _dense_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(3, activation="softmax"),
    ])


def _data(rows=99, seed=0):
    rng = np.random.RandomState(seed)
    return rng.randn(rows, 6).astype("float32"), rng.randint(0, 3, rows)


def _compile(model):
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])


def _train(gpus, rows, batch_size, epochs=2, build=_bn_model, compile=_compile, data=None,
           **fit):
    model = build()
    target = model if gpus is None else kmg.multi_gpu_model(model, gpus=gpus)
    compile(target)
    x, y = _data(rows) if data is None else data
    fit.setdefault("shuffle", False)
    history = target.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0, **fit)
    return model, target, history.history


def _assert_same(reference, run):
    (ref_model, _, ref_history), (model, _, history) = reference, run
    assert history.keys() == ref_history.keys()
    for key in ref_history:
        np.testing.assert_allclose(history[key], ref_history[key], rtol=RTOL, atol=ATOL,
                                   err_msg=key)
    for a, b in zip(ref_model.get_weights(), model.get_weights()):
        np.testing.assert_allclose(b, a, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(("gpus", "rows", "batch_size"),
                         rotated([1, 2, 3, 4], [(99, 25), (10, 3), (5, 32)]))
def test_bn_model_equals_one_device(gpus, rows, batch_size):
    """Uneven and tiny batches (fewer rows than devices), BatchNorm's statistics included."""
    _assert_same(_train(None, rows, batch_size), _train(gpus, rows, batch_size))


@keras.ops.custom_gradient
def _clipped_on_the_way_back(x):
    def grad(*args, upstream=None):
        if upstream is None:
            (upstream,) = args
        return keras.ops.clip(upstream, -0.005, 0.005)

    return x, grad


class _ClipGradient(keras.layers.Layer):
    """The identity, whose gradient is clipped as it flows back (`keras.ops.custom_gradient`
    as its documentation shows it)."""

    def call(self, x):
        return _clipped_on_the_way_back(x)


def _clipping_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(8),
        _ClipGradient(),
        keras.layers.BatchNormalization(),
        keras.layers.Dense(3, activation="softmax"),
    ])


@pytest.mark.parametrize("gpus", [3])
def test_a_gradient_the_model_clips_on_its_way_back_equals_one_device(gpus):
    """Keras's own step weighs each replica's loss before its backward pass
    (`Optimizer.scale_loss`), so that a gradient the model clips as it flows meets one
    device's values: weighed after the pass, a replica of k rows in n clipped n / k times
    one device's gradient (weights 0.0037 apart from one device's on TensorFlow, 0.0031 on torch).
    10 rows in batches of 4 leave a replica of the last batch without rows."""
    _assert_same(_train(None, 10, 4, build=_clipping_model),
                 _train(gpus, 10, 4, build=_clipping_model))


@pytest.mark.parametrize(("gpus", "reduction"),
                         rotated([2, 3], [("mean_with_sample_weight",), ("sum",)], per_case=1))
def test_weighted_losses_with_a_device_left_without_rows(gpus, reduction):
    """10 rows in batches of 3: the last batch (1 row) leaves devices with none, and the
    loss's own divisor (the sum of the sample weights) is the global batch's.

    The model has no BatchNorm: a summed loss through BatchNorm over batches of 3 and 1 rows
    amplifies rounding past the tolerance on one device alone (on torch, the same rows
    reordered within each batch moved a weight by 2.2 times the tolerance on this project's
    Xeon CI machine; Keras's torch loss path keeps float32 rounding in float64 too).
    BatchNorm with such batches is `test_bn_model_equals_one_device`'s."""
    weights = np.random.RandomState(1).uniform(0.5, 2.0, 10).astype("float32")

    def compile(target):
        target.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.
                       SparseCategoricalCrossentropy(reduction=reduction))

    _assert_same(_train(None, 10, 3, build=_dense_model, compile=compile,
                        sample_weight=weights),
                 _train(gpus, 10, 3, build=_dense_model, compile=compile,
                        sample_weight=weights))


@pytest.mark.parametrize(("gpus", "shuffle"), rotated([2, 3], [(True,), ("batch",)], per_case=1))
def test_shuffled_as_this_backends_keras_shuffles(gpus, shuffle):
    """Keras shuffles arrays with NumPy on JAX and with tf.random in tf.data on TensorFlow:
    either way, the same rows meet in the same batches as on one device."""
    _assert_same(_train(None, 99, 25, epochs=3, shuffle=shuffle),
                 _train(gpus, 99, 25, epochs=3, shuffle=shuffle))


def _lazy_bn_model(seed=0):
    """As `_bn_model`, built by its first batch (Keras reads one before the first epoch)."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.BatchNormalization(),
        keras.layers.Dense(3, activation="softmax"),
    ])


@pytest.mark.parametrize("gpus", [3])
@pytest.mark.parametrize("shuffle", [True, "batch"])
def test_a_model_built_by_its_first_batch_is_shuffled_as_on_one_device(gpus, shuffle):
    """Keras reads a batch to build the model before the first epoch (a pass of its own):
    with shuffle="batch", each batch's draw comes as it is read, so the reads must be Keras's
    (103 rows in batches of 25)."""
    _assert_same(_train(None, 103, 25, epochs=3, shuffle=shuffle, build=_lazy_bn_model),
                 _train(gpus, 103, 25, epochs=3, shuffle=shuffle, build=_lazy_bn_model))


@pytest.mark.parametrize("gpus", [3])
@pytest.mark.parametrize("build", [_bn_model, _lazy_bn_model], ids=["built", "lazy"])
def test_a_tf_data_dataset_that_reshuffles_each_epoch_is_read_in_one_devices_order(gpus, build):
    """A user's `dataset.shuffle(n, seed=s)` (or `timeseries_dataset_from_array(shuffle=True)`)
    draws a new order each time an iterator is made: making one more iterator than Keras
    does, even to read the batch's spec, trains every epoch in the next epoch's order (on
    TensorFlow, 99 rows in batches of 25 moved weights by 1e-2)."""
    tf = pytest.importorskip("tensorflow")
    x, y = _data(99)

    def run(gpus):
        model = build()
        target = model if gpus is None else kmg.multi_gpu_model(model, gpus=gpus)
        _compile(target)
        keras.utils.set_random_seed(1)
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(99, seed=5).batch(25)
        history = target.fit(dataset, epochs=3, verbose=0, validation_data=dataset)
        return model, target, history.history

    _assert_same(run(None), run(gpus))


def _named_inputs_model(seed=0):
    keras.utils.set_random_seed(seed)
    features, extra = keras.Input((6,), name="features"), keras.Input((2,), name="extra")
    hidden = keras.layers.Dense(8, activation="tanh")(
        keras.layers.Concatenate()([features, extra]))
    return keras.Model({"features": features, "extra": extra},
                       keras.layers.Dense(3, activation="softmax")(hidden))


@pytest.mark.parametrize("gpus", [3])
def test_a_tf_data_dataset_of_named_inputs_equals_one_device(gpus):
    """Keras's structured-data examples: `from_tensor_slices(({"features": ..., ...}, y))`.
    tf.data hands a map each part of a tuple element whole, a dict too; the TensorFlow
    engine's map took the dict for one tensor and failed ("<NOT CONVERTIBLE TO TENSOR>")."""
    tf = pytest.importorskip("tensorflow")
    x, y = _data(47)
    inputs = {"features": x, "extra": x[:, :2] ** 2}

    def run(gpus):
        model = _named_inputs_model()
        target = model if gpus is None else kmg.multi_gpu_model(model, gpus=gpus)
        _compile(target)
        dataset = tf.data.Dataset.from_tensor_slices((inputs, y)).batch(10)
        history = target.fit(dataset, epochs=2, verbose=0, validation_data=dataset)
        return model, target, history.history

    _assert_same(run(None), run(gpus))


@pytest.mark.parametrize("gpus", [2])
def test_batch_shuffles_with_validation_and_random_layers_as_on_one_device(gpus):
    """shuffle="batch" draws each batch's order as the batch is read, between steps that draw
    too (Dropout, noise): drawn all at a pass's start, the orders were another run's (torch
    differed from one device by 0.05 in accuracy)."""
    _assert_same(_train(None, 103, 25, epochs=3, shuffle="batch", build=_random_model,
                        validation_split=0.2),
                 _train(gpus, 103, 25, epochs=3, shuffle="batch", build=_random_model,
                        validation_split=0.2))


class _Noise(keras.layers.Layer):
    """A VAE-style draw: `keras.random.normal` of the batch's shape, from the layer's own seed."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed = keras.random.SeedGenerator(7)

    def call(self, x, training=False):
        if not training:
            return x
        return x + 0.1 * keras.random.normal(keras.ops.shape(x), seed=self.seed)


class _PairNoise(keras.layers.Layer):
    """A GAN's label noise: a draw for twice the batch's rows (real and generated rows
    concatenated), from the layer's own seed."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed = keras.random.SeedGenerator(11)

    def call(self, x, training=False):
        if not training:
            return x
        rows = keras.ops.shape(x)[0]
        pair = keras.ops.concatenate([x, 2 * x], axis=0)
        pair = pair + 0.1 * keras.random.uniform(keras.ops.shape(pair), seed=self.seed)
        return pair[:rows] + pair[rows:]


def _random_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dropout(0.3),
        _Noise(),
        _PairNoise(),
        keras.layers.GaussianNoise(0.1),
        keras.layers.Reshape((4, 4)),
        keras.layers.Conv1D(4, 3, strides=2, padding="same"),  # on torch a permuted view
        keras.layers.Dropout(0.2),
        keras.layers.SpatialDropout1D(0.25),
        keras.layers.Flatten(),
        keras.layers.Dense(3, activation="softmax"),
    ])


@pytest.mark.parametrize(("gpus", "rows", "batch_size"),
                         rotated([2, 3, 4], [(99, 25), (5, 32), (96, 24)], per_case=2))
def test_random_layers_draw_what_one_device_draws(gpus, rows, batch_size):
    """Dropout, SpatialDropout, GaussianNoise, an own `keras.random.normal` and a draw for
    twice the rows: each row gets the numbers it gets on one device, whichever device it
    lands on. On torch a strided Conv1D's output is a permuted view, whose dropout mask
    torch draws in its memory order (each row's was another's: weights 5e-3 apart in a
    Conv1D autoencoder, 47 rows in batches of 10 on 3 devices). Batches that every count
    splits evenly (96, 24) go unpadded; the next Keras's TensorFlow trainer traces its
    first step with their rows fixed, and a draw of that many rows was taken for a
    fixed-shape one (each replica drew the first rows' numbers)."""
    runs = [_train(count, rows, batch_size, build=_random_model, shuffle=True)
            for count in (None, gpus)]
    _assert_same(*runs)


@pytest.mark.skipif(BACKEND == "torch", reason="torch's jit_compile is torch.compile, which "
                    "draws torch's numbers as eager steps do: no XLA draws to match")
@pytest.mark.parametrize("gpus", [1, 3])
def test_a_model_compiled_for_xla_draws_what_one_device_draws(gpus):
    """`jit_compile=True` (Keras's choice for "auto" on a machine with a GPU): one device
    runs its step as one XLA program, whose draws are not TensorFlow's kernels' from the
    same seed. TensorFlow's replica steps run without XLA, and make each draw with XLA
    (they drew the kernels' numbers: weights 0.24 from one device's, 29 rows in batches of
    10 on 3 devices); one device without a strategy compiles as asked."""
    rng = np.random.default_rng(9)
    data = (rng.uniform(size=(29, 6)).astype("float32"), rng.integers(0, 3, 29))

    def build():
        keras.utils.set_random_seed(0)
        return keras.Sequential([
            keras.Input((6,)), keras.layers.GaussianNoise(0.1, seed=4),
            keras.layers.Dense(8, activation="relu"), keras.layers.Dropout(0.3, seed=5),
            keras.layers.Reshape((2, 4, 1)), keras.layers.RandomFlip(seed=2),
            keras.layers.Flatten(), keras.layers.Dense(3, activation="softmax")])

    def compile(model):
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss="sparse_categorical_crossentropy", jit_compile=True)

    runs = [_train(count, 29, 10, build=build, compile=compile, data=data, shuffle=True)
            for count in (None, gpus)]
    assert runs[0][0].jit_compile
    _assert_same(*runs)


class _RowScale(keras.layers.Layer):
    """A user's layer that drops and scales whole rows with Keras's binomial, gamma and
    beta draws, shaped by the batch's rows."""

    def __init__(self):
        super().__init__()
        self.seed_generator = keras.random.SeedGenerator(11)

    def call(self, x, training=False):
        if not training:
            return x
        shape = (keras.ops.shape(x)[0], 1)
        keep = keras.random.binomial(shape, 1, 0.7, seed=self.seed_generator)
        scale = keras.random.gamma(shape, 2.0, seed=self.seed_generator) / 2.0
        picked = keras.random.categorical(x, 1, seed=self.seed_generator)  # a feature per row
        chosen = keras.ops.one_hot(keras.ops.squeeze(picked, -1), keras.ops.shape(x)[-1])
        scale = scale * keras.random.beta(shape, 2.0, 2.0, seed=self.seed_generator)
        return x * keep * scale + keras.ops.stop_gradient(chosen)


@pytest.mark.parametrize("gpus", [3])
def test_binomial_gamma_beta_and_categorical_draws_equal_one_device(gpus):
    """Drawn for the batch and sliced, as normal draws are; a categorical draw from the
    gathered batch's logits (each replica drew the first rows' numbers: weights 0.14 from
    one device's on TensorFlow, 0.18 on torch, 29 rows in batches of 10 on 3 devices)."""
    rng = np.random.default_rng(11)
    data = (rng.normal(size=(29, 6)).astype("float32"), rng.integers(0, 3, 29))

    def build():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                                 _RowScale(), keras.layers.Dense(3, activation="softmax")])

    runs = [_train(count, 29, 10, build=build, data=data) for count in (None, gpus)]
    _assert_same(*runs)


class _FeatureGain(keras.layers.Layer):
    """A gain per feature, drawn each step (a probe's augmentation): a draw of 6 values, no
    batch's, on replicas of 4, 3 and 3 rows (batches of 10 on 3 devices)."""

    def __init__(self):
        super().__init__()
        self.seed_generator = keras.random.SeedGenerator(5)

    def call(self, x, training=False):
        if not training:
            return x
        gain = keras.random.uniform((keras.ops.shape(x)[-1],), 0.8, 1.2,
                                    seed=self.seed_generator)
        return x * gain


@pytest.mark.parametrize("gpus", [3])
def test_a_draw_per_feature_a_multiple_of_some_replicas_rows_equals_one_device(gpus):
    """On torch the replicas of 3 rows took the 6 features' draw for two blocks of their
    rows, and drew other gains than one device: weights 0.08 apart. Each batch here splits
    unevenly, where the replicas compare their draws' shapes."""
    rng = np.random.default_rng(12)
    data = (rng.normal(size=(30, 6)).astype("float32"), rng.integers(0, 3, 30))

    def build():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((6,)), _FeatureGain(),
                                 keras.layers.Dense(3, activation="softmax")])

    runs = [_train(count, 30, 10, build=build, data=data) for count in (None, gpus)]
    _assert_same(*runs)


@kmg.mixes_rows
class _MinibatchStd(keras.layers.Layer):
    """A user's layer over the batch (a GAN discriminator's minibatch standard deviation),
    marked with `mixes_rows`."""

    def call(self, x):
        std = keras.ops.mean(keras.ops.std(x, axis=0))
        return keras.ops.concatenate([x, keras.ops.ones_like(x[:, :1]) * std], axis=-1)


def _mixing_model():
    """Layers whose rows depend on the whole batch (`rules_mixing.mixing_layers`, and a
    user's layer marked with `mixes_rows`), after a trainable convolution, whose gradient
    crosses replicas through them."""
    # RandomElasticTransform runs on torch only. Keras's own fails in a JAX step, on one
    # device too ("'str' object has no attribute '_error_repr'", Keras 3.15.1). On
    # TensorFlow it draws one displacement field per image where the trace knows the
    # batch's rows and one for the whole batch where it does not, and a batch gathered
    # from the replicas has its rows unknown to the trace (docs/engines.md).
    elastic = [] if BACKEND != "torch" else [
        keras.layers.RandomElasticTransform(factor=1.0, value_range=(-5, 5), seed=3)]
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((6, 6, 3)),
        keras.layers.Conv2D(3, 1),
        keras.layers.MixUp(seed=1),
        keras.layers.CutMix(seed=2),
        keras.layers.RandomGaussianBlur(factor=1.0, value_range=(-10, 10), seed=4),
        *elastic,
        keras.layers.Flatten(),
        _MinibatchStd(),
        keras.layers.Dense(3, activation="softmax"),
    ])


@pytest.mark.parametrize("gpus", [3] if BACKEND == "jax" else [2, 3])  # JAX: one global step
def test_layers_that_mix_rows_of_the_batch_equal_one_device(gpus):
    """MixUp and CutMix mix each image with another image of the batch (on one device, an
    image of another device's rows), RandomElasticTransform draws inside the backend's
    image function, and RandomGaussianBlur draws its two sigmas with a shape of (2,), which
    torch's replica of 1 row took for a draw per row, and a user's `mixes_rows` layer takes
    the standard deviation over the batch: each replica runs them on the gathered batch and
    keeps its rows. 26 rows in batches of 5: replicas of 1 and 2 rows, and a last
    batch that leaves replicas without rows, whose backward pass joins the gather's
    all-reduce too."""
    x = np.random.default_rng(5).normal(size=(26, 6, 6, 3)).astype("float32")
    data = (x, np.arange(26) % 3)
    runs = [_train(count, 26, 5, build=_mixing_model, data=data, shuffle=True)
            for count in (None, gpus)]
    _assert_same(*runs)


@pytest.mark.parametrize("gpus", [3] if BACKEND == "jax" else [2, 3])
def test_a_layer_marked_alone_mixes_rows_and_its_class_does_not(gpus):
    """A `Lambda` over the batch (centred and scaled by the batch's column sums) is marked
    alone, `mixes_rows(layer)`: it runs on the gathered batch, as one device runs it. The
    model's other Lambda, of a row alone, is not gathered, and neither is Lambda, the class.
    Unmarked, the first differed silently (predictions 0.25 from one device's on TensorFlow
    and 0.36 on torch, 11 rows in batches of 4 on 3 devices)."""
    from keras_multigpu import rules_mixing

    def build():
        keras.utils.set_random_seed(0)
        over_the_batch = kmg.mixes_rows(keras.layers.Lambda(
            lambda t: t / keras.ops.sum(t, axis=0, keepdims=True)))
        return keras.Sequential([
            keras.Input((6,)), keras.layers.Dense(4, activation="softplus"), over_the_batch,
            keras.layers.Lambda(lambda t: t * 2.0), keras.layers.Dense(3, activation="softmax")])

    runs = [_train(count, 29, 10, build=build, compile=lambda m: m.compile(
        optimizer=keras.optimizers.SGD(0.5), loss="sparse_categorical_crossentropy"))
        for count in (None, gpus)]
    _assert_same(*runs)
    assert keras.layers.Lambda not in rules_mixing._MARKED
    assert not rules_mixing._mixes(keras.layers.Lambda(lambda t: t))


def _train_naming_state(gpus, build):
    """`_train(gpus, 11, 4, build=build)`, and the `ReplicaStateWarning`s it gave."""
    from keras_multigpu import _replica_state

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = _train(gpus, 11, 4, build=build)
    return run, [str(w.message) for w in caught
                 if issubclass(w.category, _replica_state.ReplicaStateWarning)]


class _RowCount(keras.layers.Layer):
    """Counts the rows it trains on in a variable of its own: state updated from its rows."""

    def build(self, shape):
        self.seen = self.add_weight(shape=(), initializer="zeros", trainable=False, name="seen")

    def call(self, x, training=None):
        if training:
            self.seen.assign_add(keras.ops.cast(keras.ops.shape(x)[0], self.seen.dtype))
        return x


@pytest.mark.parametrize("gpus", [3])
def test_a_layer_counting_its_own_rows_is_named_unless_marked(gpus):
    """A layer that updates its state from its rows counts, on TensorFlow and torch, its
    replica's rows (11 rows in batches of 4 on 3 devices: the first replica's 10 of one
    device's 22 in two epochs, the others 6, and torch's processes each kept their own):
    the replicas' disagreement is named in a `ReplicaStateWarning`, and every replica goes
    on from the first's. Marked (`mixes_rows(layer)`), it counts the whole batch, as one
    device does, with no warning. JAX's one program sees the whole batch: no mark needed."""
    import doctest

    from keras_multigpu import _replica_state, processes

    def build(marked):
        def model():
            keras.utils.set_random_seed(0)
            count = _RowCount()
            return keras.Sequential([keras.Input((6,)), kmg.mixes_rows(count) if marked else count,
                                     keras.layers.Dense(3, activation="softmax")])
        return model

    def seen(run):
        return float(keras.ops.convert_to_numpy(run[0].layers[0].seen))

    reference = _train(None, 11, 4, build=build(False))
    assert seen(reference) == 22
    for marked in (False, True):
        run, named = _train_naming_state(gpus, build(marked))
        if marked or BACKEND == "jax":
            assert not named
            assert seen(run) == 22
            _assert_same(reference, run)
        else:
            assert seen(run) == 10  # the first replica's, on every process
            assert len(named) == (1 if processes.rank() == 0 else 0)
            assert all("/seen'" in text and "its layer '" in text and "mixes_rows" in text
                       and "the model updates it itself" not in text for text in named)
    assert doctest.testmod(_replica_state).failed == 0


class _Queue(keras.Model):
    """Keeps the last 8 rows it trained on in a variable of its own (NNCLR's support set, a
    subclassed model's attribute, not a layer's), updated in its `call`."""

    def __init__(self):
        super().__init__(name="queued")
        self.dense = keras.layers.Dense(3, activation="softmax")
        self.queue = keras.Variable(np.zeros((8, 6), "float32"), trainable=False, name="queue")

    def call(self, x, training=None):
        if training:
            self._enqueue(x)
        return self.dense(x)

    def _enqueue(self, x):
        self.queue.assign(keras.ops.concatenate([x, self.queue], axis=0)[:8])
        return x


class _MarkedQueue(_Queue):
    _enqueue = kmg.mixes_rows(_Queue._enqueue)


@pytest.mark.parametrize("gpus", [3])
def test_a_models_own_variable_updated_from_its_rows_is_named_unless_its_update_is_marked(gpus):
    """A model's own variable (not a layer's) that its `call` updates from the rows: on
    TensorFlow and torch each replica keeps its share's rows, and the warning says that the
    model updates it itself, and that the function making the update is what to mark.
    Marked, the update runs on the whole batch (11 rows in batches of 4 on 3 devices: the
    last batch of 3 rows leaves 1 row on each replica), as one device's."""
    from keras_multigpu import processes

    def build(cls):
        def model():
            keras.utils.set_random_seed(0)
            model = cls()
            model(np.zeros((1, 6), "float32"))
            return model
        return model

    reference = _train(None, 11, 4, build=build(_Queue))
    for cls in (_Queue, _MarkedQueue):
        run, named = _train_naming_state(gpus, build(cls))
        if cls is _MarkedQueue or BACKEND == "jax":
            assert not named
            _assert_same(reference, run)
            np.testing.assert_allclose(keras.ops.convert_to_numpy(run[0].queue),
                                       keras.ops.convert_to_numpy(reference[0].queue))
        else:
            assert len(named) == (1 if processes.rank() == 0 else 0)
            assert all("'queue'" in text and "the model updates it itself" in text
                       and "function of the batch's rows marked" in text for text in named)


def _augmenting_model():
    # AugMix runs on torch only: on TensorFlow its chains are chosen with Python's `random`
    # as each trace of the step is made, and one device traces the step again for a last
    # batch of another size (docs/engines.md).
    augmix = [] if BACKEND == "tensorflow" else [keras.layers.AugMix(value_range=(0, 1), seed=6)]
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((6, 6, 3)),
        keras.layers.RandAugment(value_range=(0, 1), seed=5),
        *augmix,
        keras.layers.Conv2D(3, 1),
        keras.layers.Flatten(),
        keras.layers.Dense(3, activation="softmax"),
    ])


@pytest.mark.skipif(BACKEND == "jax", reason="one step on the whole batch (it passes; its "
                    "compilation takes a minute on the CPU)")
@pytest.mark.parametrize("gpus", [3])
def test_randaugment_and_augmix_equal_one_device(gpus):
    """RandAugment draws its operations with a shape of (2,), which a replica of 2 rows took
    for a draw per row, AugMix chooses its own with Python's `random`, and their operations
    refuse a replica's share of no rows: each replica runs them on the gathered batch. 13
    rows in batches of 4 on 3 devices: replicas of 1 and 2 rows, and a last batch of one."""
    x = np.random.default_rng(6).uniform(size=(13, 6, 6, 3)).astype("float32")
    data = (x, np.arange(13) % 3)
    runs = [_train(count, 13, 4, build=_augmenting_model, data=data, shuffle=True)
            for count in (None, gpus)]
    _assert_same(*runs)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's replicas share a process")
@pytest.mark.parametrize("gpus", [3])
def test_augmix_chooses_one_devices_operations_in_each_replica(gpus):
    """AugMix chooses its operations with Python's `random` as the step is traced, and
    TensorFlow traces its replicas in turn in one process: each replica chooses what one
    device chooses. (One device traces its step twice where the first call makes variables,
    a compiled metric's, and AugMix then keeps the second trace's choices: no metric here.)"""
    x = np.random.default_rng(6).uniform(size=(13, 6, 6, 3)).astype("float32")
    data = (x, np.arange(13) % 3)

    def build():
        keras.utils.set_random_seed(0)
        return keras.Sequential([
            keras.Input((6, 6, 3)), keras.layers.AugMix(value_range=(0, 1)),
            keras.layers.Conv2D(3, 1), keras.layers.Flatten(), keras.layers.Dense(3)])

    def compile(model):
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    runs = [_train(count, 13, 4, build=build, compile=compile, data=data, shuffle=True)
            for count in (None, gpus)]
    _assert_same(*runs)


@pytest.mark.parametrize("gpus", [3])
def test_a_mel_spectrogram_floored_under_the_batchs_peak_equals_one_device(gpus):
    """MelSpectrogram floors its decibels at `top_db` under the peak of the whole batch, and
    its `stft` refuses a batch of no signals (TensorFlow, torch): each replica runs it on
    the gathered batch. Signals 40 dB apart in batches of 3 on 3 devices (replicas of one
    row, and of none in the last batch): a replica's own peak floors other rows."""
    rng = np.random.default_rng(9)
    x = (rng.normal(size=(10, 64)) * 10.0 ** (-2 * (np.arange(10) % 3))[:, None])
    data = (x.astype("float32"), np.arange(10) % 2)

    def build():
        keras.utils.set_random_seed(0)
        return keras.Sequential([
            keras.Input((64,)),
            keras.layers.MelSpectrogram(fft_length=16, sequence_stride=8, num_mel_bins=4,
                                        top_db=30.0),
            keras.layers.Flatten(), keras.layers.Dense(2, activation="softmax")])

    runs = [_train(count, 10, 3, build=build, data=data) for count in (None, gpus)]
    _assert_same(*runs)


class _Fourier(keras.layers.Layer):
    """keras-io's FNet mixing (`ops.fft2`'s real part) beside a spectrogram by `ops.stft`."""

    def call(self, x):
        mixed = keras.ops.fft2((x, keras.ops.zeros_like(x)))[0]
        real, imag = keras.ops.stft(keras.ops.reshape(x, (-1, 32)), 8, 4, 8)
        spectrum = keras.ops.reshape(keras.ops.sqrt(real**2 + imag**2 + 1e-6), (-1, 45))
        return keras.ops.concatenate([keras.ops.reshape(mixed, (-1, 32)), spectrum], -1)


@pytest.mark.parametrize("gpus", [3])
def test_fourier_transforms_with_a_device_left_without_rows(gpus):
    """torch's FFTs refuse a batch of no rows, and `stft`'s reflection padding does on
    TensorFlow and torch: 10 rows in batches of 3 leave the last batch's row to one device."""
    x = np.random.default_rng(10).normal(size=(10, 4, 8)).astype("float32")

    def build():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((4, 8)), keras.layers.Dense(8), _Fourier(),
                                 keras.layers.Dense(3, activation="softmax")])

    def compile(model):  # a small step: the spectra's large logits amplify rounding
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])

    runs = [_train(count, 10, 3, build=build, compile=compile, data=(x, np.arange(10) % 3))
            for count in (None, gpus)]
    _assert_same(*runs)


class _Recommender(keras.Model):
    """keras-io's collaborative filtering (RecommenderNet): `ops.tensordot(users, movies,
    2)` contracts the batch axis too, one value for the batch that every row adds."""

    def __init__(self):
        super().__init__(name="recommender")  # TensorFlow's scopes take no leading "_"
        self.users = keras.layers.Embedding(7, 4, embeddings_initializer="he_normal")
        self.movies = keras.layers.Embedding(9, 4, embeddings_initializer="he_normal")
        self.bias = keras.layers.Embedding(9, 1)

    def call(self, inputs):
        users, movies = self.users(inputs[:, 0]), self.movies(inputs[:, 1])
        return keras.ops.sigmoid(keras.ops.tensordot(users, movies, 2)
                                 + self.bias(inputs[:, 1]))


@pytest.mark.parametrize("gpus", [3] if BACKEND == "jax" else [2, 3])  # JAX: one global step
def test_a_contraction_over_the_batch_equals_one_device(gpus):
    """Each replica computes the contraction on the gathered batch (it summed its own rows
    only: weights 1e-2 from one device's on TensorFlow and torch). 26 rows in batches of 5,
    so replicas of 1 and 2 rows and, in the last batch, of none."""
    rng = np.random.default_rng(6)
    pairs = np.stack([rng.integers(0, 7, 26), rng.integers(0, 9, 26)], 1).astype("int32")
    data = (pairs, rng.uniform(size=(26, 1)).astype("float32"))

    def build():
        keras.utils.set_random_seed(0)
        return _Recommender()

    def compile(model):
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss="binary_crossentropy")

    runs = [_train(count, 26, 5, build=build, compile=compile, data=data, shuffle=True)
            for count in (None, gpus)]
    _assert_same(*runs)


class _OrthogonalRegularizer(keras.regularizers.Regularizer):
    """keras-io's PointNet's activity regularizer: `tensordot(x, x, axes=(2, 2))` pairs
    every row of the batch with every other, and the sum goes over all the pairs."""

    def __call__(self, x):
        x = keras.ops.reshape(x, (-1, 2, 2))
        pairs = keras.ops.reshape(keras.ops.tensordot(x, x, axes=(2, 2)), (-1, 2, 2))
        return keras.ops.sum(0.01 * keras.ops.square(pairs - keras.ops.eye(2)[None]))


@pytest.mark.parametrize("gpus", [3])
def test_a_tensordot_that_pairs_the_batchs_rows_equals_one_device(gpus):
    """Each replica pairs its rows with the gathered batch's. It paired only its own: in
    keras-io's PointNet, 47 rows in batches of 10 on 3 devices, each epoch's loss was 0.11
    from one device's on TensorFlow and torch (here the accuracy differed, by 3 and 1 rows
    of 26). 26 rows in batches of 5: replicas of 1 and 2 rows and, at the end, of none."""

    def build():
        keras.utils.set_random_seed(0)
        return keras.Sequential([
            keras.Input((6,)),
            keras.layers.Dense(4, activity_regularizer=_OrthogonalRegularizer()),
            keras.layers.Dense(3, activation="softmax")])

    runs = [_train(count, 26, 5, build=build, shuffle=True) for count in (None, gpus)]
    _assert_same(*runs)


def _torch_module_model():
    """torch's own layers in a Keras model, as Keras's `TorchModuleWrapper` documents them:
    a BatchNorm2d, whose statistics are the batch's, and a Dropout, whose mask torch draws
    (`keras.utils.set_random_seed` seeds torch's generator too)."""
    import torch

    keras.utils.set_random_seed(0)
    wrap = keras.layers.TorchModuleWrapper
    return keras.Sequential([
        keras.Input((1, 6, 6)),
        wrap(torch.nn.Conv2d(1, 4, 3)),
        wrap(torch.nn.BatchNorm2d(4)),
        wrap(torch.nn.Flatten()),
        wrap(torch.nn.Dropout(0.5)),
        keras.layers.Dense(3, activation="softmax"),
    ])


@pytest.mark.skipif(BACKEND != "torch", reason="TorchModuleWrapper is the torch backend's")
@pytest.mark.parametrize("gpus", [2, 3])
def test_torchs_own_batch_norm_and_dropout_equal_one_device(gpus):
    """torch's BatchNorm normalized by each process's rows and moved its running statistics
    by them, and torch's Dropout drew each process's mask for its rows (weights 1e-2 apart
    on 3 processes). 26 rows in batches of 5 leave processes of 1 row, and of none; the
    validation loss reads the running statistics."""
    x = np.random.default_rng(6).normal(size=(26, 1, 6, 6)).astype("float32")
    data = (x, np.arange(26) % 3)
    runs = [_train(count, 26, 5, build=_torch_module_model, data=data, shuffle=True,
                   validation_data=data) for count in (None, gpus)]
    _assert_same(*runs)


class _TorchDraws(keras.Model):
    """A step of the user's that draws with torch's own functions, from torch's global
    generator: noise per row (a GAN's `torch.randn(rows, latent)`), a draw like the inputs,
    integers, and a draw of a constant size."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(3, activation="softmax")

    def call(self, x):
        return self.out(self.hidden(x))

    def train_step(self, data):
        import torch

        x, y = data
        rows = x.shape[0]
        x = (x * torch.rand(rows, 1) + 0.1 * torch.randn_like(x) + torch.randn(rows, 6)
             + torch.randint(0, 2, (rows, 1)) + torch.rand(6))
        return super().train_step((x, y))


@pytest.mark.skipif(BACKEND != "torch", reason="torch's own draws in a torch step")
@pytest.mark.parametrize("gpus", [2, 3])
def test_torchs_own_draws_in_a_step_equal_one_device(gpus):
    """Every process shares torch's generator: each drew the same numbers for its own rows
    (the same noise for different rows: figures 0.12 from one device's on 2 processes).
    Each process now draws for the batch and keeps its rows. 26 rows in batches of 5 leave
    processes of 1 row and of none, whose draws move the generator as the others' do."""
    x = np.random.default_rng(7).normal(size=(26, 6)).astype("float32")

    def build():
        keras.utils.set_random_seed(0)
        return _TorchDraws()

    runs = [_train(count, 26, 5, build=build, data=(x, np.arange(26) % 3))
            for count in (None, gpus)]
    _assert_same(*runs)


class _Routed(keras.layers.Layer):
    """Each row goes to one of two experts by the sign of its first feature; an expert that
    no row goes to is skipped (a Mixture-of-Experts pattern), so it has no gradient."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.experts = [keras.layers.Dense(4), keras.layers.Dense(4)]

    def build(self, shape):
        for expert in self.experts:
            expert.build(shape)

    def call(self, x):
        first = x[:, 0] > 0
        out = keras.ops.zeros((keras.ops.shape(x)[0], 4))
        for mask, expert in zip((first, keras.ops.logical_not(first)), self.experts):
            if bool(keras.ops.any(mask)):  # a Python choice: eager steps alone (torch's)
                out = keras.ops.where(mask[:, None], expert(x), out)
        return out


@pytest.mark.skipif(BACKEND != "torch", reason="a layer that chooses in Python, on its "
                    "rows' values: torch's eager steps alone run it")
@pytest.mark.parametrize("gpus", [2])
def test_an_expert_that_one_process_skips_equals_one_device(gpus):
    """Process 0's rows all go to the first expert, process 1's to both: the second
    expert's weights have a gradient on process 1 and none on process 0. The first step's
    all-reduce summed the gradients each process had, in order: buffers of different sizes,
    and gloo aborted both processes (of one size, another variable's gradients would have
    been summed with them). Later steps' buckets gave process 0 none, so it kept its expert
    as it was while process 1 updated its own: the processes parted (a probe's weights, 0.01
    and 0.14 from one device's). Each now takes the sum, with zeros where it has none."""
    x = np.random.default_rng(9).normal(size=(16, 6)).astype("float32")
    x[:4, 0] = np.abs(x[:4, 0]) + 0.1  # batches of 8: process 0's 4 rows, expert 0 only
    x[8:12, 0] = np.abs(x[8:12, 0]) + 0.1

    def build():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((6,)), _Routed(), keras.layers.Dense(3)])

    def compile(model):
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    runs = [_train(count, 16, 8, epochs=3, build=build, compile=compile,
                   data=(x, np.arange(16) % 3)) for count in (None, gpus)]
    _assert_same(*runs)


def _tied_pooling():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((4, 4, 4, 1)),
        keras.layers.Conv3DTranspose(2, 2, strides=2),
        keras.layers.MaxPooling3D(2),
        keras.layers.Conv3D(2, 1, activation="relu", bias_initializer="ones"),
        keras.layers.MaxPooling3D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(3, activation="softmax"),
    ])


@pytest.mark.parametrize("gpus", [3])
def test_max_pooling_over_tied_maxima_equals_one_device(gpus):
    """Windows whose maxima tie (a convolution's outputs over a region of zeros are its
    bias alone): one device's TensorFlow step gives a window's gradient to one of them. The
    pooling that guards a TensorFlow replica dealt no rows ran in a `tf.cond`, where
    MaxPool3D gives it to each: the bias's update was 7 times one device's. 8 rows in
    batches of 3 leave a replica with none."""
    rng = np.random.default_rng(8)
    x = rng.random((8, 4, 4, 4, 1), dtype="float32")
    x[:, :2] = 0.0
    runs = [_train(count, 8, 3, build=_tied_pooling, data=(x, np.arange(8) % 3))
            for count in (None, gpus)]
    _assert_same(*runs)


def _float8():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(3, activation="softmax")])
    model.quantize("float8")
    return model


@pytest.mark.parametrize("gpus", [3])
def test_float8_training_equals_one_device_or_is_refused_where_devices_see_shares(gpus):
    """Keras's float8 layers keep scales and amax histories that the optimizer overwrites
    with their "gradient": the largest value over the batch. JAX's devices run one step on
    the whole batch and train as one device. A TensorFlow replica's weighted all-reduce took
    a weighted mean of them (weights 0.57 from one device's after 2 epochs), and a torch
    process dealt no rows failed on the max of its empty share: there training is refused,
    and evaluate and predict (which update none) equal one device. 10 rows in batches of 4
    leave a device with none."""
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(10, 6)).astype("float32") * 4, np.arange(10) % 3
    if backends.has(backends.current(), "whole_batch"):
        runs = [_train(count, 10, 4, build=_float8, data=(x, y)) for count in (None, gpus)]
        _assert_same(*runs)
        return
    model = _float8()
    _compile(model)
    one = model.evaluate(x, y, batch_size=4, verbose=0), model.predict(x, batch_size=4,
                                                                        verbose=0)
    parallel = kmg.multi_gpu_model(model, gpus=engine_gpus(gpus))
    _compile(parallel)
    np.testing.assert_allclose(parallel.evaluate(x, y, batch_size=4, verbose=0), one[0],
                               rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(parallel.predict(x, batch_size=4, verbose=0), one[1],
                               rtol=RTOL, atol=ATOL)
    for train in (lambda: parallel.fit(x, y, batch_size=4, verbose=0),
                  lambda: parallel.train_on_batch(x[:4], y[:4])):
        with pytest.raises(ValueError, match=r"12 variable\(s\) that its optimizer "
                           r"overwrites.*float8.*gpus=1.*JAX"):
            train()


@pytest.mark.parametrize("gpus", [3])
@pytest.mark.parametrize("loss", ["dice", "tversky"])
def test_a_loss_of_one_value_for_the_batch_equals_one_device(gpus, loss):
    """Dice and Tversky (`axis=None`) divide sums over the whole batch: each replica
    computes them on the gathered batch. Batches of 4 on 3 devices leave replicas of one
    row (their votes come from the replica of two), and the last batch of 3 one row each
    (the loss keeps what the full batches decided). OneHotMeanIoU's state is int64, beside
    the float sums of the other metric."""
    rng = np.random.default_rng(6)
    x = rng.normal(size=(47, 6)).astype("float32")
    y = (rng.uniform(size=(47, 3)) > 0.5).astype("float32")  # labels, several per row

    def build():  # sigmoid: with softmax rows and one label per row, Dice is a mean
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                                 keras.layers.Dense(3, activation="sigmoid")])

    def compile(model):
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss,
                      metrics=[keras.metrics.OneHotMeanIoU(3, name="iou"), "binary_accuracy"])

    runs = [_train(count, 47, 4, build=build, compile=compile, data=(x, y))
            for count in (None, gpus)]
    _assert_same(*runs)


@pytest.mark.parametrize("gpus", [3])
def test_a_loss_that_compares_every_pair_of_rows_equals_one_device(gpus):
    """Keras's Circle loss (metric learning) gives each row a value from its similarities
    with every row of the batch: each replica takes its rows of the values computed on the
    gathered batch (measured before, on TensorFlow and torch: two thirds of one device's
    loss in batches of 3). 10 rows in batches of 3: replicas of one row and of none."""
    rng = np.random.default_rng(8)
    x, y = rng.normal(size=(10, 6)).astype("float32"), rng.integers(0, 3, 10)

    def build():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                                 keras.layers.Dense(4)])

    def compile(model):
        model.compile(optimizer=keras.optimizers.SGD(1e-3), loss=keras.losses.Circle())

    runs = [_train(count, 10, 3, build=build, compile=compile, data=(x, y),
                   validation_data=(x[:4], y[:4])) for count in (None, gpus)]
    _assert_same(*runs)


def masked_accuracy(label, pred):
    """The TensorFlow transformer tutorial's metric, in `keras.ops`: a ratio of sums over
    the batch (the matches among the tokens that are not padding)."""
    pred = keras.ops.argmax(pred, axis=2)
    label = keras.ops.cast(label, pred.dtype)
    mask = label != 0
    match = keras.ops.cast((label == pred) & mask, "float32")
    return keras.ops.sum(match) / keras.ops.sum(keras.ops.cast(mask, "float32"))


@pytest.mark.parametrize("gpus", [3])
def test_a_metric_function_of_one_value_for_the_batch_equals_one_device(gpus):
    """A compiled metric function that returns one value for the batch is computed on the
    gathered batch (each replica's own ratio was averaged: `masked_accuracy` 0.03 from one
    device's on TensorFlow and torch, 37 rows in batches of 10). Batches of 4 on 3
    devices leave replicas of one row, and the last batch of 3 one row each, as above. Its
    loss, a ratio of sums too, is computed on the gathered batch, and TensorFlow's tape
    rule leaves it as it is (taken for a replica's ratio, it trained weights 0.03 from one
    device's)."""
    rng = np.random.default_rng(8)
    x = rng.integers(1, 12, (47, 6))
    for row, length in enumerate(rng.integers(1, 7, 47)):
        x[row, length:] = 0  # padding
    y = np.where(x > 0, np.maximum((x * 3) % 12, 1), 0)

    def build():
        keras.utils.set_random_seed(0)
        tokens = keras.Input((6,), dtype="int32")
        hidden = keras.layers.Embedding(12, 8)(tokens)
        return keras.Model(tokens, keras.layers.Dense(12)(hidden))

    def masked_loss(label, pred):  # the tutorial's, compiled: gathered, one value
        mask = keras.ops.cast(label != 0, "float32")
        loss = keras.losses.sparse_categorical_crossentropy(label, pred, from_logits=True)
        return keras.ops.sum(loss * mask) / keras.ops.sum(mask)

    def compile(model):
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=masked_loss,
                      metrics=[masked_accuracy])

    runs = [_train(count, 47, 4, build=build, compile=compile, data=(x, y),
                   validation_data=(x[:13], y[:13])) for count in (None, gpus)]
    _assert_same(*runs)


class SupervisedContrastiveLoss(keras.losses.Loss):
    """keras-io's supervised contrastive loss, as written there: a `__call__` of its own,
    whose logits compare every row of the batch with every other."""

    def __init__(self, temperature=1, name=None):
        super().__init__(name=name)
        self.temperature = temperature

    def __call__(self, labels, feature_vectors, sample_weight=None):
        normalized = keras.utils.normalize(feature_vectors, axis=1, order=2)
        logits = keras.ops.divide(
            keras.ops.matmul(normalized, keras.ops.transpose(normalized)), self.temperature)
        labels = keras.ops.cast(keras.ops.squeeze(labels), "float32")  # its npairs_loss:
        same = keras.ops.cast(keras.ops.equal(keras.ops.reshape(labels, (-1, 1)),
                                              keras.ops.reshape(labels, (1, -1))), "float32")
        same = same / keras.ops.sum(same, axis=1, keepdims=True)
        return keras.ops.mean(keras.losses.categorical_crossentropy(same, logits,
                                                                    from_logits=True))


@pytest.mark.parametrize("gpus", [3] if BACKEND == "jax" else [2, 3])  # JAX: one global step
def test_a_loss_with_its_own_call_equals_one_device(gpus):
    """Such a loss returns one value for the batch, whatever it reduces: each replica
    computes it on the gathered batch (it compared its own rows only: weights 0.8 from one
    device's on TensorFlow, 0.3 on torch). 26 rows in batches of 5: replicas of one row,
    and of none."""
    rng = np.random.default_rng(7)
    data = (rng.normal(size=(26, 6)).astype("float32"), rng.integers(0, 3, (26, 1)))

    def build():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                                 keras.layers.Dense(4)])

    def compile(model):
        model.compile(optimizer=keras.optimizers.SGD(0.05),
                      loss=SupervisedContrastiveLoss(0.05))

    runs = [_train(count, 26, 5, build=build, compile=compile, data=data, shuffle=True)
            for count in (None, gpus)]
    _assert_same(*runs)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="a model takes text on TensorFlow alone")
def test_a_model_that_takes_text_equals_one_device():
    """keras-io's end-to-end text model: TextVectorization inside the model, fed strings as
    an object array, a tf.data dataset, and one batch (`train_on_batch`)."""
    import tensorflow as tf

    words = ["good movie", "bad film", "great plot and acting", "terrible", "fine I guess",
             "awful and bad", "loved it", "a boring plot"]
    rng = np.random.default_rng(0)
    x = np.array([words[i] for i in rng.integers(0, len(words), 29)], dtype=object)
    y = np.array([int(any(w in s for w in ("good", "great", "loved", "fine"))) for s in x])
    vectorize = keras.layers.TextVectorization(max_tokens=20, output_sequence_length=4)
    vectorize.adapt(words)
    dataset = tf.data.Dataset.from_tensor_slices((x.astype(str), y)).batch(10)

    def run(gpus):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((1,), dtype="string")
        hidden = keras.layers.GlobalAveragePooling1D()(
            keras.layers.Embedding(20, 4)(vectorize(inputs)))
        model = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(hidden))
        target = model if gpus is None else kmg.multi_gpu_model(model, gpus=gpus)
        target.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
        figures = {"arrays": target.fit(x, y, batch_size=10, epochs=2, verbose=0).history,
                   "dataset": target.fit(dataset, epochs=1, verbose=0).history,
                   "evaluate": target.evaluate(dataset, verbose=0),
                   "predict": target.predict(x, batch_size=7, verbose=0),
                   "train_on_batch": target.train_on_batch(x[:7], y[:7])}
        return model.get_weights(), figures

    (one_weights, one), (our_weights, ours) = run(None), run(3)
    for a, b in zip(one_weights, our_weights):
        np.testing.assert_allclose(b, a, rtol=RTOL, atol=ATOL)
    for name in ("evaluate", "predict", "train_on_batch"):
        np.testing.assert_allclose(ours[name], one[name], rtol=RTOL, atol=ATOL, err_msg=name)
    for name in ("arrays", "dataset"):
        assert ours[name].keys() == one[name].keys()
        for key in one[name]:
            np.testing.assert_allclose(ours[name][key], one[name][key], rtol=RTOL, atol=ATOL,
                                       err_msg=f"{name}: {key}")


class _TokensAndPositions(keras.layers.Layer):
    """keras-io's TokenAndPositionEmbedding: token ids from the data, positions `arange`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.tokens = keras.layers.Embedding(50, 4)
        self.positions = keras.layers.Embedding(7, 4)

    def call(self, x):
        return self.tokens(x) + self.positions(keras.ops.arange(keras.ops.shape(x)[-1]))


@pytest.mark.parametrize(("gpus", "optimizer"),
                         rotated([2, 3], [("adam",), ("rmsprop",)], per_case=1))
def test_lookups_under_optimizers_that_square_sparse_gradients(gpus, optimizer):
    """Adam and RMSprop square a sparse gradient row by row, so each lookup's gradient must
    have one device's rows: one per token looked up, and one per position (not one per
    position per device)."""
    x, y = np.random.RandomState(3).randint(0, 50, (45, 7)), np.arange(45) % 2

    def build():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((7,), dtype="int32"), _TokensAndPositions(),
                                 keras.layers.GlobalAveragePooling1D(),
                                 keras.layers.Dense(2, activation="softmax")])

    runs = [_train(count, len(x), 10, epochs=3, build=build, data=(x, y),
                   compile=lambda target: target.compile(
                       optimizer=optimizer, loss="sparse_categorical_crossentropy"))
            for count in (None, gpus)]
    _assert_same(*runs)


PER_STEP = {
    "accumulation": lambda: keras.optimizers.Adam(0.01, gradient_accumulation_steps=2),
    "ema": lambda: keras.optimizers.SGD(0.1, use_ema=True, ema_overwrite_frequency=3),
}


@pytest.mark.parametrize(("gpus", "optimizer"),
                         rotated([2, 3], [(name,) for name in PER_STEP], per_case=1))
def test_optimizers_that_choose_per_step(gpus, optimizer):
    """Gradient accumulation and EMA overwrites pick, each step, whether to update."""
    runs = [_train(count, 99, 25, compile=lambda target: target.compile(
                optimizer=PER_STEP[optimizer](), loss="sparse_categorical_crossentropy"))
            for count in (None, gpus)]
    _assert_same(*runs)


class _BatchLogs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.logs = []

    def on_train_batch_end(self, batch, logs=None):
        self.logs.append({key: float(value) for key, value in logs.items()})


@pytest.mark.parametrize("gpus", [2, 3])
def test_every_batchs_logs_are_one_devices(gpus):
    """The progress bar and batch callbacks see the running figures of the global batches
    (loss, accuracy, top-2 accuracy), not one device's share of them."""
    runs = []
    for count in (None, gpus):
        model = _bn_model()
        target = model if count is None else kmg.multi_gpu_model(model, gpus=count)
        target.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy",
                       metrics=["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(2)])
        recorder = _BatchLogs()
        x, y = _data(99)
        target.fit(x, y, batch_size=25, epochs=2, verbose=0, shuffle=False, callbacks=[recorder])
        runs.append(recorder.logs)
    assert len(runs[0]) == len(runs[1]) == 8
    for reference, logs in zip(*runs):
        assert logs.keys() == reference.keys()
        for key in reference:
            np.testing.assert_allclose(logs[key], reference[key], rtol=RTOL, atol=ATOL,
                                       err_msg=key)


# (2 devices: test_parallel's test_training_equals_one_device predicts and evaluates too.)
@pytest.mark.parametrize("gpus", [3])
def test_predict_and_evaluate_every_row_in_order(gpus):
    model, target, _ = _train(gpus, 99, 25)
    x, y = _data(99)
    expected = model.predict(x, batch_size=7, verbose=0)
    got = target.predict(x, batch_size=7, verbose=0)
    assert got.shape == (99, 3)
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(target.evaluate(x, y, batch_size=7, verbose=0),
                               model.evaluate(x, y, batch_size=7, verbose=0), rtol=RTOL)


class _BuiltWhenCalled(keras.Model):
    """A subclassed model whose layers make their weights at its first call."""

    def __init__(self):
        super().__init__(name="built_when_called")  # (TensorFlow refuses a leading "_")
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(3)

    def call(self, x):
        return self.out(self.hidden(x))


@pytest.mark.parametrize("gpus", [3])
@pytest.mark.parametrize("call", ["predict", "predict_on_batch"])
def test_a_model_first_called_by_predict_makes_one_devices_weights(gpus, call):
    """Keras's torch trainer predicts with such a model unbuilt: it makes its weights in the
    first step, where each process drew them for its own share of the rows (a (6, 8) kernel
    on a replica of 3 rows was taken for a batch-shaped draw), so every process predicted
    with other weights."""
    x, _ = _data(20)

    def run(gpus):
        keras.utils.set_random_seed(0)
        model = _BuiltWhenCalled()
        target = model if gpus is None else kmg.multi_gpu_model(model, gpus=gpus)
        out = (target.predict(x, batch_size=9, verbose=0) if call == "predict"
               else target.predict_on_batch(x[:9]))
        return model.get_weights(), out

    (weights, expected), (got_weights, got) = run(None), run(gpus)
    for a, b in zip(weights, got_weights, strict=True):
        np.testing.assert_allclose(b, a, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)


class _SummedEndpoint(keras.layers.Layer):
    """Keras's CTC OCR endpoint layer: `add_loss` of a per-sample loss vector, which Keras sums
    over the batch; beside it, a scalar mean and a weight regulariser."""

    def call(self, labels, predictions):
        self.add_loss(keras.ops.sum(keras.ops.square(predictions - labels), axis=-1,
                                    keepdims=True))
        self.add_loss(0.1 * keras.ops.mean(keras.ops.abs(predictions)))
        return predictions


def _endpoint_model():
    keras.utils.set_random_seed(0)
    x = keras.Input((6,), name="x")
    labels = keras.Input((3,), name="labels")
    hidden = keras.layers.Dense(8, activation="tanh",
                                kernel_regularizer=keras.regularizers.L2(0.01))(x)
    predictions = keras.layers.Dense(3)(hidden)
    return keras.Model([x, labels], _SummedEndpoint()(labels, predictions))


@pytest.mark.parametrize("gpus", [2, 3])
def test_add_loss_summed_over_the_batch(gpus):
    """A loss that `add_loss` sums over the batch is the global batch's sum (rows 10 in batches
    of 3: the last leaves devices without rows)."""
    x, y = _data(10)
    inputs = {"x": x, "labels": keras.utils.to_categorical(y, 3).astype("float32")}
    runs = []
    for count in (None, gpus):
        model = _endpoint_model()
        target = model if count is None else kmg.multi_gpu_model(model, gpus=count)
        target.compile(optimizer=keras.optimizers.SGD(0.05))
        history = target.fit(inputs, batch_size=3, epochs=2, shuffle=False, verbose=0)
        runs.append((model, target, history.history))
    _assert_same(*runs)


class _ScalarSumEndpoint(keras.layers.Layer):
    """`add_loss` of one value that sums over the batch's rows (`ops.sum` of every axis),
    alone or times a constant ("scaled")."""

    def __init__(self, scaled):
        super().__init__()
        self.scaled = scaled

    def call(self, labels, predictions):
        total = keras.ops.sum(keras.ops.square(predictions - labels))
        self.add_loss(0.5 * total if self.scaled else total)
        return predictions


def _scalar_sum_model(scaled):
    keras.utils.set_random_seed(0)
    x = keras.Input((6,), name="x")
    labels = keras.Input((3,), name="labels")
    hidden = keras.layers.Dense(8, activation="tanh",
                                kernel_regularizer=keras.regularizers.L2(0.01))(x)
    outputs = _ScalarSumEndpoint(scaled)(labels, keras.layers.Dense(3)(hidden))
    return keras.Model([x, labels], outputs)


# torch's graph does not tell a constant factor from one the rows make (a Python int of
# the replica's rows, `ops.sum(x) / k`): there a sum times a factor stays a mean (engines.md).
@pytest.mark.parametrize(("gpus", "scaled"),
                         [(3, False)] + ([(3, True)] if BACKEND != "torch" else []))
def test_a_scalar_add_loss_summing_the_rows(gpus, scaled):
    """`add_loss(ops.sum(per_row))` is one device's sum of the batch, not a mean over each
    replica's rows, in `fit`, its validation and `evaluate` (the engine's graph tells;
    before, on TensorFlow and torch the loss came out near 1/N of one device's). 10 rows
    in batches of 3 leave devices without rows."""
    x, y = _data(10)
    inputs = {"x": x, "labels": keras.utils.to_categorical(y, 3).astype("float32")}
    runs, evaluated = [], []
    for count in (None, gpus):
        model = _scalar_sum_model(scaled)
        target = model if count is None else kmg.multi_gpu_model(model, gpus=count)
        target.compile(optimizer=keras.optimizers.SGD(0.02))
        history = target.fit(inputs, batch_size=3, epochs=2, shuffle=False, verbose=0,
                             validation_data=(inputs,))
        runs.append((model, target, history.history))
        evaluated.append(target.evaluate(inputs, batch_size=4, verbose=0))
    _assert_same(*runs)
    np.testing.assert_allclose(evaluated[1], evaluated[0], rtol=RTOL, atol=ATOL)


def _two_outputs():
    keras.utils.set_random_seed(0)
    x = keras.Input((6,))
    hidden = keras.layers.Dense(4, activation="tanh")(x)
    return keras.Model(x, [keras.layers.Dense(3)(hidden), hidden])


def _loss_on_the_first(target):
    target.compile(optimizer=keras.optimizers.SGD(0.1), loss=[
        keras.losses.SparseCategoricalCrossentropy(from_logits=True), None])


@pytest.mark.parametrize("gpus", [3])
def test_one_target_for_the_one_output_with_a_loss(gpus):
    """keras-io's miniature GPT: two outputs, `loss=[fn, None]` and one `y`. Batches of 7
    leave two devices 2 rows each, as many as the outputs: Keras took such a replica's rows
    for the outputs' targets (on torch, whose replicas know their rows)."""
    x, y = _data(14)
    runs = [_train(count, 14, 7, build=_two_outputs, compile=_loss_on_the_first)
            for count in (None, gpus)]
    _assert_same(*runs)
    (_, one, _), (_, parallel, _) = runs
    np.testing.assert_allclose(parallel.evaluate(x, y, batch_size=7, verbose=0),
                               one.evaluate(x, y, batch_size=7, verbose=0), rtol=RTOL, atol=ATOL)


class _CTCEndpoint(keras.layers.Layer):
    """keras-io's OCR endpoint with Keras's own CTC loss: `add_loss` of its per-row vector."""

    def call(self, labels, predictions):
        rows = keras.ops.shape(labels)[0]
        loss = keras.ops.ctc_loss(keras.ops.cast(labels, "int32"), predictions,
                                  keras.ops.full((rows,), 3, "int32"),
                                  keras.ops.full((rows,), 5, "int32"), mask_index=0)
        self.add_loss(keras.ops.expand_dims(loss, 1))
        return predictions


@pytest.mark.parametrize("gpus", [3, 4])
def test_ctc_loss_with_a_device_left_without_rows(gpus):
    """Keras's `ctc_loss` refuses zero rows on TensorFlow and torch, which one device never
    hands it: 10 rows in batches of 3 leave the last batch's one row to one device."""
    rng = np.random.default_rng(0)
    inputs = {"x": rng.normal(size=(10, 5, 4)).astype("float32"),
              "labels": rng.integers(1, 4, (10, 3)).astype("float32")}
    runs = []
    for count in (None, gpus):
        keras.utils.set_random_seed(0)
        x, labels = keras.Input((5, 4), name="x"), keras.Input((3,), name="labels")
        predictions = keras.layers.Dense(4, activation="softmax")(
            keras.layers.Dense(6, activation="tanh")(x))
        model = keras.Model([x, labels], _CTCEndpoint()(labels, predictions))
        target = model if count is None else kmg.multi_gpu_model(model, gpus=count)
        target.compile(optimizer=keras.optimizers.SGD(0.05))
        history = target.fit(inputs, batch_size=3, epochs=2, shuffle=False, verbose=0,
                             validation_data=(inputs, None))
        runs.append((model, target, history.history))
    _assert_same(*runs)


class StepInputs(keras.Model):
    """A model that learns from x alone (its own loss), and records what each of its steps
    is handed: x alone or a tuple, as Keras packs it."""

    def __init__(self):
        super().__init__()
        self.body = keras.layers.Dense(3)
        self.seen = set()

    def call(self, x):
        out = self.body(x)
        self.add_loss(keras.ops.mean(keras.ops.square(out - 1.0)))
        return out

    def _seen(self, kind, args):
        data = args[-1]
        # (torch's DataLoader hands one device a generator's tuple as a list: not told apart)
        alone = not isinstance(data, (tuple, list))
        self.seen.add((kind, "x alone" if alone else f"sequence of {len(data)}"))

    def train_step(self, *args):
        self._seen("train", args)
        return super().train_step(*args)

    def test_step(self, *args):
        self._seen("test", args)
        return super().test_step(*args)

    def predict_step(self, *args):
        self._seen("predict", args)
        return super().predict_step(*args)


@pytest.mark.parametrize("gpus", [2, 3])
@pytest.mark.parametrize("source", ["arrays", "generator of (x,)"])
def test_a_step_is_handed_x_alone_as_on_one_device(gpus, source):
    """Keras hands a step x alone for arrays without targets (a VAE's `train_step(self,
    data)` calls its encoder on `data`), and a generator's `(x,)` as it is. The library
    handed `(x,)` for arrays: such a step failed, or called its model on a tuple."""
    x = _data(11)[0]

    def data():
        if source == "arrays":
            return {"x": x, "batch_size": 4}
        return {"x": ((x[i:i + 4],) for i in range(0, 11, 4)), "steps": 3}

    runs = []
    for count in (None, gpus):
        keras.utils.set_random_seed(0)
        model = StepInputs()
        target = model if count is None else kmg.multi_gpu_model(model, gpus=count)
        target.compile(optimizer=keras.optimizers.SGD(0.1))
        fit = data()
        fit["steps_per_epoch"] = fit.pop("steps", None)
        history = target.fit(**fit, epochs=1, shuffle=False, verbose=0)
        logs = target.evaluate(**data(), verbose=0, return_dict=True)
        predictions = target.predict(**data(), verbose=0)
        runs.append((model, history.history, logs, predictions))
    (ref, ref_history, ref_logs, ref_predictions), (model, history, logs, predictions) = runs
    expected = "x alone" if source == "arrays" else "sequence of 1"
    assert ref.seen == {(kind, expected) for kind in ("train", "test", "predict")}
    assert model.seen == ref.seen
    for a, b in zip(ref.get_weights(), model.get_weights()):
        np.testing.assert_allclose(b, a, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(history["loss"], ref_history["loss"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(logs["loss"], ref_logs["loss"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(predictions, ref_predictions, rtol=RTOL, atol=ATOL)


class _DenseWithTracker(keras.Model):
    """One Dense layer and a loss tracker named `tracker`: the base of the steps below."""

    def __init__(self, tracker):
        super().__init__()
        self.body = keras.layers.Dense(3)
        self.tracker = keras.metrics.Mean(name=tracker)

    def call(self, x):
        return self.body(x)

    @property
    def metrics(self):
        return [self.tracker]


class OwnStep(_DenseWithTracker):
    """A model whose own train_step computes a plain mean loss, written for any backend."""

    def __init__(self):
        super().__init__("own_loss")

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return keras.ops.mean(keras.ops.square(y_pred - keras.ops.one_hot(y, 3)))

    def train_step(self, *args):
        if BACKEND == "jax":
            return super().train_step(*args)  # Keras's own (stateless) step calls compute_loss
        if BACKEND == "torch":
            x, y = args[-1]
            self.zero_grad()
            loss = self.compute_loss(y=y, y_pred=self(x, training=True))
            loss.backward()
            self.after_backward()
            variables = self.trainable_variables
            self.optimizer.apply([v.value.grad for v in variables], variables)
            self.tracker.update_state(loss)
            return {"own_loss": self.tracker.result()}
        import tensorflow as tf

        x, y = args[-1]
        with tf.GradientTape() as tape:
            loss = self.compute_loss(y=y, y_pred=self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        self.tracker.update_state(loss)
        return {"own_loss": self.tracker.result()}

    def after_backward(self):
        """torch: runs between the backward pass and `apply` (the subclasses' hook)."""


@pytest.mark.parametrize("gpus", [2, 4])
def test_own_train_step_with_its_own_mean(gpus):
    x, y = _data(99)
    results = []
    for g in (None, gpus):
        keras.utils.set_random_seed(0)
        model = OwnStep()
        target = model if g is None else kmg.multi_gpu_model(model, gpus=g)
        target.compile(optimizer=keras.optimizers.Adam(0.01))
        history = target.fit(x, y, batch_size=25, epochs=2, verbose=0, shuffle=False)
        results.append((model.get_weights(), history.history))
    (ref_w, ref_h), (w, h) = results
    assert h.keys() == ref_h.keys()
    for key in ref_h:
        np.testing.assert_allclose(h[key], ref_h[key], rtol=RTOL, err_msg=key)
    for a, b in zip(ref_w, w):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=ATOL)


class RawLogs(keras.Model):
    """A step that returns, beside Keras's logs, a value it computed from its batch, not
    read from a metric (keras-io's WGAN-GP and CycleGAN return their losses so)."""

    def __init__(self):
        super().__init__()
        self.body = keras.layers.Dense(3, activation="softmax")

    def call(self, x):
        return self.body(x)

    def train_step(self, *args):
        x, _ = args[-1]
        raw = {"raw_mean": keras.ops.mean(keras.ops.square(x)), "steps": 1}
        if BACKEND == "jax":
            logs, state = super().train_step(*args)
            return {**logs, **raw}, state
        return {**super().train_step(*args), **raw}


@pytest.mark.parametrize("gpus", [2, 3])
def test_a_value_a_step_returns_is_taken_for_a_mean_over_its_rows(gpus):
    """Such a value was each replica's own: TensorFlow averaged the replicas' (a batch of
    10 rows on 3 replicas weighs 4 rows as 3), torch logged the first process's. Each is
    now weighed by its replica's rows, as the gradients are; a metric's result is not
    touched, and a Python number stays one. 26 rows in batches of 5: replicas without
    rows too."""
    runs = [_train(count, 26, 5, build=lambda: _seeded(RawLogs), shuffle=True)
            for count in (None, gpus)]
    _assert_same(*runs)


def _seeded(build):
    keras.utils.set_random_seed(0)
    return build()


class ClippedByItsNorm(_DenseWithTracker):
    """A step that clips its gradients to a global norm it computes itself, before
    `optimizer.apply` (as SAM moves its weights along them): not linear in them."""

    def __init__(self, autograd=False):
        super().__init__("loss")
        self.autograd = autograd  # torch: `torch.autograd.grad` rather than a backward pass

    def train_step(self, data):
        x, y = data
        if BACKEND == "torch":
            import torch

            self.zero_grad()
            loss = self.compute_loss(y=y, y_pred=self(x, training=True))
            if self.autograd:
                grads = torch.autograd.grad(loss, [v.value for v in self.trainable_variables])
            else:
                loss.backward()
                grads = [v.value.grad for v in self.trainable_variables]
        else:
            import tensorflow as tf

            with tf.GradientTape() as tape:
                loss = self.compute_loss(y=y, y_pred=self(x, training=True))
            grads = tape.gradient(loss, self.trainable_variables)
        norm = keras.ops.sqrt(sum(keras.ops.sum(keras.ops.square(g)) for g in grads))
        grads = [g * keras.ops.minimum(1.0, 0.05 / norm) for g in grads]
        self.optimizer.apply(grads, self.trainable_variables)
        self.tracker.update_state(loss)
        return {"loss": self.tracker.result(), "norm": norm}


@pytest.mark.skipif(BACKEND == "jax", reason="a TensorFlow and torch step (GradientTape, "
                    "backward); JAX's stateless step sees the whole batch")
@pytest.mark.parametrize("autograd", [False, *([True] if BACKEND == "torch" else [])])
@pytest.mark.parametrize("gpus", [3])
def test_a_step_that_clips_its_gradients_by_their_norm_equals_one_device(gpus, autograd):
    """TensorFlow all-reduces a step's gradients where its tape takes them, torch at the
    end of the step's backward pass or where `torch.autograd.grad` returns them, so the
    norm is one device's (each replica's norm was its own: weights 2.5e-2 from one device's
    on TensorFlow, 1.5e-2 on torch; through `torch.autograd.grad`, the second epoch's loss
    1.9e-2 from one device's)."""
    x, y = _data(47)
    runs = []
    for count in (None, gpus):
        keras.utils.set_random_seed(0)
        model = ClippedByItsNorm(autograd)
        target = model if count is None else kmg.multi_gpu_model(model, gpus=count)
        target.compile(optimizer=keras.optimizers.SGD(0.5),
                       loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        history = target.fit(x, y, batch_size=10, epochs=2, verbose=0, shuffle=False)
        runs.append((model, target, history.history))
    _assert_same(*runs)


class TripletDistances(keras.Model):
    """keras-io's Siamese network with a triplet loss: a model with its own `call` and
    `train_step`, fed (anchor, positive, negative) tuples (which Keras would unpack into x,
    y and sample weights to build it), whose loss is one value per row: the step takes the
    gradient of that vector (`summed=False`), or of its sum (`summed=True`)."""

    def __init__(self, summed):
        super().__init__()
        self.summed = summed
        self.embedding = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4)])
        self.tracker = keras.metrics.Mean(name="loss")

    def call(self, inputs):
        anchor, positive, negative = (self.embedding(x) for x in inputs)
        return (keras.ops.sum(keras.ops.square(anchor - positive), -1),
                keras.ops.sum(keras.ops.square(anchor - negative), -1))

    @property
    def metrics(self):
        return [self.tracker]

    def _loss(self, data):
        positive, negative = self(data)
        return keras.ops.maximum(positive - negative + 0.5, 0.0)

    def train_step(self, data):
        variables = self.embedding.trainable_weights
        if BACKEND == "torch":
            self.zero_grad()
            loss = self._loss(data)
            if self.summed:
                keras.ops.sum(loss).backward()
            else:
                loss.backward(keras.ops.ones_like(loss))
            grads = [v.value.grad for v in variables]
        else:
            import tensorflow as tf

            with tf.GradientTape() as tape:
                loss = self._loss(data)
                target = keras.ops.sum(loss) if self.summed else loss
            grads = tape.gradient(target, variables)
        self.optimizer.apply(grads, variables)
        self.tracker.update_state(loss)
        return {"loss": self.tracker.result()}

    def test_step(self, data):
        self.tracker.update_state(self._loss(data))
        return {"loss": self.tracker.result()}


class Triplets(keras.utils.PyDataset):
    def __init__(self, rows, batch_size):
        super().__init__()
        self.arrays = [_data(rows, seed)[0] for seed in range(3)]
        self.batch_size = batch_size

    def __len__(self):
        return -(-len(self.arrays[0]) // self.batch_size)

    def __getitem__(self, i):
        return tuple(a[i * self.batch_size:(i + 1) * self.batch_size] for a in self.arrays)


@pytest.mark.skipif(BACKEND == "jax", reason="a TensorFlow and torch step (GradientTape, "
                    "backward); JAX's stateless step sees the whole batch")
@pytest.mark.parametrize("summed", [False, True])
@pytest.mark.parametrize("gpus", [3])
def test_a_step_whose_loss_sums_its_rows_equals_one_device(gpus, summed):
    """The gradient of a per-row loss is of its sum over the rows: each replica's part of
    one device's, not a mean to weigh by k / n (each epoch's loss was 5.3 from one device's
    on TensorFlow, 32 on torch). On TensorFlow the model builds in its step, as on one
    device: Keras's guess of its input (the anchors alone) fails to build it. 26 rows in
    batches of 5 leave two replicas of the last batch without rows."""
    data = Triplets(26, 5)

    def make():
        model = TripletDistances(summed)
        if BACKEND == "torch":  # Keras's torch trainer builds it from the anchors first
            model(data[0])
        return model

    _assert_same(*_own_step_runs(gpus, make, 0.05, data))


class InputGradients(keras.Model):
    """A step that differentiates with respect to its inputs: an adversarial step (FGSM
    without the sign: the inputs moved along the gradient of the mean loss, then trained
    on beside the originals), or a gradient penalty (WGAN-GP's: each row's gradient of the
    prediction, its norm kept near 1, under a tape or `create_graph`)."""

    def __init__(self, mode):
        super().__init__()
        self.mode = mode
        self.network = keras.Sequential([keras.Input((6,)),
                                         keras.layers.Dense(8, activation="tanh"),
                                         keras.layers.Dense(3)])
        self.tracker = keras.metrics.Mean(name="loss")

    def call(self, x):
        return self.network(x)

    @property
    def metrics(self):
        return [self.tracker]

    def _loss(self, x, y):
        return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(
            y, self(x), from_logits=True))

    def _input_gradient(self, x, y):
        if BACKEND == "tensorflow":
            import tensorflow as tf

            with tf.GradientTape() as tape:
                tape.watch(x)
                target = self(x) if self.mode == "penalty" else self._loss(x, y)
            return tape.gradient(target, x)
        import torch

        x = x.detach().requires_grad_(True)
        if self.mode == "penalty":
            prediction = self(x)
            return torch.autograd.grad(prediction, x, torch.ones_like(prediction),
                                       create_graph=True)[0]
        loss = self._loss(x, y)
        if self.mode == "backward":
            loss.backward()
            return x.grad.detach()
        return torch.autograd.grad(loss, [x])[0]

    def _step_loss(self, x, y):
        gradient = self._input_gradient(x, y)
        if self.mode == "penalty":
            norm = keras.ops.sqrt(keras.ops.sum(keras.ops.square(gradient), axis=1) + 1e-12)
            return self._loss(x, y) + keras.ops.mean(keras.ops.square(norm - 1.0))
        moved = keras.ops.stop_gradient(x + 20.0 * gradient)
        return 0.5 * (self._loss(x, y) + self._loss(moved, y))

    def train_step(self, data):
        x, y = data
        variables = self.network.trainable_weights
        if BACKEND == "torch":
            self.zero_grad()
            loss = self._step_loss(x, y)
            self.zero_grad()  # the "backward" mode's first pass filled them
            loss.backward()
            grads = [v.value.grad for v in variables]
        else:
            import tensorflow as tf

            with tf.GradientTape() as tape:
                loss = self._step_loss(x, y)
            grads = tape.gradient(loss, variables)
        self.optimizer.apply(grads, variables)
        self.tracker.update_state(loss)
        return {"loss": self.tracker.result()}

    def test_step(self, data):
        self.tracker.update_state(self._loss(*data))
        return {"loss": self.tracker.result()}


class Labelled(keras.utils.PyDataset):
    def __init__(self, rows, batch_size):
        super().__init__()
        self.x, self.y = _data(rows)
        self.batch_size = batch_size

    def __len__(self):
        return -(-len(self.x) // self.batch_size)

    def __getitem__(self, i):
        rows = slice(i * self.batch_size, (i + 1) * self.batch_size)
        return self.x[rows], self.y[rows]


@pytest.mark.skipif(BACKEND == "jax", reason="a TensorFlow and torch step (GradientTape, "
                    "torch.autograd); JAX's stateless step sees the whole batch")
@pytest.mark.parametrize("mode", ["adversarial", "penalty",
                                  *(["backward"] if BACKEND == "torch" else [])])
@pytest.mark.parametrize("gpus", [3])
def test_a_step_that_differentiates_its_inputs_equals_one_device(gpus, mode):
    """The gradient of a mean loss with respect to a replica's rows is k / n of its own:
    one device divides by the batch's rows (weights 0.10 from one device's on TensorFlow,
    0.08 on torch, an adversarial step of 47 rows in batches of 10 on 3 devices). A
    per-row target's (a gradient penalty's) is each row's own. `backward` takes the input's
    `.grad` after a backward pass (torch alone). 26 rows in batches of 5 leave two replicas of
    the last batch without rows."""
    _assert_same(*_own_step_runs(gpus, lambda: InputGradients(mode), 0.1, Labelled(26, 5)))


class Contrastive(keras.Model):
    """keras-io's SimCLR pretraining, in small: its step compares every row's projection of
    one view with every row's of the other (`ops.matmul(z1, ops.transpose(z2))`, labels
    `arange(rows)`), in a loss of its own marked with `mixes_rows`, which also updates a
    contrastive accuracy; the step takes the gradient of its per-row values (SimCLR's, on
    TensorFlow's tape), of their mean, or of their sum."""

    def __init__(self, reduce):
        super().__init__()
        self.reduce = reduce
        self.encoder = keras.Sequential([keras.Input((6,)),
                                         keras.layers.Dense(8, activation="tanh"),
                                         keras.layers.Dense(4)])
        self.tracker = keras.metrics.Mean(name="loss")
        self.accuracy = keras.metrics.SparseCategoricalAccuracy(name="acc")

    def call(self, x):
        return self.encoder(x)

    @property
    def metrics(self):
        return [self.tracker, self.accuracy]

    @kmg.mixes_rows
    def contrastive_loss(self, z1, z2):
        z1, z2 = keras.ops.normalize(z1, axis=1), keras.ops.normalize(z2, axis=1)
        similarities = keras.ops.matmul(z1, keras.ops.transpose(z2)) / 0.5
        labels = keras.ops.arange(keras.ops.shape(z1)[0])
        self.accuracy.update_state(labels, similarities)
        return keras.losses.sparse_categorical_crossentropy(labels, similarities,
                                                            from_logits=True)

    def _loss(self, x):
        losses = self.contrastive_loss(self(x), self(keras.ops.flip(x, axis=1)))
        return {"rows": losses, "mean": keras.ops.mean(losses),
                "sum": keras.ops.sum(losses)}[self.reduce]

    def train_step(self, data):
        x, _ = data
        variables = self.trainable_variables
        if BACKEND == "torch":
            self.zero_grad()
            loss = self._loss(x)
            loss.backward()
            grads = [v.value.grad for v in variables]
        else:
            import tensorflow as tf

            with tf.GradientTape() as tape:
                loss = self._loss(x)
            grads = tape.gradient(loss, variables)
        self.optimizer.apply(grads, variables)
        self.tracker.update_state(keras.ops.mean(loss) if self.reduce == "rows" else loss)
        return {m.name: m.result() for m in self.metrics}

    def test_step(self, data):  # the mean: torch cannot tell a sum there (known gaps)
        self.tracker.update_state(keras.ops.mean(self.contrastive_loss(
            self(data[0]), self(keras.ops.flip(data[0], axis=1)))))
        return {m.name: m.result() for m in self.metrics}


@pytest.mark.skipif(BACKEND == "jax", reason="a TensorFlow and torch step (GradientTape, "
                    "backward); JAX's stateless step sees the whole batch, where the mark "
                    "changes nothing")
@pytest.mark.parametrize("reduce", ["mean", "sum", *(["rows"] if BACKEND == "tensorflow"
                                                     else [])])
@pytest.mark.parametrize("gpus", [3])
def test_a_contrastive_loss_marked_mixes_rows_equals_one_device(gpus, reduce):
    """A step's own loss that compares every row of the batch with every other, marked
    `mixes_rows`, runs on the gathered batch, and each replica keeps its rows' values
    (unmarked, each replica compares its own rows alone: in keras-io's SimCLR shape, 47
    rows in batches of 10 on 3 devices, the contrastive loss was 1.11 against one device's
    2.13 on TensorFlow, 1.07 against 2.08 on torch). The gradient of their sum, or of the
    per-row values themselves, crosses replicas through the gather weighed as the sum is.
    26 rows in batches of 5 leave two replicas of the last batch without rows."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "ops.matmul")  # marked, nothing warns
        runs = _own_step_runs(gpus, lambda: Contrastive(reduce), 0.1, Labelled(26, 5))
    _assert_same(*runs)


@pytest.mark.skipif(BACKEND == "jax", reason="JAX's step sees the whole batch")
@pytest.mark.parametrize("model, kind", [(lambda: Unmarked("mean"), "pairs"),
                                         (lambda: UnmarkedBarlow(), "sums over")])
@pytest.mark.parametrize("gpus", [2])
def test_an_unmarked_product_of_the_batchs_rows_warns(gpus, model, kind):
    """Unmarked, SimCLR's similarities (rows by rows) and Barlow Twins' cross-correlation
    (a sum over the rows) are each replica's own: `fit` says so, with the mark as the fix
    (TensorFlow's trace by its dynamic dimensions, torch's processes by their rows)."""
    with pytest.warns(UserWarning, match=f"ops.matmul {kind} the rows of the batch.*"
                      "@keras_multigpu.mixes_rows"):
        parallel = kmg.multi_gpu_model(model(), gpus=gpus)
        parallel.compile(optimizer="sgd")
        parallel.fit(Labelled(12, 6), epochs=1, verbose=0)


class Unmarked(Contrastive):
    def contrastive_loss(self, z1, z2):
        return Contrastive.contrastive_loss.__wrapped__(self, z1, z2)


@kmg.mixes_rows
def _centred(x):
    return x - keras.ops.mean(x, axis=0, keepdims=True)


class Centring(keras.Model):
    """A model whose `call` centres a hidden layer over the batch, in a function marked
    `mixes_rows` (not a layer)."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.head = keras.layers.Dense(3, activation="softmax")

    def call(self, x):
        return self.head(_centred(self.hidden(x)))


def _centring():
    keras.utils.set_random_seed(0)
    model = Centring()
    model(np.zeros((2, 6), "float32"))
    return model


@pytest.mark.parametrize("gpus", [3])
def test_a_function_marked_mixes_rows_in_call_equals_one_device(gpus):
    """A marked function that `call` runs sees the whole batch in `fit` and `predict`, as
    on one device (unmarked, 47 rows in batches of 10 on 3 devices: weights 0.03 from one
    device's on TensorFlow, 0.02 on torch)."""
    reference, run = (_train(count, 47, 10, build=_centring) for count in (None, gpus))
    _assert_same(reference, run)
    x = _data(47)[0]
    np.testing.assert_allclose(run[1].predict(x, batch_size=10, verbose=0),
                               reference[1].predict(x, batch_size=10, verbose=0),
                               rtol=RTOL, atol=ATOL)


class BarlowTwins(keras.Model):
    """keras-io's Barlow Twins, in small: its `compute_loss` standardises both views'
    embeddings over the batch and correlates them (a loss of the whole batch, not a mean
    over its rows), marked `mixes_rows`; Keras's own step calls it."""

    def __init__(self):
        super().__init__()
        self.encoder = keras.Sequential([keras.Input((6,)),
                                         keras.layers.Dense(8, activation="tanh"),
                                         keras.layers.Dense(5)])

    def call(self, x):
        return keras.ops.concatenate([self.encoder(x),
                                      self.encoder(keras.ops.flip(x, axis=1))], axis=1)

    @kmg.mixes_rows
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        def standardised(z):
            return (z - keras.ops.mean(z, axis=0)) / (keras.ops.std(z, axis=0) + 1e-5)

        za, zb = standardised(y_pred[:, :5]), standardised(y_pred[:, 5:])
        rows = keras.ops.cast(keras.ops.shape(za)[0], "float32")
        correlation = keras.ops.matmul(keras.ops.transpose(za), zb) / rows
        diagonal = keras.ops.diagonal(correlation)
        return (keras.ops.sum(keras.ops.square(diagonal - 1)) + 0.005 * (
            keras.ops.sum(keras.ops.square(correlation)) - keras.ops.sum(
                keras.ops.square(diagonal))))


class UnmarkedBarlow(BarlowTwins):
    def compute_loss(self, *args, **kwargs):
        return BarlowTwins.compute_loss.__wrapped__(self, *args, **kwargs)


@pytest.mark.parametrize("gpus", [3])
def test_a_compute_loss_marked_mixes_rows_equals_one_device(gpus):
    """A `compute_loss` of the whole batch (Barlow Twins' cross-correlation), marked
    `mixes_rows`, runs on the gathered batch: its one value is the batch's on every replica
    (unmarked, 47 rows in batches of 10 on 3 devices, the first epoch's loss was 4.09
    against one device's 2.08 on TensorFlow, 6.74 against 3.82 on torch). 26 rows in
    batches of 9 split 3, 3, 3 and then 3, 3, 2."""
    _assert_same(*_own_step_runs(gpus, BarlowTwins, 0.05, Labelled(26, 9)))


class MaskedCaptioner(keras.Model):
    """keras-io's image captioning, in small: its TensorFlow `train_step` takes the loss as
    a masked mean written by hand, a ratio of two sums over the batch (the tokens that are
    not padding), and so its accuracy; a loss tracker holds the first, the step returns
    the second as it is (with `divide_no_nan`)."""

    def __init__(self):
        super().__init__()
        self.embedding = keras.layers.Embedding(12, 8)
        self.head = keras.layers.Dense(12)
        self.tracker = keras.metrics.Mean(name="loss")

    def call(self, tokens):
        return self.head(self.embedding(tokens))

    @property
    def metrics(self):
        return [self.tracker]

    def train_step(self, data):
        import tensorflow as tf

        tokens, labels = data
        mask = keras.ops.cast(labels != 0, "float32")
        with tf.GradientTape() as tape:
            predicted = self(tokens, training=True)
            loss = keras.losses.sparse_categorical_crossentropy(labels, predicted,
                                                               from_logits=True)
            loss = keras.ops.sum(loss * mask) / keras.ops.sum(mask)
        variables = self.trainable_variables
        self.optimizer.apply(tape.gradient(loss, variables), variables)
        self.tracker.update_state(loss)
        hits = keras.ops.cast(keras.ops.equal(keras.ops.argmax(predicted, axis=-1),
                                              keras.ops.cast(labels, "int32")), "float32")
        return {"loss": self.tracker.result(),
                "acc": tf.math.divide_no_nan(keras.ops.sum(hits * mask), keras.ops.sum(mask))}


@pytest.mark.skipif(BACKEND != "tensorflow", reason="its step is written with a "
                    "tf.GradientTape; torch's graph does not tell a sum of the mask from a "
                    "constant (docs/engines.md#known-gaps)")
@pytest.mark.parametrize("batch_size", [10, 5, 3])
def test_a_step_whose_loss_is_a_ratio_of_sums_equals_one_device(batch_size):
    """A masked mean written by hand is the batch's ratio of sums, not each replica's
    ratio weighed by its rows: its gradient is weighed by each replica's share of the
    denominator, and its value, tracked or returned, is the batch's (weights were 0.05
    from one device's, 47 rows in batches of 10 on 3 devices). Batches of 5 leave a
    replica of the last batch (2 rows) without rows. Rows 1 and 7 are padding alone: in
    batches of 3, a replica's one row of them has a denominator of 0 and a NaN gradient,
    which is no part of one device's (every weight was NaN)."""
    rng = np.random.default_rng(10)
    tokens = rng.integers(1, 12, (47, 6))
    for row, length in enumerate(rng.integers(1, 7, 47)):
        tokens[row, length:] = 0  # padding
    tokens[[1, 7]] = 0
    labels = np.where(tokens > 0, np.maximum((tokens * 3) % 12, 1), 0)
    runs = []
    for count in (None, 3):
        keras.utils.set_random_seed(0)
        model = MaskedCaptioner()
        model(tokens[:1])
        target = model if count is None else kmg.multi_gpu_model(model, gpus=count)
        target.compile(optimizer=keras.optimizers.SGD(0.5))
        history = target.fit(tokens, labels, batch_size=batch_size, epochs=2, verbose=0,
                             shuffle=False).history
        runs.append((model, target, history))
    _assert_same(*runs)


class OwnLoss(keras.Model):
    """Keras's own `train_step`, with a `compute_loss` of the model's own: keras-io's BERT
    masked language model's sums its rows' losses ("sum"); a masked mean written by hand
    is a ratio of two sums ("ratio", the mask: targets above 0)."""

    def __init__(self, *args, kind="sum", **kwargs):
        super().__init__(*args, **kwargs)
        self.kind = kind

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, **kwargs):
        losses = keras.ops.square(y - y_pred)
        if self.kind == "sum":
            return keras.ops.sum(losses)
        mask = keras.ops.cast(y > 0, losses.dtype)
        return keras.ops.sum(losses * mask) / keras.ops.sum(mask)


@pytest.mark.parametrize("gpus", [3])
@pytest.mark.parametrize("kind", [
    "sum", "scaled", "regularized", pytest.param("ratio", marks=pytest.mark.skipif(
        BACKEND == "torch", reason="torch's graph does not tell a sum of the mask from a "
        "constant (docs/engines.md#known-gaps)"))])
def test_a_compute_loss_of_the_models_own_trains_and_logs_as_one_device(gpus, kind):
    """Keras's own step takes the gradient of what `compute_loss` returns, and its loss
    tracker the value. A sum over the rows is each replica's part of one device's sum, not
    a mean to weigh by k / n (torch's weights were 0.13 from one device's; the loss logged
    on TensorFlow and torch 1.43 where one device's is 3.12); a ratio of sums is the
    batch's ratio. Keras's own `compute_loss` sums its losses, here the compiled one and a
    regularizer's ("regularized"): two values, which are not rows where a replica has two
    (batches of 6). 10 rows in batches of 4 leave a replica of the last batch without rows;
    in batches of 3 (a row for each replica), the rows of the mask, 1, 5, 7 and 9, leave
    two replicas of each batch none of it (their ratio is 0/0: every weight was NaN on
    TensorFlow). A `LossScaleOptimizer` multiplies the sum by its scale before the backward
    pass ("scaled"), a product the engine's graph reading took for a mean (weights 0.09
    from one device's on TensorFlow, 0.13 on torch)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(10, 3)).astype("float32")
    y = np.abs(rng.normal(size=(10, 1))).astype("float32")
    y[[0, 2, 3, 4, 6, 8]] *= -1
    batch_size = {"sum": 4, "scaled": 4, "regularized": 6, "ratio": 3}[kind]
    runs = []
    for count in (None, gpus):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((3,))
        if kind == "regularized":
            model = keras.Model(inputs, keras.layers.Dense(1, kernel_regularizer="l2")(inputs))
        else:
            model = OwnLoss(inputs, keras.layers.Dense(1)(inputs),
                            kind="sum" if kind == "scaled" else kind)
        target = model if count is None else kmg.multi_gpu_model(model, gpus=count)
        optimizer = keras.optimizers.SGD(0.01)
        target.compile(optimizer=keras.optimizers.LossScaleOptimizer(optimizer)
                       if kind == "scaled" else optimizer,
                       loss="mse" if kind == "regularized" else None)
        history = target.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False,
                             validation_data=(x[:7], y[:7]), verbose=0).history
        history["predict"] = target.predict(x, batch_size=batch_size, verbose=0)
        history["evaluate"] = [target.evaluate(x, y, batch_size=batch_size, verbose=0)]
        runs.append((model, target, history))
    _assert_same(*runs)


class MaskedOwnLoss(keras.Model):
    """A `compute_loss` of the model's own that hands Keras's its arguments (a weighting
    step, say): the compiled loss reads the mask Keras keeps on the prediction."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, **kwargs):
        return 2.0 * super().compute_loss(x, y, y_pred, sample_weight, **kwargs)


@pytest.mark.parametrize("gpus", [3])
def test_a_compute_loss_of_the_models_own_keeps_the_predictions_mask(gpus):
    """Its `evaluate` and validation losses are one device's: the mask of padded time steps
    (`Masking`) reaches the compiled loss through the override, as in training."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(11, 5, 2)).astype("float32")
    x[rng.random((11, 5)) < 0.4] = 0.0  # masked time steps
    y = rng.normal(size=(11, 5, 1)).astype("float32")
    runs = []
    for count in (None, gpus):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((5, 2))
        outputs = keras.layers.Dense(1)(keras.layers.Masking(0.0)(inputs))
        model = MaskedOwnLoss(inputs, outputs)
        target = model if count is None else kmg.multi_gpu_model(model, gpus=count)
        target.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        history = target.fit(x, y, batch_size=4, epochs=2, shuffle=False,
                             validation_data=(x[:7], y[:7]), verbose=0).history
        history["evaluate"] = [target.evaluate(x, y, batch_size=4, verbose=0)]
        runs.append((model, target, history))
    _assert_same(*runs)


def _own_step_runs(gpus, make, learning_rate, x, **batching):
    """One device's run and `gpus` devices' of a model with its own steps (`make()`), each
    compiled with SGD alone, fit for two epochs unshuffled, then evaluated."""
    runs = []
    for count in (None, gpus):
        keras.utils.set_random_seed(0)
        model = make()
        target = model if count is None else kmg.multi_gpu_model(model, gpus=count)
        target.compile(optimizer=keras.optimizers.SGD(learning_rate))
        history = target.fit(x, epochs=2, verbose=0, shuffle=False, **batching).history
        history["evaluate"] = [target.evaluate(x, verbose=0, **batching)]
        runs.append((model, target, history))
    return runs


class TwoLosses(keras.Model):
    """A step of its own with two losses and two optimizers (a GAN's shape): the first loss
    goes through `scale_loss`, as Keras's own step hands its loss over, and its gradients
    are clipped before `apply` (new tensors); the second loss goes as it is."""

    def __init__(self):
        super().__init__()
        self.first, self.second = (
            keras.Sequential([keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])
            for _ in range(2))
        self.tracker = keras.metrics.Mean(name="loss")

    def call(self, x):
        return self.first(x) + self.second(x)

    def compile(self, first, second):
        super().compile()
        self.optimizers = first, second

    @property
    def metrics(self):
        return [self.tracker]

    def _loss(self, network, data):
        x, y = data
        return keras.ops.mean(keras.ops.square(network(x) - y))

    def train_step(self, data):
        losses = []
        for network, optimizer, scaled in zip((self.first, self.second), self.optimizers,
                                              (True, False)):
            variables = network.trainable_weights
            if BACKEND == "torch":
                self.zero_grad()
                losses.append(self._loss(network, data))
                (optimizer.scale_loss(losses[-1]) if scaled else losses[-1]).backward()
                grads = [v.value.grad for v in variables]
            else:
                import tensorflow as tf

                with tf.GradientTape() as tape:
                    losses.append(self._loss(network, data))
                    target = optimizer.scale_loss(losses[-1]) if scaled else losses[-1]
                grads = tape.gradient(target, variables)
            if scaled:
                grads = [keras.ops.clip(g, -0.05, 0.05) for g in grads]
            optimizer.apply(grads, variables)
        self.tracker.update_state(losses[0] + losses[1])
        return {"loss": self.tracker.result()}


@pytest.mark.skipif(BACKEND == "jax", reason="a TensorFlow and torch step (GradientTape, "
                    "backward); JAX's stateless step sees the whole batch")
@pytest.mark.parametrize("gpus", [3])
def test_a_step_that_scales_one_loss_and_not_another_equals_one_device(gpus):
    """A step of the user's own is weighed after its backward pass, whatever it hands to
    `scale_loss`: weighed before it there, the gradients it changes before `apply` (new
    tensors, which `apply` reduces again: the k / n it relies on was left out) came back R
    times one device's, and a second loss not scaled went unweighed (weights 0.64 from one
    device's on torch, 0.43 on TensorFlow, with the flag set for the whole step). 23 rows
    in batches of 4."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(23, 3)).astype("float32")
    y = rng.normal(size=(23, 1)).astype("float32")
    runs = []
    for count in (None, gpus):
        keras.utils.set_random_seed(0)
        model = TwoLosses()
        model(x[:2])
        target = model if count is None else kmg.multi_gpu_model(model, gpus=count)
        target.compile(keras.optimizers.SGD(0.1), keras.optimizers.SGD(0.1))
        history = target.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0).history
        runs.append((model, target, history))
    _assert_same(*runs)


class Denoiser(keras.Model):
    """keras-io's denoising diffusion model, in small: its `train_step` draws its noise and
    diffusion times with no seed (Keras's global seed generator), calls its loss as a
    function (one value per row), and moves an EMA copy of its network with `assign`."""

    def __init__(self):
        super().__init__()
        self.network = keras.Sequential([keras.Input((7,)), keras.layers.Dense(6)])
        self.ema_network = keras.models.clone_model(self.network)
        self.tracker = keras.metrics.Mean(name="noise_loss")

    def call(self, x):  # the denoised rows at diffusion time 0
        return self.ema_network(keras.ops.pad(x, [[0, 0], [0, 1]]))

    @property
    def metrics(self):
        return [self.tracker]

    def _noise_loss(self, x, network):
        rows = keras.ops.shape(x)[0]
        noises = keras.random.normal((rows, 6))
        times = keras.random.uniform((rows, 1))
        noisy = x * keras.ops.cos(times) + noises * keras.ops.sin(times)
        predicted = network(keras.ops.concatenate([noisy, times], axis=-1))
        return keras.losses.mean_absolute_error(noises, predicted)

    def train_step(self, data):
        x = data[0] if isinstance(data, tuple) else data
        variables = self.network.trainable_weights
        if BACKEND == "torch":
            self.zero_grad()
            loss = self._noise_loss(x, self.network)
            keras.ops.mean(loss).backward()
            grads = [v.value.grad for v in variables]
        else:
            import tensorflow as tf

            with tf.GradientTape() as tape:
                loss = self._noise_loss(x, self.network)
            grads = tape.gradient(loss, variables)
        self.optimizer.apply(grads, variables)
        self.tracker.update_state(loss)
        for weight, ema in zip(self.network.weights, self.ema_network.weights):
            ema.assign(0.9 * ema + 0.1 * weight)
        return {"noise_loss": self.tracker.result()}

    def test_step(self, data):
        self.tracker.update_state(self._noise_loss(data, self.ema_network))
        return {"noise_loss": self.tracker.result()}


@pytest.mark.skipif(BACKEND == "jax", reason="Keras's JAX trainer refuses a draw with no "
                    "seed in a traced step, on one device too")
@pytest.mark.parametrize("gpus", [3])
def test_draws_with_no_seed_in_a_step_equal_one_device(gpus):
    """On TensorFlow each replica's trace made Keras's global seed generator anew, in a
    thread of its own ("tf.function only supports singleton tf.Variables created on the
    first call"); now every replica draws from the main thread's, as one device does, and
    the EMA weights its step assigns are one device's. 26 rows in batches of 5."""
    _assert_same(*_own_step_runs(gpus, Denoiser, 0.1, _data(26)[0], batch_size=5))


class _DrawsAtEpochEnd(keras.callbacks.Callback):
    """A callback that draws with no seed, eagerly, between epochs (keras-io's diffusion
    model plots images generated from such noise)."""

    def __init__(self):
        super().__init__()
        self.drawn = []

    def on_epoch_end(self, epoch, logs=None):
        self.drawn.append(keras.ops.convert_to_numpy(keras.random.normal((3,))))


@pytest.mark.parametrize("draws", [False, True])
@pytest.mark.parametrize("gpus", [3])
def test_the_global_seed_generator_is_made_as_on_one_device(gpus, draws):
    """Keras makes its global seed generator at a draw with no seed, taking its seed from
    Python's `random`. The TensorFlow engine makes the main thread's before the call, for
    its replicas, with Python's `random` left as it was; the first draw (here a callback's,
    in the main thread) takes that number then, as one device does, and a call that never
    draws leaves no generator. Either way the draws, and Python's `random` after `fit`,
    are one device's."""
    import random

    from keras_multigpu._keras import global_state

    results = []
    for count in (None, gpus):
        keras.utils.set_random_seed(0)
        global_state.set_global_attribute("global_seed_generator", None)
        model = _dense_model()
        target = model if count is None else kmg.multi_gpu_model(model, gpus=count)
        _compile(target)
        callback = _DrawsAtEpochEnd()
        x, y = _data(26)
        target.fit(x, y, batch_size=5, epochs=2, verbose=0,
                   callbacks=[callback] if draws else [])
        made = global_state.get_global_attribute("global_seed_generator")
        results.append((callback.drawn, made is None, random.random()))
    (drawn, none, after), (ref_drawn, ref_none, ref_after) = results
    assert none == ref_none == (not draws)
    assert after == ref_after
    np.testing.assert_array_equal(np.asarray(drawn), np.asarray(ref_drawn))


class HalvedGradients(OwnStep):
    """Keras's torch step, with every gradient halved in place between the backward pass
    and `apply` (linear, so one device halves the same sums)."""

    def after_backward(self):
        for v in self.trainable_weights:
            v.value.grad.mul_(0.5)


@pytest.mark.parametrize("gpus", [3])
def test_mixed_float16_equals_one_device_where_nothing_overflows(gpus):
    """Keras's mixed_float16 wraps the optimizer in a LossScaleOptimizer, whose apply checks
    the gradients and picks a step or a skip with `ops.cond` (on TensorFlow it failed across
    replicas: "merge_call called while defining a new graph"). With a scale under which
    nothing overflows, every step is taken, as on one device, within float16's precision."""
    x, y = _data(29)
    results = []
    keras.config.set_dtype_policy("mixed_float16")
    try:
        for count in (None, gpus):
            model = _dense_model()
            target = model if count is None else kmg.multi_gpu_model(model, gpus=count)
            target.compile(optimizer=keras.optimizers.LossScaleOptimizer(
                keras.optimizers.SGD(0.1), initial_scale=64.0),
                loss="sparse_categorical_crossentropy")
            history = target.fit(x, y, batch_size=10, epochs=2, verbose=0, shuffle=False)
            results.append((model.get_weights(), history.history["loss"],
                            int(keras.ops.convert_to_numpy(target.optimizer.iterations))))
    finally:
        keras.config.set_dtype_policy("float32")
    (ref_weights, ref_loss, ref_steps), (weights, loss, steps) = results
    assert steps == ref_steps == 6  # no step skipped
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-3)
    for a, b in zip(ref_weights, weights):
        np.testing.assert_allclose(b, a, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("gpus", [3])
def test_mixed_float16_replicas_of_few_rows_skip_the_steps_one_device_skips(gpus):
    """Under mixed_float16 at Keras's own loss scale (2 ** 15), a replica weighs its loss by
    k / n before its backward pass, as one device's loss holds its rows: its float16
    gradients are then one device's. Weighed after it, a replica of one row in 4
    backpropagated 4 times one device's gradients, which overflowed float16 where one
    device's did not: the step was skipped and the scale halved (TensorFlow at the second
    step, torch at the sixth; weights 0.06 apart), and the gradient through
    BatchNormalization's moments, summed across replicas, has to follow the same weighing
    (the first step's kernel gradient was 0.02 off)."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(11, 5)).astype("float32"), rng.integers(0, 3, 11)

    def build():
        keras.utils.set_random_seed(1)
        inputs = keras.Input((5,))
        hidden = keras.layers.BatchNormalization()(keras.layers.Dense(8)(inputs))
        hidden = keras.layers.Dense(3)(keras.layers.Activation("relu")(hidden))
        return keras.Model(inputs, keras.layers.Activation("softmax", dtype="float32")(hidden))

    results = []
    keras.config.set_dtype_policy("mixed_float16")
    try:
        for count in (None, gpus):
            model = build()
            target = model if count is None else kmg.multi_gpu_model(model, gpus=count)
            target.compile(optimizer=keras.optimizers.SGD(0.1),
                           loss="sparse_categorical_crossentropy")
            history = target.fit(x, y, batch_size=4, epochs=3, verbose=0, shuffle=False)
            optimizer = target.optimizer
            results.append((model.get_weights(), history.history["loss"],
                            float(keras.ops.convert_to_numpy(optimizer.dynamic_scale)),
                            int(keras.ops.convert_to_numpy(optimizer.inner_optimizer.iterations))))
    finally:
        keras.config.set_dtype_policy("float32")
    (ref_weights, ref_loss, *ref_state), (weights, loss, *state) = results
    assert state == ref_state == [2.0 ** 15, 9]  # no step skipped, on either
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-3)
    for a, b in zip(ref_weights, weights):
        np.testing.assert_allclose(b, a, rtol=1e-3, atol=1e-3)


@pytest.mark.skipif(BACKEND != "torch", reason="torch's ranks check their gradients "
                    "themselves; one program checks the replicas' sum on the other engines")
@pytest.mark.parametrize("gpus", [2])
def test_mixed_precision_skips_an_overflowing_step_on_every_rank(gpus):
    """Under mixed_float16, Keras's LossScaleOptimizer skips a step whose gradients are not
    finite. One row that overflows float16 lies in rank 0's share of each epoch's first
    batch: every rank skips that step (they check the summed gradients, as one device
    checks its own), where a rank that skipped alone would leave the other waiting in the
    all-reduce. The other steps overlap their all-reduce, through the loss scaler's apply."""
    import torch.distributed as dist

    x, y = _data(99)
    x[3] = 1e5  # beyond float16's range
    launched = []
    all_reduce = dist.all_reduce

    def counted_all_reduce(*args, **kwargs):
        launched.append(bool(kwargs.get("async_op")))
        return all_reduce(*args, **kwargs)

    results = []
    keras.config.set_dtype_policy("mixed_float16")
    try:
        for g in (None, gpus):
            model = _dense_model()
            target = model if g is None else kmg.multi_gpu_model(model, gpus=g)
            _compile(target)
            assert isinstance(target.optimizer, keras.optimizers.LossScaleOptimizer)
            dist.all_reduce = counted_all_reduce
            try:
                history = target.fit(x, y, batch_size=25, epochs=2, verbose=0, shuffle=False)
            finally:
                dist.all_reduce = all_reduce
            results.append((model.get_weights(), history.history,
                            float(keras.ops.convert_to_numpy(target.optimizer.dynamic_scale))))
    finally:
        keras.config.set_dtype_policy("float32")
    assert sum(launched) == 2 * 4 - 1  # every step after the first overlaps
    (ref_w, ref_h, ref_scale), (w, h, scale) = results
    assert scale == ref_scale < 2.0 ** 15  # both halved it at the skipped steps
    for key in ref_h:
        np.testing.assert_allclose(h[key], ref_h[key], rtol=1e-2, err_msg=key)
    for a, b in zip(ref_w, w):
        np.testing.assert_allclose(b, a, rtol=1e-2, atol=1e-3)


class FailsOnce(OwnStep):
    """Keras's torch step, raising once after its backward pass has launched its buckets."""

    fail_at = 2

    def after_backward(self):
        FailsOnce.fail_at -= 1
        if FailsOnce.fail_at == 0:
            raise ValueError("this step fails on purpose")


@pytest.mark.skipif(BACKEND != "torch", reason="torch's engine reduces gradients in DDP's "
                    "buckets; the other engines all-reduce inside a traced step")
@pytest.mark.parametrize("gpus", [2])
def test_a_step_that_raises_after_its_buckets_leaves_the_group_usable(gpus):
    """The step's error reaches the caller (its launched buckets are not waited for), and
    the next call trains as one device does."""
    x, y = _data(99)
    keras.utils.set_random_seed(0)
    model = FailsOnce()
    target = kmg.multi_gpu_model(model, gpus=gpus)
    target.compile(optimizer=keras.optimizers.SGD(0.1))
    FailsOnce.fail_at = 2  # the second step: its buckets were launched during the backward
    with pytest.raises(ValueError, match="fails on purpose"):
        target.fit(x, y, batch_size=25, epochs=1, verbose=0, shuffle=False)
    keras.utils.set_random_seed(0)
    reference = FailsOnce()
    reference.compile(optimizer=keras.optimizers.SGD(0.1))
    reference(x[:1])  # built, to take the weights the failed call left
    reference.set_weights(model.get_weights())
    FailsOnce.fail_at = -1  # never again
    target.fit(x, y, batch_size=25, epochs=1, verbose=0, shuffle=False)
    reference.fit(x, y, batch_size=25, epochs=1, verbose=0, shuffle=False)
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=ATOL)


@pytest.mark.skipif(BACKEND != "torch", reason="torch's engine reduces gradients in DDP's "
                    "buckets; the other engines all-reduce inside a traced step")
@pytest.mark.parametrize("gpus", [2])
@pytest.mark.parametrize("step", ["keras", "changed_in_place"])
def test_the_gradient_all_reduce_overlaps_the_backward_pass(gpus, step):
    """Keras's own step: the first step all-reduces the gradients at `apply`, every later
    one in buckets launched during the backward pass. A step of the user's own (which may
    change the gradients after the backward pass) is all-reduced as its backward pass ends,
    and `apply` takes them as they are. Both equal one device."""
    import torch.distributed as dist

    from keras_multigpu.backends import torch as engine

    launched, at_apply = [], []
    all_reduce, flat_all_reduce = dist.all_reduce, engine._flat_all_reduce

    def counted_all_reduce(*args, **kwargs):
        launched.append(bool(kwargs.get("async_op")))
        return all_reduce(*args, **kwargs)

    def counted_flat(tensors, what, *args):
        at_apply.append(what == "all-reduce of the gradients")
        return flat_all_reduce(tensors, what, *args)

    x, y = _data(99)
    build = {"keras": _bn_model, "changed_in_place": HalvedGradients}[step]
    results = []
    for g in (None, gpus):
        keras.utils.set_random_seed(0)
        model = build()
        target = model if g is None else kmg.multi_gpu_model(model, gpus=g)
        if step == "keras":
            _compile(target)
        else:
            target.compile(optimizer=keras.optimizers.Adam(0.01))
        dist.all_reduce, engine._flat_all_reduce = counted_all_reduce, counted_flat
        try:
            history = target.fit(x, y, batch_size=25, epochs=2, verbose=0, shuffle=False)
        finally:
            dist.all_reduce, engine._flat_all_reduce = all_reduce, flat_all_reduce
        results.append((model.get_weights(), history.history))
    steps = 2 * 4
    if step == "keras":
        assert sum(at_apply) == 1 and sum(launched) == steps - 1  # one bucket a step
    else:
        assert sum(at_apply) == steps and sum(launched) == 0  # one at each backward pass
    (ref_w, ref_h), (w, h) = results
    for key in ref_h:
        np.testing.assert_allclose(h[key], ref_h[key], rtol=RTOL, atol=ATOL, err_msg=key)
    for a, b in zip(ref_w, w):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=ATOL)


@pytest.mark.skipif(BACKEND != "torch", reason="Keras's torch tree (torch's pytree)")
@pytest.mark.parametrize("gpus", [1, 2])
def test_a_steps_activations_are_freed_without_the_garbage_collector(gpus):
    """Keras 3.15's torch tree left every layer's inputs in a reference cycle (torch's
    `tree_flatten` holds its `is_leaf`, and Keras's refers to the structure): a step's
    activations stayed alive until a collection, and slowed every epoch. In our calls, a
    step leaves no tensor for the collector, on any Keras."""
    import gc

    import torch

    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    branches = [keras.layers.Dense(4, activation="relu")(inputs) for _ in range(2)]
    hidden = keras.layers.Concatenate()(branches)  # a layer whose inputs are a list
    model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(hidden))
    parallel = kmg.multi_gpu_model(model, gpus=gpus)
    _compile(parallel)
    x, y = _data(40)
    parallel.fit(x, y, batch_size=10, epochs=1, verbose=0)  # built, compiled
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection frees stays in gc.garbage
    try:
        parallel.fit(x, y, batch_size=10, epochs=2, verbose=0)
        parallel.predict(x, batch_size=10, verbose=0)
        gc.collect()
        tensors = [o for o in gc.garbage if isinstance(o, torch.Tensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert tensors == [], f"{len(tensors)} tensors were left to the garbage collector"


@pytest.mark.skipif(BACKEND != "torch", reason="torch.distributed, and Keras's torch trainer")
@pytest.mark.ranks(2)
def test_a_steps_logs_take_one_all_reduce_and_keras_wraps_nothing_in_ddp(monkeypatch):
    """The logs of a step are read with one all-reduce, however many metrics there are. The
    next Keras's torch trainer sums every metric variable itself, one all-reduce each, and
    wraps the model in DDP where torch.distributed runs: in our calls it does neither, and
    outside them the template runs in each process alone (one process may predict and
    evaluate by itself, as on Keras 3.15)."""
    import torch.distributed as dist

    x, y = _data(40)
    counts, calls = [], []
    all_reduce = dist.all_reduce

    def counted(*args, **kwargs):
        calls.append(1)
        return all_reduce(*args, **kwargs)

    for metrics in (["accuracy"], ["accuracy", keras.metrics.SparseCategoricalCrossentropy(),
                                   keras.metrics.SparseTopKCategoricalAccuracy(2)]):
        keras.utils.set_random_seed(0)
        model = _dense_model()
        parallel = kmg.multi_gpu_model(model, gpus=2)
        parallel.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=metrics)
        parallel.fit(x, y, batch_size=10, epochs=1, verbose=0)  # built, compiled
        calls.clear()
        with monkeypatch.context() as patch:
            patch.setattr(dist, "all_reduce", counted)
            history = parallel.fit(x, y, batch_size=10, epochs=2, verbose=0).history
        assert len(history) == 1 + len(metrics)
        counts.append(len(calls))
        assert getattr(parallel, "ddp_model", None) is None
        assert getattr(model, "ddp_model", None) is None
    assert counts[0] == counts[1], f"all-reduces in 8 steps with 1 and 3 metrics: {counts}"
    expected = parallel.evaluate(x, y, batch_size=10, verbose=0, return_dict=True)
    predicted = parallel.predict(x, batch_size=10, verbose=0)
    if dist.get_rank() == 0:  # the template alone, in one process: nothing waits for the other
        alone = model.evaluate(x, y, batch_size=10, verbose=0, return_dict=True)
        assert alone.keys() == expected.keys()
        for key in expected:
            np.testing.assert_allclose(alone[key], expected[key], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(model.predict(x, batch_size=10, verbose=0), predicted,
                                   rtol=RTOL, atol=ATOL)
        assert getattr(model, "ddp_model", None) is None
    dist.barrier()


@pytest.mark.ranks(3)
def test_callbacks_checkpoint_and_early_stopping(tmp_path):
    path = str(tmp_path / "best.keras")
    callbacks = [keras.callbacks.ModelCheckpoint(path, monitor="loss", save_best_only=True),
                 keras.callbacks.EarlyStopping(monitor="loss", patience=1)]
    model, target, history = _train(3, 99, 25, epochs=3, callbacks=callbacks)
    assert len(history["loss"]) == 3
    reloaded = keras.saving.load_model(path)
    assert not isinstance(reloaded, kmg.ParallelModel)
    x, _ = _data(99)
    np.testing.assert_allclose(reloaded.predict(x, verbose=0), model.predict(x, verbose=0),
                               rtol=RTOL, atol=ATOL)


@pytest.mark.ranks(2)
def test_device_monitor_times_this_engine_and_gathers_every_process(tmp_path):
    from keras_multigpu.callbacks import DeviceMonitor

    watch = DeviceMonitor(tmp_path / "mon", interval=0.05)
    _train(2, 99, 25, callbacks=[watch])
    found = watch.verdict
    assert found["evidence"]["steps"] == 7  # 2 epochs of 4 steps, the first one left out
    # Batch production, timed: on the training thread, or on tf.data's threads, which
    # TensorFlow's trainer pulls batches through (an upper bound on the wait).
    expected = "workers" if BACKEND == "tensorflow" else "dataset"
    assert found["evidence"]["data_measured"] == expected
    # An upper bound (tf.data's threads) is judged only below the threshold.
    assert found["input"] in (("no", "unknown") if expected == "workers" else
                              ("no", "moderately", "highly"))
    engine = backends.current()
    if engine.process_count() > 1:  # torch: one process per device
        assert [r["rank"] for r in watch.ranks] == [0, 1]  # every process's figures, everywhere
        assert all(r["steps"] == 7 and r["step_ms"] > 0 for r in watch.ranks)
    else:
        assert watch.ranks is None
    if engine.process_index() == 0:  # only process 0 writes
        names = {"steps.csv", "timeline.csv", "monitor.png"}
        if engine.process_count() > 1:
            names.add("ranks.csv")
        assert names <= {p.name for p in (tmp_path / "mon").iterdir()}


@pytest.mark.ranks(2)
def test_wrapping_twice_and_the_template_alone_after(tmp_path):
    model, target, _ = _train(2, 99, 25)
    again = kmg.multi_gpu_model(target, gpus=2 if BACKEND == "torch" else 3)
    assert again.template is model
    _compile(again)
    x, y = _data(99)
    again.fit(x, y, batch_size=25, epochs=1, verbose=0)
    # The user's model works on its own afterwards: predict, fit, save, load.
    expected = model.predict(x, verbose=0)
    _compile(model)
    model.fit(x, y, batch_size=25, epochs=1, verbose=0)
    model.save(tmp_path / "m.keras")
    np.testing.assert_allclose(keras.saving.load_model(tmp_path / "m.keras").predict(x, verbose=0),
                               model.predict(x, verbose=0), rtol=RTOL, atol=ATOL)
    assert expected.shape == (99, 3)


def test_a_global_keras_distribution_is_refused():
    if BACKEND != "jax":
        pytest.skip("keras.distribution exists on the JAX backend only")
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    try:
        with pytest.raises(RuntimeError, match="keras.distribution is set globally"):
            kmg.multi_gpu_model(_bn_model(), gpus=2)
    finally:
        keras.distribution.set_distribution(None)


def test_a_model_built_in_another_strategy_is_refused():
    if BACKEND != "tensorflow":
        pytest.skip("tf.distribute strategies exist on the TensorFlow backend only")
    import tensorflow as tf

    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    outside = _bn_model()
    with strategy.scope():
        inside = _bn_model()
        with pytest.raises(RuntimeError, match="outside any strategy.scope"):
            kmg.multi_gpu_model(outside, gpus=2)
    with pytest.raises(ValueError, match="built inside the scope of OneDeviceStrategy"):
        kmg.multi_gpu_model(inside, gpus=2)


def test_too_few_cpu_devices_after_start_says_what_to_do():
    """Asking for more virtual devices once the framework runs: a clear message."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["KERAS_MULTIGPU_CPU_DEVICES"] = "3"
    code = (
        "import keras, numpy as np\n"
        "keras.ops.convert_to_tensor(np.ones(2))\n"  # the framework starts: 1 CPU device
        "import keras_multigpu as kmg\n"
        "try:\n"
        "    kmg.multi_gpu_model(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]),"
        " gpus=3)\n"
        "except (RuntimeError, ValueError) as error:\n"
        "    print('ERROR', error)\n"
    )
    result = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env,
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    message = result.stdout.split("ERROR", 1)[1]
    if BACKEND == "torch":
        # One process per device: `python -c` cannot be relaunched, and the message says how.
        assert "keras-multigpu launch -n 3" in message
        return
    assert "KERAS_MULTIGPU_CPU_DEVICES" in message or "gpus=3" in message


OTHER = {"jax": "tensorflow", "tensorflow": "jax", "torch": "jax"}.get(BACKEND)

LOAD = r"""
import json, sys
import numpy as np
import keras
model = keras.saving.load_model(sys.argv[1])
x = np.load(sys.argv[2])
np.save(sys.argv[3], model.predict(x, verbose=0))
print(json.dumps({"backend": keras.backend.backend()}))
"""


@pytest.mark.skipif(OTHER is None, reason="no other backend to load into")
@pytest.mark.ranks(2)
def test_a_saved_model_loads_under_the_other_backend(tmp_path):
    pytest.importorskip(OTHER)
    model, target, _ = _train(2, 99, 25)
    x, _ = _data(20)
    target.save(tmp_path / "m.keras")
    np.save(tmp_path / "x.npy", x)
    env = {k: v for k, v in os.environ.items()
           if k not in ("KERAS_MULTIGPU_CPU_DEVICES", "XLA_FLAGS")}
    env["KERAS_BACKEND"] = OTHER
    result = subprocess.run(
        [sys.executable, "-c", LOAD, str(tmp_path / "m.keras"), str(tmp_path / "x.npy"),
         str(tmp_path / "out.npy")], env=env, capture_output=True, text=True, timeout=300,
        check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1])["backend"] == OTHER
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), model.predict(x, verbose=0),
                               rtol=1e-5, atol=1e-6)


def test_the_engine_module_is_the_backend():
    assert backends.current().__name__ == f"keras_multigpu.backends.{BACKEND}"
    assert all(callable(getattr(backends.current(), name)) for name in backends.API)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's tf.distribute strategies")
def test_tensorflows_default_device_trains_without_a_strategy():
    """Any strategy, OneDeviceStrategy too, halves `fit` on one CPU device
    (benchmarks/tf_one_device.py): on the device TensorFlow places on anyway, the engine
    runs none, and the model's variables are never swapped; another lone device keeps a
    MirroredStrategy that places the step there."""
    import tensorflow as tf

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    behind = [v.value for v in model.variables]  # the tf.Variables behind each variable
    one = kmg.multi_gpu_model(model, gpus=1)
    assert not isinstance(one._distribution.strategy, tf.distribute.MirroredStrategy)
    one.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((8, 4), "float32"), np.zeros((8, 3), "float32")
    one.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert all(v.value is b for v, b in zip(model.variables, behind))
    other = kmg.multi_gpu_model(model, gpus=[1])
    assert isinstance(other._distribution.strategy, tf.distribute.MirroredStrategy)
    assert other._distribution.strategy.extended.worker_devices[0].endswith("CPU:1")
