"""On-device shift/flip augmentation: shapes, values, randomness, no hang."""

import subprocess
import sys

import keras
import numpy as np
import pytest

from keras_multigpu.data import RandomShiftFlip

IMAGES = np.random.default_rng(0).uniform(0, 255, size=(16, 32, 32, 3)).astype("float32")


def test_identity_at_inference():
    layer = RandomShiftFlip(0.1, seed=1)
    np.testing.assert_array_equal(np.asarray(layer(IMAGES, training=False)), IMAGES)
    np.testing.assert_array_equal(np.asarray(layer(IMAGES)), IMAGES)


def test_shapes_and_values_are_copied_pixels():
    out = np.asarray(RandomShiftFlip(0.1, seed=1)(IMAGES, training=True))
    assert out.shape == IMAGES.shape and out.dtype == np.float32
    assert out.min() >= IMAGES.min() and out.max() <= IMAGES.max()
    for augmented, original in zip(out, IMAGES):
        assert np.isin(augmented, original).all()  # selected, never interpolated


def test_every_image_is_a_shift_or_flipped_shift_of_at_most_three_pixels():
    out = np.asarray(RandomShiftFlip(0.1, seed=3)(IMAGES, training=True))
    for augmented, original in zip(out, IMAGES):
        candidates = []
        for image in (original, original[:, ::-1]):
            for dy in range(-3, 4):
                for dx in range(-3, 4):
                    rows = np.clip(np.arange(32) + dy, 0, 31)
                    cols = np.clip(np.arange(32) + dx, 0, 31)
                    candidates.append(image[rows][:, cols])
        assert any(np.array_equal(augmented, c) for c in candidates)


def test_random_per_call_and_reproducible_with_a_seed():
    layer = RandomShiftFlip(0.1, seed=7)
    first = np.asarray(layer(IMAGES, training=True))
    second = np.asarray(layer(IMAGES, training=True))
    assert not np.array_equal(first, second)  # a new draw each step / epoch
    again = RandomShiftFlip(0.1, seed=7)
    np.testing.assert_array_equal(np.asarray(again(IMAGES, training=True)), first)
    flipped = RandomShiftFlip(0.0, seed=7)(IMAGES, training=True)
    is_flipped = [np.array_equal(np.asarray(o), i[:, ::-1]) for o, i in zip(flipped, IMAGES)]
    assert 0 < sum(is_flipped) < len(is_flipped)


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_shift"):
        RandomShiftFlip(1.5)


def test_serializable():
    layer = RandomShiftFlip(0.2, flip=False, seed=3)
    clone = RandomShiftFlip.from_config(layer.get_config())
    assert (clone.max_shift, clone.flip, clone.seed) == (0.2, False, 3)
    assert keras.saving.get_registered_object("keras_multigpu>RandomShiftFlip") is RandomShiftFlip


# Keras's RandomTranslation deadlocked here in an XLA all-reduce on 2 virtual
# CPU devices; this layer must train there. A subprocess bounds any hang.
NO_HANG = """
import os
os.environ["KERAS_BACKEND"] = "jax"
os.environ["KERAS_MULTIGPU_CPU_DEVICES"] = "2"
import numpy as np, keras, keras_multigpu as kmg
from keras_multigpu.data import RandomShiftFlip
from keras_multigpu.models import mini_googlenet
inputs = keras.Input((32, 32, 3))
model = keras.Model(inputs, mini_googlenet((32, 32, 3), width=0.25)(RandomShiftFlip(0.1)(inputs)))
parallel = kmg.multi_gpu_model(model, gpus=2)
parallel.compile("sgd", "categorical_crossentropy")
x = np.random.rand(256, 32, 32, 3).astype("float32")
y = keras.utils.to_categorical(np.random.randint(0, 10, 256), 10)
parallel.fit(x, y, batch_size=128, epochs=1, verbose=0)
print("trained")
"""


@pytest.mark.slow  # a process of its own
def test_trains_on_two_virtual_devices_without_hanging():
    result = subprocess.run([sys.executable, "-c", NO_HANG], capture_output=True, text=True,
                            timeout=240, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "trained" in result.stdout
