"""N devices give one device's results: weights, logs, evaluate and predict."""

import os

import keras
import numpy as np
import pytest

import keras_multigpu as kmg
from conftest import assert_weights_close, classification_data


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
    parallel = compile_sgd(kmg.multi_gpu_model(template, gpus=gpus))
    history = parallel.fit(
        x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, **fit_kwargs
    )
    return reference, ref_history, template, parallel, history


def assert_history_close(a, b):
    assert a.history.keys() == b.history.keys()
    for key in a.history:
        np.testing.assert_allclose(a.history[key], b.history[key], rtol=1e-5, err_msg=key)


@pytest.mark.parametrize("gpus", [1, 2, 3, 4, 8])
@pytest.mark.parametrize(
    "num_samples, batch_size",
    [(100, 30), (64, 16), (10, 3), (7, 16), (33, 8)],
    ids=["uneven-last", "even", "batch-below-devices", "one-short-batch", "tiny-last"],
)
def test_training_equals_one_device(dense_model, gpus, num_samples, batch_size):
    x, y = classification_data(num_samples)
    reference, ref_history, template, parallel, history = train_both(
        dense_model, x, y, gpus, batch_size
    )
    assert parallel.num_replicas == gpus
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
    last batch, still gives one device's results."""
    x, y = classification_data(100)
    reference = compile_sgd(dense_model(), steps_per_execution=3)
    ref_history = reference.fit(x, y, batch_size=30, epochs=2, shuffle=False, verbose=0)
    template = dense_model()
    parallel = compile_sgd(kmg.multi_gpu_model(template, gpus=3), steps_per_execution=3)
    history = parallel.fit(x, y, batch_size=30, epochs=2, shuffle=False, verbose=0)
    assert parallel.steps_per_execution == 3
    assert_weights_close(reference.get_weights(), template.get_weights())
    assert_history_close(ref_history, history)

def test_batchnorm_statistics_equal_one_device(conv_bn_model):
    """Batch statistics are over the global batch, as on one device."""
    x, y = classification_data(64, features=(8, 8, 3))
    reference, ref_history, template, _, history = train_both(
        conv_bn_model, x, y, gpus=4, batch_size=16, epochs=3
    )
    bn_ref = reference.layers[1]
    bn_par = template.layers[1]
    np.testing.assert_allclose(bn_ref.moving_mean.numpy(), bn_par.moving_mean.numpy(), atol=1e-5)
    np.testing.assert_allclose(
        bn_ref.moving_variance.numpy(), bn_par.moving_variance.numpy(), atol=1e-5
    )
    assert_weights_close(reference.get_weights(), template.get_weights())
    assert_history_close(ref_history, history)


@pytest.mark.parametrize("num_samples, batch_size, gpus", [(5, 5, 8), (9, 4, 8), (1, 1, 3)])
def test_padded_batchnorm_steps_stay_finite(conv_bn_model, num_samples, batch_size, gpus):
    """The old multi_gpu_model left GPUs empty and BatchNorm produced NaN."""
    x, y = classification_data(num_samples, features=(8, 8, 3))
    template = conv_bn_model()
    parallel = compile_sgd(kmg.multi_gpu_model(template, gpus=gpus))
    history = parallel.fit(x, y, batch_size=batch_size, epochs=3, verbose=0)
    for weight in template.get_weights():
        assert np.all(np.isfinite(weight))
    assert np.all(np.isfinite(history.history["loss"]))
    assert np.all(np.isfinite(parallel.predict(x, verbose=0)))


def test_template_is_the_trained_model(dense_model):
    x, y = classification_data(40)
    template = dense_model()
    before = template.predict(x, verbose=0)
    parallel = compile_sgd(kmg.multi_gpu_model(template, gpus=4))
    parallel.fit(x, y, batch_size=8, epochs=2, verbose=0)
    after = template.predict(x, verbose=0)
    assert not np.allclose(before, after)
    np.testing.assert_allclose(after, parallel.predict(x, verbose=0), atol=1e-6)


def test_no_distribution_left_behind(dense_model):
    x, y = classification_data(40)
    parallel = compile_sgd(kmg.multi_gpu_model(dense_model(), gpus=4))
    parallel.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert keras.distribution.distribution() is None
    # A plain model trained next to it behaves as if the library were absent.
    plain, other = compile_sgd(dense_model(seed=1)), compile_sgd(dense_model(seed=1))
    plain.fit(x, y, batch_size=7, epochs=1, shuffle=False, verbose=0)
    parallel.fit(x, y, batch_size=8, epochs=1, verbose=0)
    other.fit(x, y, batch_size=7, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(plain.get_weights(), other.get_weights(), atol=0)


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
    parallel = compile_weighted(kmg.multi_gpu_model(dense_model(), gpus=4))
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
    parallel = compile_sgd(kmg.multi_gpu_model(dense_model(), gpus=4))
    counter = keras.callbacks.LambdaCallback()
    steps = []
    counter.on_train_batch_end = lambda batch, logs=None: steps.append(batch)
    parallel.fit(x, y, batch_size=16, epochs=1, drop_remainder=True, verbose=0, callbacks=[counter])
    assert len(steps) == 3  # 50 // 16; the 2 leftover samples are dropped.


def test_one_compiled_step_per_shape(dense_model, monkeypatch):
    """Tracing happens once per batch shape, not once per epoch."""
    traces = []
    original = keras.Model.compute_loss

    def counting(self, *args, **kwargs):
        traces.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(keras.Model, "compute_loss", counting)
    x, y = classification_data(50)
    parallel = compile_sgd(kmg.multi_gpu_model(dense_model(), gpus=4))
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
    parallel = compile_two(kmg.multi_gpu_model(template, gpus=3))
    history = parallel.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(reference.get_weights(), template.get_weights())
    assert {"cls_loss", "reg_loss"} <= set(history.history)
    for key in history.history:
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


def test_subclassed_model_equals_one_device():
    def build():
        keras.utils.set_random_seed(0)
        model = Subclassed()
        model(np.zeros((1, 6), "float32"))  # built before wrapping: the normal case
        return model

    x, y = classification_data(29)
    reference, ref_history, template, _, history = train_both(build, x, y, gpus=4, batch_size=8)
    assert_weights_close(reference.get_weights(), template.get_weights())
    assert_history_close(ref_history, history)


def test_unbuilt_subclassed_model_is_built_on_first_fit():
    keras.utils.set_random_seed(0)
    template = Subclassed()
    x, y = classification_data(20)
    parallel = compile_sgd(kmg.multi_gpu_model(template, gpus=2))
    parallel.fit(x, y, batch_size=5, epochs=1, verbose=0)
    assert template.built
    assert parallel.predict(x, verbose=0).shape == (20, 3)


def test_one_device_and_zero_give_a_parallel_model(dense_model):
    for gpus in (0, 1, [5]):
        parallel = kmg.multi_gpu_model(dense_model(), gpus=gpus)
        assert isinstance(parallel, kmg.ParallelModel)
        assert parallel.num_replicas == 1
    assert kmg.multi_gpu_model(dense_model(), gpus=[5]).devices[0].id == 5


def test_model_like_surface(dense_model):
    template = dense_model()
    parallel = kmg.multi_gpu_model(template, gpus=2)
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
    parallel = compile_sgd(kmg.multi_gpu_model(template, gpus=4))
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


COMPILES = []


def _count_compiles(event, duration, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
        COMPILES.append(event)


@pytest.mark.parametrize("gpus", [1, 2])
def test_no_compilation_after_the_first_epoch(dense_model, gpus):
    """XLA compiles nothing after epoch 1: not the step, not a metric reset."""
    import jax

    jax.monitoring.register_event_duration_secs_listener(_count_compiles)
    x, y = classification_data(50)
    parallel = compile_sgd(kmg.multi_gpu_model(dense_model(), gpus=gpus))
    per_epoch = []
    record = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs=None: per_epoch.append(len(COMPILES))
    )
    parallel.fit(x, y, batch_size=16, epochs=4, validation_data=(x[:10], y[:10]), verbose=0,
                 callbacks=[record])
    assert per_epoch[1:] == [per_epoch[0]] * 3


@pytest.fixture
def gather_on_cpu(monkeypatch):
    """Lets the device-resident path (the GPU path) run on virtual CPU devices, which it
    declines by default (XLA:CPU may deadlock on a machine with fewer free cores than
    devices, see test_a_conv_fit_on_one_core_finishes): this machine's cores are free."""
    from keras_multigpu.backends import jax as engine

    monkeypatch.setattr(engine, "_gather_may_deadlock", lambda mesh: False)


def test_several_cpu_devices_batch_on_the_host_and_one_device_keeps_arrays(dense_model):
    x, y = classification_data(30)
    assert not kmg.multi_gpu_model(dense_model(), gpus=3)._padded(x, y, batch_size=8)[0].resident
    assert kmg.multi_gpu_model(dense_model(), gpus=1)._padded(x, y, batch_size=8)[0].resident


CONV_ON_ONE_CORE = """
import os, sys
os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
os.environ["KERAS_BACKEND"] = "jax"
os.environ["KERAS_MULTIGPU_CPU_DEVICES"] = "2"
import keras, numpy as np
import keras_multigpu as kmg
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((32, 32, 3)), keras.layers.Conv2D(32, 3, padding="same"),
                          keras.layers.BatchNormalization(), keras.layers.ReLU(),
                          keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])
parallel = kmg.multi_gpu_model(model, gpus=2)
parallel.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(True))
rng = np.random.default_rng(0)
x, y = rng.random((1536, 32, 32, 3)).astype("float32"), rng.integers(0, 10, 1536)
parallel.fit(x, y, batch_size=64, epochs=5, verbose=0)
print("finished")
"""


@pytest.mark.slow  # a process of its own, on one core
def test_a_conv_fit_on_one_core_finishes():
    """2 virtual CPU devices on one core: with the arrays gathered on the devices, this fit
    froze in XLA (every time, in its 2nd or 3rd epoch); batched on the host, it finishes."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
    env["KERAS_MULTIGPU_TIMEOUT"] = "60"
    result = subprocess.run([sys.executable, "-c", CONV_ON_ONE_CORE], capture_output=True,
                            text=True, env=env, timeout=240, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "finished" in result.stdout


def test_array_batches_are_gathered_on_the_devices(dense_model, gather_on_cpu):
    import jax

    x, y = classification_data(30)
    parallel = kmg.multi_gpu_model(dense_model(), gpus=3)
    data, _ = parallel._padded(x, y, batch_size=8)
    assert data.resident
    from keras_multigpu.backends import jax as engine

    # Batches of 8 rows pad to 9, so every batch is tagged; the last, of 6
    # rows, needs no padding itself.
    batch_x, batch_y = engine.untag(list(data.get_jax_iterator())[3])
    assert isinstance(batch_x, jax.Array) and len(batch_x.sharding.device_set) == 3
    assert batch_x.shape == (6, 6) and not batch_x.sharding.is_fully_replicated
    np.testing.assert_array_equal(np.asarray(batch_x), x[24:30])
    np.testing.assert_array_equal(np.asarray(batch_y), y[24:30])


def test_large_arrays_stay_on_the_host_with_the_same_results(dense_model, monkeypatch,
                                                             gather_on_cpu):
    from keras_multigpu import parallel as parallel_module

    x, y = classification_data(40)
    resident = compile_sgd(kmg.multi_gpu_model(dense_model(), gpus=4))
    expected = resident.fit(x, y, batch_size=7, epochs=2, shuffle=False, verbose=0)
    monkeypatch.setattr(parallel_module, "RESIDENT_LIMIT_BYTES", 100)
    host = compile_sgd(kmg.multi_gpu_model(dense_model(), gpus=4))
    assert not host._padded(x, y, batch_size=7)[0].resident
    history = host.fit(x, y, batch_size=7, epochs=2, shuffle=False, verbose=0)
    assert_history_close(expected, history)
    assert_weights_close(resident.get_weights(), host.get_weights())


def _collectives(hlo):
    import re

    ops = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")
    return {op: len(re.findall(rf"\b{op}(-start)?\(", hlo)) for op in ops}


def test_a_padded_step_compiles_to_the_same_collectives(conv_bn_model):
    """Slicing the real rows out inside the step keeps each device's rows where they are:
    XLA adds no gather or shuffle of the batch, only the gradient all-reduces it always has."""
    import jax
    from keras.src.backend.jax.trainer import _distribute_data

    x, y = classification_data(12, features=(8, 8, 3))
    parallel = compile_sgd(kmg.multi_gpu_model(conv_bn_model(), gpus=4))
    parallel.fit(x, y, batch_size=12, epochs=1, verbose=0)
    found = {}
    with parallel._placed():
        state = parallel._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                        optimizer_variables=True, metrics_variables=True)
        for rows in (12, 11):  # 11 rows travel padded to 12
            data = _distribute_data(parallel._pad_one(x[:rows], y[:rows]))
            hlo = jax.jit(parallel.train_step).lower(state, data).compile().as_text()
            found[rows] = _collectives(hlo)
    assert found[11] == found[12]
    assert found[12]["all-reduce"] > 0 and found[12]["all-gather"] == 0


def test_the_resident_budget_counts_devices_and_their_free_memory(dense_model, monkeypatch,
                                                                  gather_on_cpu):
    from keras_multigpu import parallel as parallel_module
    from keras_multigpu.backends import jax as engine

    assert kmg.multi_gpu_model(dense_model(), gpus=8).resident_budget() < \
        kmg.multi_gpu_model(dense_model(), gpus=4).resident_budget()  # CPU devices share RAM
    monkeypatch.setattr(engine, "free_memory", lambda devices: [8 * 2**20, 4 * 2**20])
    parallel = kmg.multi_gpu_model(dense_model(), gpus=2)
    assert parallel.resident_budget() == parallel_module.RESIDENT_FRACTION * 4 * 2**20
    x, y = classification_data(2 * 2**20 // 24)  # 2 MiB > a quarter of 4 MiB: host path
    _, dataset = parallel._padded(x, y, batch_size=64)
    assert not dataset.resident and dataset._prefetch
    _, small = parallel._padded(x[:100], y[:100], batch_size=64)
    assert small.resident


@pytest.mark.parametrize("shuffle", [False, True])
def test_the_host_path_prefetches_placed_batches_with_the_same_results(
        dense_model, monkeypatch, shuffle, gather_on_cpu):
    import jax

    from keras_multigpu import parallel as parallel_module

    x, y = classification_data(53)
    keras.utils.set_random_seed(2)
    resident = compile_sgd(kmg.multi_gpu_model(dense_model(), gpus=3))
    expected = resident.fit(x, y, batch_size=10, epochs=2, shuffle=shuffle, verbose=0)
    monkeypatch.setattr(parallel_module, "RESIDENT_LIMIT_BYTES", 0)
    keras.utils.set_random_seed(2)
    host = compile_sgd(kmg.multi_gpu_model(dense_model(), gpus=3))
    data, dataset = host._padded(x, y, batch_size=10)
    served = dataset.get_jax_iterator()
    first = engine_untag(next(served))
    assert isinstance(first[0], jax.Array) and len(first[0].sharding.device_set) == 3
    assert dataset._executor is not None  # batch 1 on its way
    np.testing.assert_array_equal(np.asarray(engine_untag(next(served))[0]), x[10:20])
    dataset.close()
    history = host.fit(x, y, batch_size=10, epochs=2, shuffle=shuffle, verbose=0)
    assert_history_close(expected, history)
    assert_weights_close(resident.get_weights(), host.get_weights())


def engine_untag(batch):
    from keras_multigpu.backends import jax as engine

    return engine.untag(batch)
