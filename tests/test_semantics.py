"""A Keras program keeps its meaning through the wrapper: the model's own steps and hooks,
names, training flags, BatchNorm in padded steps, shuffling and gradient accumulation.

Every comparison is against plain Keras on one device, with batches that leave padded steps
on the devices used (float32; 1e-5 relative unless a test says why). The tests run on every
engine: the models' own steps are written in each backend's style, as Keras's guides write
them, and on torch each test runs in TORCH_WORLD processes (see conftest).
"""

import random
import warnings

import keras
import numpy as np
import pytest
from keras import layers, ops

import keras_multigpu as kmg
from conftest import (
    TORCH_WORLD,
    assert_weights_close,
    classification_data,
    comparable_keys,
    engine_gpus,
    stateful_model,
)

BACKEND = keras.backend.backend()
pytestmark = pytest.mark.ranks(TORCH_WORLD)


def _fit_both(build, compile_fn, fit_kwargs, gpus, seed=0):
    """(plain model, plain history, template, ParallelModel, history), both from `seed`."""
    keras.utils.set_random_seed(seed)
    plain = build()
    compile_fn(plain)
    expected = plain.fit(verbose=0, **fit_kwargs)
    keras.utils.set_random_seed(seed)
    template = build()
    parallel = kmg.multi_gpu_model(template, gpus=engine_gpus(gpus))
    compile_fn(parallel)
    history = parallel.fit(verbose=0, **fit_kwargs)
    return plain, expected, template, parallel, history


def _assert_history_close(a, b, rtol=1e-5):
    assert a.history.keys() == b.history.keys()
    for key in comparable_keys(a.history, a.model):
        np.testing.assert_allclose(b.history[key], a.history[key], rtol=rtol, atol=1e-7,
                                   err_msg=key)


# -- the model's own steps and hooks -----------------------------------------------------


class OwnStep(keras.Model):
    """A train_step with its own loss and tracker, in the backend's own style (Keras's
    "customizing what happens in fit" guides); compile gets an optimizer only."""

    traces = 0

    def __init__(self):
        super().__init__()
        self.hidden = layers.Dense(8, activation="tanh")
        self.out = layers.Dense(1)
        self.tracker = keras.metrics.Mean(name="own_loss")

    def call(self, x):
        return self.out(self.hidden(x))

    @property
    def metrics(self):
        return [self.tracker]

    if BACKEND == "jax":
        def _loss(self, trainable, non_trainable, x, y):
            y_pred, non_trainable = self.stateless_call(trainable, non_trainable, x)
            return ops.mean(ops.square(y_pred - y)), non_trainable

        def train_step(self, state, data):
            import jax

            OwnStep.traces += 1
            trainable, non_trainable, optimizer_vars, metric_vars = state
            x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
            (loss, non_trainable), grads = jax.value_and_grad(self._loss, has_aux=True)(
                trainable, non_trainable, x, y
            )
            trainable, optimizer_vars = self.optimizer.stateless_apply(optimizer_vars, grads,
                                                                       trainable)
            metric_vars = self.tracker.stateless_update_state(metric_vars, loss)
            logs = {"own_loss": self.tracker.stateless_result(metric_vars)}
            return logs, (trainable, non_trainable, optimizer_vars, metric_vars)

    elif BACKEND == "tensorflow":
        def train_step(self, data):
            import tensorflow as tf

            OwnStep.traces += 1
            x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
            with tf.GradientTape() as tape:
                loss = ops.mean(ops.square(self(x, training=True) - y))
            grads = tape.gradient(loss, self.trainable_weights)
            self.optimizer.apply(grads, self.trainable_weights)
            self.tracker.update_state(loss)
            return {"own_loss": self.tracker.result()}

    else:
        def train_step(self, data):
            import torch

            OwnStep.traces += 1
            x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
            self.zero_grad()
            loss = ops.mean(ops.square(self(x, training=True) - y))
            loss.backward()
            grads = [v.value.grad for v in self.trainable_weights]
            with torch.no_grad():
                self.optimizer.apply(grads, self.trainable_weights)
            self.tracker.update_state(loss)
            return {"own_loss": self.tracker.result()}


def _built(model, features=6):
    model(np.zeros((1, features), "float32"))
    return model


def test_own_train_step_runs_and_equals_one_device():
    x, _ = classification_data(53)
    y = x[:, :1] * 2.0
    OwnStep.traces = 0
    plain, expected, template, parallel, history = _fit_both(
        lambda: _built(OwnStep()), lambda m: m.compile(optimizer="adam"),
        {"x": x, "y": y, "batch_size": 10, "epochs": 2}, gpus=3,
    )
    assert OwnStep.traces >= 2  # run (or traced) for the plain model and for the wrapper
    assert list(history.history) == ["own_loss"]
    assert history.history["own_loss"][0] > 0
    _assert_history_close(expected, history)
    assert_weights_close(plain.get_weights(), template.get_weights())


class BadStep(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = layers.Dense(1)

    def call(self, x):
        return self.dense(x)

    if BACKEND == "jax":
        def train_step(self, state, data):
            return 0.0, state  # logs must be a dict
    else:
        def train_step(self, data):
            return 0.0


def test_a_step_returning_no_dict_is_refused_clearly():
    parallel = kmg.multi_gpu_model(_built(BadStep()), gpus=engine_gpus(2))
    parallel.compile(optimizer="sgd")
    x, _ = classification_data(8)
    with pytest.raises(TypeError, match=r"BadStep\.train_step must return its logs as a dict"):
        parallel.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0)


class Hooks(keras.Model):
    """Overrides compute_loss and compute_metrics, adds a loss in call, has a regularizer
    and an extra tracker in `metrics`."""

    def __init__(self):
        super().__init__()
        self.dense = layers.Dense(3, activation="softmax",
                                  kernel_regularizer=keras.regularizers.L2(0.01))
        self.penalty = keras.metrics.Mean(name="penalty")

    def call(self, x):
        self.add_loss(0.1 * ops.mean(ops.square(x)))
        return self.dense(x)

    @property
    def metrics(self):
        return [*super().metrics, self.penalty]

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training=training)
        return loss + 0.01 * ops.mean(ops.abs(y_pred))

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        self.penalty.update_state(ops.max(y_pred, axis=-1), sample_weight=sample_weight)
        return super().compute_metrics(x, y, y_pred, sample_weight)


def test_template_hooks_run_as_on_one_device():
    x, y = classification_data(47)
    weights = np.random.default_rng(5).uniform(0.2, 2.0, 47).astype("float32")

    def compile_fn(model):
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="categorical_crossentropy",
                      metrics=["accuracy"])

    plain, expected, template, _, history = _fit_both(
        lambda: _built(Hooks()), compile_fn,
        {"x": x, "y": y, "sample_weight": weights, "batch_size": 10, "epochs": 2,
         "validation_data": (x[:13], y[:13])},
        gpus=4,
    )
    assert {"penalty", "val_penalty", "accuracy"} <= set(history.history)
    _assert_history_close(expected, history)
    assert_weights_close(plain.get_weights(), template.get_weights())


class OwnPredict(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = layers.Dense(2)

    def call(self, x):
        return self.dense(x)

    if BACKEND == "jax":
        def predict_step(self, state, data):
            outputs, non_trainable = super().predict_step(state, data)
            return {"logits": outputs, "twice": 2.0 * outputs}, non_trainable
    else:
        def predict_step(self, data):
            outputs = super().predict_step(data)
            return {"logits": outputs, "twice": 2.0 * outputs}


def test_own_predict_step_runs_on_every_row():
    x, _ = classification_data(11)
    keras.utils.set_random_seed(0)  # the same weights in every process (torch's)
    template = _built(OwnPredict())
    expected = template.predict(x, batch_size=4, verbose=0)
    got = kmg.multi_gpu_model(template, gpus=engine_gpus(3)).predict(x, batch_size=4,
                                                               verbose=0)
    assert set(got) == {"logits", "twice"}
    for key in expected:
        assert got[key].shape == (11, 2)
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-5, atol=1e-6)


# -- names ------------------------------------------------------------------------------


def _ticket_model():
    title = keras.Input((5,), name="title")
    tags = keras.Input((3,), name="tags")
    hidden = layers.Dense(8, activation="relu")(layers.concatenate([title, tags]))
    priority = layers.Dense(1, name="priority")(hidden)
    department = layers.Dense(4, name="department")(hidden)
    return keras.Model([title, tags], [priority, department])


def _ticket_data(n=41):
    rng = np.random.default_rng(9)
    x = {"title": rng.normal(size=(n, 5)).astype("float32"),
         "tags": rng.integers(0, 2, (n, 3)).astype("float32")}
    y = {"priority": rng.random((n, 1)).astype("float32"),
         "department": keras.utils.to_categorical(rng.integers(0, 4, n), 4)}
    return x, y


def _compile_ticket(model):
    model.compile(
        optimizer=keras.optimizers.RMSprop(1e-3),
        loss={"priority": keras.losses.BinaryCrossentropy(from_logits=True),
              "department": keras.losses.CategoricalCrossentropy(from_logits=True)},
        loss_weights={"priority": 1.0, "department": 0.2},
        metrics={"department": ["accuracy"]},
    )


def test_named_outputs_with_dict_targets_and_loss_weights():
    x, y = _ticket_data()
    plain, expected, template, parallel, history = _fit_both(
        _ticket_model, _compile_ticket, {"x": x, "y": y, "batch_size": 10, "epochs": 2},
        gpus=3,
    )
    assert parallel.output_names == template.output_names == ["priority", "department"]
    assert {"loss", "priority_loss", "department_loss", "department_accuracy"} == set(
        history.history
    )
    _assert_history_close(expected, history)
    assert_weights_close(plain.get_weights(), template.get_weights())
    assert parallel.metrics_names == template.metrics_names
    evaluated = parallel.evaluate(x, y, batch_size=10, verbose=0, return_dict=True)
    reference = plain.evaluate(x, y, batch_size=10, verbose=0, return_dict=True)
    assert evaluated.keys() == reference.keys()
    for key in comparable_keys(reference, plain):
        np.testing.assert_allclose(evaluated[key], reference[key], rtol=1e-5, err_msg=key)


def test_dict_keys_that_name_nothing_are_refused():
    x, y = _ticket_data(8)
    parallel = kmg.multi_gpu_model(_ticket_model(), gpus=engine_gpus(2))
    _compile_ticket(parallel)
    with pytest.raises(ValueError, match=r"x is a dict with key\(s\) \['titel'\] that name no "
                                         r"input.*\['title', 'tags'\]"):
        parallel.fit({"titel": x["title"], "tags": x["tags"]}, y, verbose=0)
    with pytest.raises(ValueError, match=r"y is a dict with key\(s\) \['prio'\].*output"):
        parallel.fit(x, {"prio": y["priority"], "department": y["department"]}, verbose=0)


# -- the training flag -------------------------------------------------------------------


class NoTrainingArg(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = layers.Dense(6)
        self.norm = layers.BatchNormalization()
        self.drop = layers.Dropout(0.5)
        self.out = layers.Dense(3, activation="softmax")

    def call(self, x):
        return self.out(self.drop(self.norm(self.dense(x))))


class TrainingArg(NoTrainingArg):
    def call(self, x, training=None):
        return self.out(self.drop(self.norm(self.dense(x), training=training),
                                  training=training))


class TrainingDefaultFalse(NoTrainingArg):
    def call(self, x, training=False):
        return self.out(self.drop(self.norm(self.dense(x), training=training),
                                  training=training))


@pytest.mark.parametrize("cls, trains", [(NoTrainingArg, False), (TrainingArg, True),
                                         (TrainingDefaultFalse, True)])
def test_the_training_flag_reaches_layers_as_keras_passes_it(cls, trains):
    x, y = classification_data(37)
    x = x * 5.0 + 3.0  # far from BatchNorm's initial statistics

    def compile_fn(model):
        model.compile(optimizer="sgd", loss="categorical_crossentropy")

    plain, expected, template, _, history = _fit_both(
        lambda: _built(cls()), compile_fn, {"x": x, "y": y, "batch_size": 10, "epochs": 2},
        gpus=3,
    )
    moving_mean = template.norm.moving_mean.numpy()
    assert np.allclose(moving_mean, 0.0) != trains  # inference mode leaves it at 0
    np.testing.assert_allclose(moving_mean, plain.norm.moving_mean.numpy(), rtol=1e-5,
                               atol=1e-6)
    _assert_history_close(expected, history)
    assert_weights_close(plain.get_weights(), template.get_weights())


# -- BatchNormalization in padded steps ----------------------------------------------------


def _conv_bn():
    return keras.Sequential([
        keras.Input((16, 3)),
        layers.Conv1D(8, 3, padding="same"),
        layers.BatchNormalization(),
        layers.ReLU(),
        layers.GlobalAveragePooling1D(),
        layers.Dense(3, activation="softmax"),
    ])


@pytest.mark.parametrize("samples, batch, gpus, epochs",
                         [(99, 32, 4, 3), (100, 25, 2, 2), (100, 25, 3, 2)],
                         ids=["99-by-32-on-4", "every-step-padded-on-2", "every-step-padded-on-3"])
def test_batchnorm_in_padded_steps_equals_one_device(samples, batch, gpus, epochs):
    x, y = classification_data(samples, features=(16, 3))

    def compile_fn(model):
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                      loss="categorical_crossentropy", metrics=["accuracy"])

    plain, expected, template, _, history = _fit_both(
        _conv_bn, compile_fn, {"x": x, "y": y, "batch_size": batch, "epochs": epochs}, gpus,
    )
    for ref, got in zip(plain.layers[1].weights, template.layers[1].weights):
        np.testing.assert_allclose(got.numpy(), ref.numpy(), rtol=1e-5, atol=1e-6,
                                   err_msg=ref.path)  # gamma, beta and moving statistics
    assert_weights_close(plain.get_weights(), template.get_weights())
    _assert_history_close(expected, history)


# -- shuffling ---------------------------------------------------------------------------


class Numbered(keras.utils.PyDataset):
    def __init__(self, x, y, batch):
        super().__init__()
        self.x, self.y, self.batch = x, y, batch

    def __len__(self):
        return -(-len(self.x) // self.batch)

    def __getitem__(self, i):
        s = slice(i * self.batch, (i + 1) * self.batch)
        return self.x[s], self.y[s]


def _dense():
    return keras.Sequential([keras.Input((6,)), layers.Dense(8, activation="tanh"),
                             layers.Dense(3, activation="softmax")])


def _compile_sgd(model):
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="categorical_crossentropy",
                  metrics=["accuracy"])


@pytest.mark.parametrize("shuffle, as_py_dataset", [(True, False), ("batch", False),
                                                    (True, True)],
                         ids=["arrays", "arrays-batch", "py-dataset"])
def test_shuffling_equals_keras_under_a_seed(shuffle, as_py_dataset):
    x, y = classification_data(43)
    data = {"x": Numbered(x, y, 10)} if as_py_dataset else {"x": x, "y": y, "batch_size": 10}
    plain, expected, template, _, history = _fit_both(
        _dense, _compile_sgd, {**data, "epochs": 3, "shuffle": shuffle}, gpus=3, seed=21,
    )
    _assert_history_close(expected, history)
    assert_weights_close(plain.get_weights(), template.get_weights())


def test_shuffling_moves_the_global_generators_as_keras_does():
    x, y = classification_data(43)
    draws = []
    for wrap in (False, True):
        keras.utils.set_random_seed(4)
        model = _dense()
        target = kmg.multi_gpu_model(model, gpus=engine_gpus(2)) if wrap else model
        _compile_sgd(target)
        target.fit(x, y, batch_size=10, epochs=2, verbose=0)
        target.fit(x, y, batch_size=10, epochs=1, verbose=0)  # a second call draws on
        draws.append((np.random.random(), random.random()))
    assert draws[0] == draws[1]


# -- gradient accumulation ----------------------------------------------------------------


def test_gradient_accumulation_equals_one_device():
    x, y = classification_data(61)

    def compile_fn(model):
        model.compile(optimizer=keras.optimizers.SGD(0.1, gradient_accumulation_steps=3),
                      loss="categorical_crossentropy", metrics=["accuracy"])

    plain, expected, template, _, history = _fit_both(
        _dense, compile_fn, {"x": x, "y": y, "batch_size": 10, "epochs": 3}, gpus=4,
    )
    assert int(plain.optimizer.iterations) == int(template.optimizer.iterations) == 7
    _assert_history_close(expected, history)
    assert_weights_close(plain.get_weights(), template.get_weights())


def test_gradient_accumulation_below_one_is_refused():
    optimizer = keras.optimizers.SGD()
    optimizer.gradient_accumulation_steps = 0  # Keras's constructor lets 0 through as "off"
    parallel = kmg.multi_gpu_model(_dense(), gpus=engine_gpus(2))
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps must be None or an "
                                         r"integer >= 2.*Received: gradient_accumulation_steps=0"):
        parallel.compile(optimizer=optimizer, loss="categorical_crossentropy")


# -- losses --------------------------------------------------------------------------------


def test_outputs_with_different_reductions_equal_one_device():
    def build():
        inputs = keras.Input((6,))
        hidden = layers.Dense(8, activation="tanh")(inputs)
        return keras.Model(inputs, [layers.Dense(3, name="a")(hidden),
                                    layers.Dense(2, name="b")(hidden)])

    def compile_fn(model):
        model.compile(optimizer="sgd", loss=[
            keras.losses.MeanSquaredError(reduction="sum"),
            keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"),
        ])

    x, _ = classification_data(29)
    y = [x[:, :3], x[:, 3:5]]
    weights = np.random.default_rng(1).uniform(0.5, 2.0, 29).astype("float32")
    plain, expected, template, _, history = _fit_both(
        build, compile_fn, {"x": x, "y": y, "sample_weight": weights, "batch_size": 10,
                            "epochs": 2}, gpus=3,
    )
    _assert_history_close(expected, history)
    assert_weights_close(plain.get_weights(), template.get_weights())


def test_a_loss_returning_its_own_mean_with_class_weights_equals_one_device():
    """A custom loss that takes its own mean returns one value for the batch; Keras
    multiplies it by the class (sample) weights, so one device's loss is that mean times
    the mean of the whole batch's weights."""

    def loss(y_true, y_pred):
        return ops.mean(keras.losses.categorical_crossentropy(y_true, y_pred))

    def compile_fn(model):
        model.compile(optimizer="sgd", loss=loss, metrics=["accuracy"])

    x, y = classification_data(29)
    plain, expected, template, _, history = _fit_both(
        _dense, compile_fn, {"x": x, "y": y, "class_weight": {0: 0.5, 1: 2.0, 2: 1.0},
                             "batch_size": 10, "epochs": 2}, gpus=3,
    )
    _assert_history_close(expected, history)
    assert_weights_close(plain.get_weights(), template.get_weights())


@pytest.mark.parametrize("labels", ["sparse", "one_hot"])
def test_a_column_of_sample_weights_equals_one_device(labels):
    """Weights of shape (rows, 1), a DataFrame's `df[["w"]].values`: Keras squeezes the
    axis of one, for sparse labels of shape (rows,) and one-hot ones alike."""

    def compile_fn(model):
        model.compile(optimizer=keras.optimizers.SGD(0.1), metrics=["accuracy"],
                      loss=f"{'sparse_' if labels == 'sparse' else ''}categorical_crossentropy")

    x, y = classification_data(29)
    if labels == "sparse":
        y = np.argmax(y, axis=1)
    weights = np.random.default_rng(1).uniform(0.5, 2.0, (29, 1)).astype("float32")
    plain, expected, template, _, history = _fit_both(
        _dense, compile_fn, {"x": x, "y": y, "sample_weight": weights, "batch_size": 10,
                             "epochs": 2}, gpus=3,
    )
    _assert_history_close(expected, history)
    assert_weights_close(plain.get_weights(), template.get_weights())


# -- compile ---------------------------------------------------------------------------------


def test_compiling_the_template_after_wrapping_is_seen():
    x, y = classification_data(20)
    histories = []
    for wrap in (False, True):
        keras.utils.set_random_seed(3)
        template = _dense()
        target = kmg.multi_gpu_model(template, gpus=engine_gpus(2)) if wrap else template
        template.compile(optimizer="sgd", loss="categorical_crossentropy", metrics=["accuracy"])
        first = target.fit(x, y, batch_size=7, epochs=1, verbose=0).history
        template.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse",
                         metrics=["mae"])
        second = target.fit(x, y, batch_size=7, epochs=1, verbose=0).history
        histories.append((first, second, template.get_weights()))
    (first, second, weights), (p_first, p_second, p_weights) = histories
    assert set(p_first) == {"loss", "accuracy"} and set(p_second) == {"loss", "mae"}
    for expected, got in ((first, p_first), (second, p_second)):
        for key in expected:
            np.testing.assert_allclose(got[key], expected[key], rtol=1e-5)
    assert_weights_close(weights, p_weights)


def test_unfreezing_and_recompiling_trains_the_unfrozen_layers_as_one_device():
    """Keras's transfer-learning guide: train a head on a frozen base (BatchNorm inside),
    then set `base.trainable = True`, compile again and fine-tune. On TensorFlow the frozen
    base's variables had per-replica twins the gradient tape does not watch, and the
    unfrozen base did not train at all."""
    x, y = classification_data(29)
    results = []
    for wrap in (False, True):
        keras.utils.set_random_seed(5)
        base = keras.Sequential([keras.Input((6,)), layers.Dense(5), layers.BatchNormalization(),
                                 layers.Activation("relu")], name="base")
        base.trainable = False
        inputs = keras.Input((6,))
        template = keras.Model(inputs, layers.Dense(3, activation="softmax")(
            base(inputs, training=False)))
        target = kmg.multi_gpu_model(template, gpus=engine_gpus(3)) if wrap else template
        frozen = [np.copy(w) for w in base.get_weights()]
        target.compile(optimizer="sgd", loss="categorical_crossentropy")
        target.fit(x, y, batch_size=10, epochs=1, verbose=0)
        assert_weights_close(frozen, base.get_weights(), atol=0)
        base.trainable = True
        target.compile(optimizer=keras.optimizers.SGD(0.1), loss="categorical_crossentropy")
        history = target.fit(x, y, batch_size=10, epochs=2, verbose=0).history
        kernel = base.get_weights()[0]
        assert np.max(np.abs(kernel - frozen[0])) > 1e-3, "the unfrozen base did not train"
        results.append((history, template.get_weights()))
    (expected, weights), (history, p_weights) = results
    np.testing.assert_allclose(history["loss"], expected["loss"], rtol=1e-5)
    assert_weights_close(weights, p_weights)


def test_a_stateful_rnn_trains_as_on_one_device_where_a_step_sees_the_whole_batch():
    """JAX: a stateful LSTM's state, one row per sample of its fixed batch, carries from
    batch to batch as on one device, with 6 rows on 4 devices (padded); other engines
    refuse it (test_errors)."""
    from keras_multigpu import backends

    if not backends.has(backends.current(), "whole_batch"):
        pytest.skip("each device sees its share of the batch: refused (test_errors)")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(24, 5, 3)).astype("float32")
    y = rng.normal(size=(24, 1)).astype("float32")
    plain, expected, template, parallel, history = _fit_both(
        stateful_model, lambda m: m.compile(optimizer="sgd", loss="mse"),
        {"x": x, "y": y, "batch_size": 6, "epochs": 2, "shuffle": False}, gpus=4)
    _assert_history_close(expected, history)
    assert_weights_close(plain.get_weights(), template.get_weights())


def test_a_layer_frozen_without_a_compile_does_what_keras_does():
    """A layer frozen between two fits without a compile: Keras's backends differ, and ours
    does what the backend's Keras does. TensorFlow's traced step keeps the trainable
    variables it was traced with and trains the layer on (a twin made again at once, not at
    the next compile, had kept the trained values in the old twin: the training was lost);
    torch's eager step freezes it at once; JAX's refuses (its optimizer no longer fits).
    A compile then freezes it everywhere."""
    x, y = classification_data(29)
    results = []
    for wrap in (False, True):
        keras.utils.set_random_seed(6)
        template = _dense()
        target = kmg.multi_gpu_model(template, gpus=engine_gpus(3)) if wrap else template
        target.compile(optimizer="sgd", loss="categorical_crossentropy")
        target.fit(x, y, batch_size=10, epochs=1, verbose=0)
        first = template.layers[0]
        first.trainable = False
        before = np.copy(first.get_weights()[0])
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Keras may warn that it needs a compile
                target.fit(x, y, batch_size=10, epochs=1, verbose=0)
            outcome = np.copy(first.get_weights()[0])
        except ValueError as error:  # JAX's Keras leaves the model unusable after it
            results.append((before, type(error), None))
            continue
        target.compile(optimizer="sgd", loss="categorical_crossentropy")
        frozen = np.copy(first.get_weights()[0])
        target.fit(x, y, batch_size=10, epochs=1, verbose=0)
        assert np.array_equal(first.get_weights()[0], frozen)  # frozen by the compile
        results.append((before, outcome, template.get_weights()))
    (before, outcome, weights), (p_before, p_outcome, p_weights) = results
    np.testing.assert_allclose(p_before, before, rtol=1e-5, atol=1e-6)
    if isinstance(outcome, type):
        assert p_outcome is outcome, f"one device raised {outcome.__name__}; ours: {p_outcome}"
        return
    assert not isinstance(p_outcome, type), f"ours raised {p_outcome.__name__}"
    np.testing.assert_allclose(p_outcome, outcome, rtol=1e-5, atol=1e-6)
    assert_weights_close(weights, p_weights)


@pytest.mark.slow  # uncompiled steps: 15 s and more
@pytest.mark.parametrize("mode", [{"run_eagerly": True}, {"jit_compile": False}],
                         ids=["run_eagerly", "no-jit"])
def test_uncompiled_steps_equal_one_device(mode):
    x, y = classification_data(29)

    def build():
        return keras.Sequential([keras.Input((6,)), layers.Dense(4), layers.BatchNormalization(),
                                 layers.Dense(3, activation="softmax")])

    def compile_fn(model):
        model.compile(optimizer="sgd", loss="categorical_crossentropy", metrics=["accuracy"],
                      **mode)

    plain, expected, template, parallel, history = _fit_both(
        build, compile_fn, {"x": x, "y": y, "batch_size": 10, "epochs": 2}, gpus=3,
    )
    assert parallel.run_eagerly == plain.run_eagerly
    _assert_history_close(expected, history)
    assert_weights_close(plain.get_weights(), template.get_weights())
    np.testing.assert_allclose(parallel.predict(x, batch_size=10, verbose=0),
                               plain.predict(x, batch_size=10, verbose=0), atol=1e-6)
