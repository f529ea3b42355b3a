"""`schedules.LinearScaling`: Goyal et al.'s linear scaling rule with warm-up."""

import json
import os
import subprocess
import sys

import jax
import keras
import numpy as np
import pytest

from conftest import assert_weights_close, classification_data, kmg
from keras_multigpu import schedules
from keras_multigpu.schedules import LinearScaling


def values(schedule, steps):
    return [float(schedule(step)) for step in steps]


def polynomial(lr=0.1, decay_steps=100):
    return keras.optimizers.schedules.PolynomialDecay(lr, decay_steps, 0.0, power=1)


# -- values ---------------------------------------------------------------


def test_float_rate_warms_up_linearly_then_stays_scaled():
    # k = 1024 / 256 = 4: 0.1 -> 0.4 over 10 steps, 0.1 * (1 + 3 * t / 10).
    schedule = LinearScaling(0.1, global_batch_size=1024, reference_batch_size=256,
                             warmup_steps=10)
    assert schedule.scale == 4.0
    np.testing.assert_allclose(
        values(schedule, [0, 1, 5, 9, 10, 11, 1000]),
        [0.1, 0.13, 0.25, 0.37, 0.4, 0.4, 0.4], rtol=1e-6,
    )


def test_no_warmup_is_the_scaled_rate_from_step_zero():
    for schedule in (LinearScaling(0.1, 1024), LinearScaling(0.1, 1024, warmup_steps=0)):
        assert schedule.warmup_steps == 0
        np.testing.assert_allclose(values(schedule, [0, 1, 50]), [0.4, 0.4, 0.4], rtol=1e-6)


def test_wraps_polynomial_decay_at_the_same_step():
    # base(t) = 0.1 * (1 - t / 100); multiplier 1 + 3 * min(t / 10, 1).
    schedule = LinearScaling(polynomial(), global_batch_size=256, reference_batch_size=64,
                             warmup_steps=10)
    np.testing.assert_allclose(
        values(schedule, [0, 5, 10, 50, 99, 100, 150]),
        [0.1, 0.095 * 2.5, 0.09 * 4, 0.05 * 4, 0.001 * 4, 0.0, 0.0],
        rtol=1e-5, atol=1e-8,
    )


def test_warmup_endpoints_are_base_and_scaled_base():
    base = polynomial(0.2, 40)
    schedule = LinearScaling(base, global_batch_size=96, reference_batch_size=32,
                             warmup_steps=8)
    np.testing.assert_allclose(float(schedule(0)), float(base(0)), rtol=1e-6)
    np.testing.assert_allclose(float(schedule(8)), 3 * float(base(8)), rtol=1e-6)


def test_global_batch_smaller_than_reference_scales_down():
    # k = 64 / 256 = 0.25: 0.2 -> 0.05 over 4 steps.
    schedule = LinearScaling(0.2, global_batch_size=64, reference_batch_size=256,
                             warmup_steps=4)
    assert schedule.scale == 0.25
    np.testing.assert_allclose(values(schedule, [0, 2, 4, 9]), [0.2, 0.125, 0.05, 0.05],
                               rtol=1e-6)


def test_warmup_in_epochs_is_epochs_times_steps_per_epoch():
    assert LinearScaling(0.1, 512, warmup_epochs=5, steps_per_epoch=3).warmup_steps == 15
    assert LinearScaling(0.1, 512, warmup_epochs=0, steps_per_epoch=3).warmup_steps == 0
    # Fractional epochs round to the nearest step, halves up.
    assert LinearScaling(0.1, 512, warmup_epochs=0.5, steps_per_epoch=5).warmup_steps == 3
    assert LinearScaling(0.1, 512, warmup_epochs=0.1, steps_per_epoch=30).warmup_steps == 3
    by_epochs = LinearScaling(0.1, 512, warmup_epochs=2, steps_per_epoch=4)
    by_steps = LinearScaling(0.1, 512, warmup_steps=8)
    assert values(by_epochs, range(12)) == values(by_steps, range(12))


def test_runs_jitted_on_a_traced_int32_step_and_returns_float32():
    schedule = LinearScaling(polynomial(), 256, 64, warmup_steps=10)
    jitted = jax.jit(schedule)
    for step in (0, 5, 10, 50):
        result = jitted(np.int32(step))
        assert result.dtype == np.float32
        np.testing.assert_allclose(float(result), float(schedule(step)), rtol=1e-6)
    assert keras.ops.convert_to_tensor(LinearScaling(0.1, 512)(3)).dtype == "float32"


# -- serialization ----------------------------------------------------------


@pytest.mark.parametrize("learning_rate", [0.05, polynomial()], ids=["float", "polynomial"])
def test_config_round_trip(learning_rate):
    schedule = LinearScaling(learning_rate, global_batch_size=512, reference_batch_size=128,
                             warmup_epochs=2, steps_per_epoch=5, name="goyal")
    config = schedule.get_config()
    json.dumps(config)  # a JSON-compatible dict, nested schedule included
    assert config["warmup_steps"] == 10
    steps = [0, 3, 10, 60]
    for restored in (
        LinearScaling.from_config(config),
        keras.optimizers.schedules.deserialize(keras.optimizers.schedules.serialize(schedule)),
        keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(schedule)),
    ):
        assert isinstance(restored, LinearScaling)
        assert restored.get_config() == config
        assert restored.name == "goyal"
        assert values(restored, steps) == values(schedule, steps)
    serialized = keras.optimizers.schedules.serialize(schedule)
    assert serialized["registered_name"] == "keras_multigpu>LinearScaling"


def test_optimizer_config_round_trip():
    optimizer = keras.optimizers.SGD(LinearScaling(polynomial(), 256, 64, warmup_steps=10),
                                     momentum=0.9)
    restored = keras.optimizers.SGD.from_config(optimizer.get_config())
    assert isinstance(restored._learning_rate, LinearScaling)
    assert isinstance(restored._learning_rate.learning_rate,
                      keras.optimizers.schedules.PolynomialDecay)
    assert values(restored._learning_rate, [0, 5, 50]) == values(optimizer._learning_rate,
                                                                  [0, 5, 50])


def compiled_model(schedule, seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3, activation="softmax")])
    model.compile(optimizer=keras.optimizers.SGD(schedule, momentum=0.9),
                  loss="categorical_crossentropy")
    return model


# Runs in a fresh process that never imports keras_multigpu.
LOAD_WITHOUT_LIBRARY = """
import json, sys
import keras
out = {}
try:
    keras.saving.load_model(sys.argv[1])
    out["compiled_load"] = "loaded"
except Exception as error:
    out["compiled_load"] = type(error).__name__ + ": " + str(error)
model = keras.saving.load_model(sys.argv[1], compile=False)
out["compiled"] = bool(model.compiled)
out["weights"] = [w.tolist() for w in model.get_weights()]
out["library_imported"] = "keras_multigpu" in sys.modules
print(json.dumps(out))
"""


def test_saved_model_reloads_with_its_schedule(tmp_path):
    schedule = LinearScaling(polynomial(), 256, 64, warmup_steps=10)
    model = compiled_model(schedule)
    x, y = classification_data(12)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)

    loaded = keras.saving.load_model(path)
    restored = loaded.optimizer._learning_rate
    assert isinstance(restored, LinearScaling)
    assert restored.get_config() == schedule.get_config()
    assert int(loaded.optimizer.iterations) == 3
    np.testing.assert_allclose(float(loaded.optimizer.learning_rate), float(schedule(3)),
                               rtol=1e-6)

    # A process that never imports keras_multigpu.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KERAS_MULTIGPU", "XLA"))}
    env["KERAS_BACKEND"] = "jax"
    result = subprocess.run(
        [sys.executable, "-c", LOAD_WITHOUT_LIBRARY, str(path)],
        capture_output=True, text=True, env=env, timeout=180, check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["library_imported"] is False
    assert out["compiled_load"].startswith("TypeError")
    assert "Could not locate class 'LinearScaling'" in out["compiled_load"]
    assert out["compiled"] is False
    assert_weights_close([np.asarray(w) for w in out["weights"]], model.get_weights(), atol=0)


# -- training -----------------------------------------------------------------


def test_fit_reads_the_schedule_at_the_optimizer_iteration(dense_model):
    # Warm-up 0.1 -> 0.4 over 4 steps, written once as LinearScaling and once
    # as an increasing PolynomialDecay (0.4 - 0.3 * (1 - t / 4) = 0.1 + 0.075 t,
    # then 0.4): both runs must make the same updates at every step.
    x, y = classification_data(24)
    schedule = LinearScaling(0.1, global_batch_size=128, reference_batch_size=32,
                             warmup_steps=4)
    same = keras.optimizers.schedules.PolynomialDecay(0.1, 4, 0.4, power=1)
    runs = []
    for learning_rate in (schedule, same):
        parallel = kmg.multi_gpu_model(dense_model(), gpus=2)
        parallel.compile(optimizer=keras.optimizers.SGD(learning_rate),
                         loss="categorical_crossentropy")
        parallel.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
        runs.append(parallel)
    optimizer = runs[0].optimizer
    assert optimizer._learning_rate is schedule
    assert int(optimizer.iterations) == 6
    np.testing.assert_allclose(float(optimizer.learning_rate), float(schedule(6)), rtol=1e-6)
    np.testing.assert_allclose(float(optimizer.learning_rate), 0.4, rtol=1e-6)
    assert_weights_close(runs[0].get_weights(), runs[1].get_weights(), atol=1e-6)


def test_gradient_accumulation_uses_the_rate_at_the_last_batch_of_each_group():
    # One weight w (from 0) fitting y = x = 1 under MSE: each gradient is
    # 2 (w - 1), constant within a group of A = 2 batches, and an update is
    # w += 2 (1 - w) lr. Schedule: 0.01 * (1 + min(t / 4, 1)).
    schedule = LinearScaling(0.01, global_batch_size=64, reference_batch_size=32,
                             warmup_steps=4)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((1,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")]
    )
    optimizer = keras.optimizers.SGD(schedule, gradient_accumulation_steps=2)
    model.compile(optimizer=optimizer, loss="mse")
    ones = np.ones((4, 1), "float32")
    model.fit(ones, ones, batch_size=1, epochs=1, shuffle=False, verbose=0)
    # Update 0 uses lr(1) = 0.0125, update 1 lr(3) = 0.0175.
    w = 0.0 + 2 * (1 - 0.0) * 0.0125
    w = w + 2 * (1 - w) * 0.0175
    np.testing.assert_allclose(model.get_weights()[0][0, 0], w, rtol=1e-5)
    assert int(optimizer._iterations) == 4  # what the schedule sees: batches
    assert int(optimizer.iterations) == 2   # updates
    np.testing.assert_allclose(float(optimizer.learning_rate), float(schedule(4)), rtol=1e-6)


# -- bad arguments --------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(learning_rate="0.1"), TypeError, r"learning_rate must be a float .*'0\.1'"),
        (dict(learning_rate=True), TypeError, r"learning_rate=True of type bool"),
        (dict(learning_rate=lambda step: 0.1), TypeError, r"LearningRateSchedule"),
        (dict(learning_rate=-0.1), ValueError, r"positive.*learning_rate=-0\.1"),
        (dict(learning_rate=0.0), ValueError, r"positive.*learning_rate=0\.0"),
        (dict(learning_rate=float("nan")), ValueError, r"finite.*learning_rate=nan"),
        (dict(global_batch_size=0), ValueError, r"global_batch_size must be an int >= 1\. "
                                                r"Received: global_batch_size=0"),
        (dict(global_batch_size=-64), ValueError, r"global_batch_size=-64"),
        (dict(global_batch_size=64.0), TypeError, r"global_batch_size must be an int\. "
                                                  r"Received: global_batch_size=64\.0"),
        (dict(global_batch_size=True), TypeError, r"global_batch_size=True"),
        (dict(reference_batch_size=0), ValueError, r"reference_batch_size=0"),
        (dict(reference_batch_size="256"), TypeError, r"reference_batch_size='256'"),
        (dict(warmup_steps=-1), ValueError, r"warmup_steps must be an int >= 0\. "
                                            r"Received: warmup_steps=-1"),
        (dict(warmup_steps=2.5), TypeError, r"warmup_steps=2\.5 of type float"),
        (dict(warmup_steps=10, warmup_epochs=5, steps_per_epoch=3), ValueError,
         r"either in steps or in epochs, not both.*warmup_steps=10 and warmup_epochs=5"),
        (dict(warmup_steps=0, warmup_epochs=5, steps_per_epoch=3), ValueError,
         r"not both"),
        (dict(warmup_epochs=5), ValueError,
         r"warmup_epochs=5 needs steps_per_epoch.*Pass steps_per_epoch"),
        (dict(steps_per_epoch=100), ValueError,
         r"steps_per_epoch=100.*Pass warmup_epochs too, or drop steps_per_epoch"),
        (dict(warmup_epochs=-1, steps_per_epoch=3), ValueError,
         r"warmup_epochs must be >= 0\. Received: warmup_epochs=-1"),
        (dict(warmup_epochs="5", steps_per_epoch=3), TypeError, r"warmup_epochs='5'"),
        (dict(warmup_epochs=5, steps_per_epoch=0), ValueError, r"steps_per_epoch=0"),
        (dict(warmup_epochs=5, steps_per_epoch=3.0), TypeError, r"steps_per_epoch=3\.0"),
    ],
)
def test_bad_arguments_are_refused(kwargs, error, match):
    arguments = dict(learning_rate=0.1, global_batch_size=512)
    arguments.update(kwargs)
    with pytest.raises(error, match=match):
        LinearScaling(**arguments)


def test_module_is_reachable_as_a_submodule():
    assert schedules.LinearScaling is LinearScaling
    assert issubclass(LinearScaling, keras.optimizers.schedules.LearningRateSchedule)
