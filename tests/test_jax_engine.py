"""The JAX engine's own placement: compiled steps, batches gathered on the devices or
prefetched from the host, and the collectives a padded step compiles to. The results these
paths give are those of one device (test_parallel); here, how the engine gets them."""

import os

import keras
import numpy as np
import pytest

import keras_multigpu as kmg
from conftest import assert_weights_close, classification_data
from test_parallel import assert_history_close, compile_sgd

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
