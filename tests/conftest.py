"""Test set-up: the JAX backend with 8 virtual CPU devices.

Both variables must be set before Keras picks its backend and before JAX
starts, hence here, at the top of conftest. Tests take the first k devices
with `gpus=k`, so one process covers every device count from 1 to 8.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("KERAS_MULTIGPU_CPU_DEVICES", "8")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import keras_multigpu as kmg  # noqa: E402

SHARED_DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")


def cifar_dir():
    """The shared CIFAR-10 subset, by environment variable or beside the repo."""
    for candidate in (os.environ.get("KERAS_MULTIGPU_DATA"), SHARED_DATA):
        if candidate and os.path.isdir(candidate):
            return os.path.abspath(candidate)
    return None


@pytest.fixture
def dense_model():
    """A small model with no batch statistics: every result must be exact."""

    def build(seed=0, inputs=6, classes=3):
        keras.utils.set_random_seed(seed)
        return keras.Sequential(
            [
                keras.Input((inputs,)),
                keras.layers.Dense(8, activation="tanh"),
                keras.layers.Dense(classes, activation="softmax"),
            ]
        )

    return build


@pytest.fixture
def conv_bn_model():
    def build(seed=0):
        keras.utils.set_random_seed(seed)
        return keras.Sequential(
            [
                keras.Input((8, 8, 3)),
                keras.layers.Conv2D(4, 3, padding="same"),
                keras.layers.BatchNormalization(),
                keras.layers.ReLU(),
                keras.layers.GlobalAveragePooling2D(),
                keras.layers.Dense(3, activation="softmax"),
            ]
        )

    return build


def classification_data(n, features=6, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    shape = (n, features) if isinstance(features, int) else (n, *features)
    x = rng.normal(size=shape).astype("float32")
    y = keras.utils.to_categorical(rng.integers(0, classes, n), classes)
    return x, y


def assert_weights_close(a, b, atol=1e-5):
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        np.testing.assert_allclose(u, v, atol=atol, rtol=1e-5, err_msg=f"weight {i}")


__all__ = ["kmg", "classification_data", "assert_weights_close", "cifar_dir"]
