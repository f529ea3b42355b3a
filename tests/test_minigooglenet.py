"""Tests for keras_multigpu.models.minigooglenet (CPU, no network)."""

import keras
import numpy as np
import pytest

from keras_multigpu.models import MINI_GOOGLENET_PARAMS, mini_googlenet, small_convnet
from keras_multigpu.models import minigooglenet as module


@pytest.fixture(scope="module")
def model():
    return mini_googlenet()


def test_parameter_count(model):
    assert model.count_params() == MINI_GOOGLENET_PARAMS == 1_656_250
    assert 1_600_000 <= model.count_params() <= 1_700_000
    trainable = sum(int(np.prod(w.shape)) for w in model.trainable_weights)
    assert trainable == 1_652_826
    assert "1,656,250" in module.mini_googlenet.__doc__
    assert "1,652,826" in module.mini_googlenet.__doc__


def test_output_is_softmax(model):
    assert model.output_shape == (None, 10)
    x = np.random.default_rng(0).uniform(0, 1, (3, 32, 32, 3)).astype("float32")
    probs = np.asarray(model(x, training=False))
    assert probs.shape == (3, 10)
    assert np.all(probs >= 0)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-5)


def test_architecture(model):
    kinds = [type(layer).__name__ for layer in model.layers]
    assert kinds.count("Conv2D") == 1 + 2 * 8 + 2  # stem, 8 inception, 2 downsample
    assert kinds.count("BatchNormalization") == kinds.count("Conv2D")
    assert kinds.count("MaxPooling2D") == 2 and kinds.count("AveragePooling2D") == 1
    assert model.get_layer(index=-1).get_config()["activation"] == "softmax"
    dropout = [layer for layer in model.layers if isinstance(layer, keras.layers.Dropout)]
    assert len(dropout) == 1 and dropout[0].rate == 0.5
    assert model.layers[-5].output.shape == (None, 1, 1, 336)  # after 7x7 pooling


@pytest.mark.slow  # two more models built: 15 s
def test_width_and_classes():
    small = mini_googlenet(width=0.25, num_classes=7, dropout=0.0)
    assert small.output_shape == (None, 7)
    assert small.count_params() < MINI_GOOGLENET_PARAMS / 8
    tiny = mini_googlenet(width=0.001)  # every filter count clamps to 1
    first_conv = next(la for la in tiny.layers if isinstance(la, keras.layers.Conv2D))
    assert first_conv.filters == 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"width": -1}, "Received: width=-1"),
        ({"width": 0}, "Received: width=0"),
        ({"width": float("nan")}, "width"),
        ({"width": "1"}, "width"),
        ({"num_classes": 0}, "Received: num_classes=0"),
        ({"num_classes": 2.0}, "num_classes"),
        ({"dropout": 1.0}, "Received: dropout=1.0"),
        ({"dropout": -0.1}, "dropout"),
        ({"input_shape": (32, 32)}, "input_shape"),
        ({"input_shape": (16, 16, 3)}, "at least 31"),
        ({"input_shape": (32, 32, 0)}, "input_shape"),
        ({"name": ""}, "name"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        mini_googlenet(**kwargs)


def test_save_and_load(model, tmp_path):
    x = np.random.default_rng(1).uniform(0, 1, (2, 32, 32, 3)).astype("float32")
    expected = model.predict(x, verbose=0)
    path = tmp_path / "mini_googlenet.keras"
    model.save(path)
    restored = keras.saving.load_model(path)  # no custom_objects needed
    assert restored.count_params() == model.count_params()
    np.testing.assert_allclose(restored.predict(x, verbose=0), expected, rtol=1e-6, atol=1e-6)


def test_small_convnet(tmp_path):
    net = small_convnet()
    assert 1_000 <= net.count_params() <= 10_000
    assert net.count_params() == 5_610
    assert net.output_shape == (None, 10)
    assert any(isinstance(la, keras.layers.BatchNormalization) for la in net.layers)
    x = np.random.default_rng(2).uniform(0, 1, (4, 32, 32, 3)).astype("float32")
    net.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    net.fit(x, np.array([0, 1, 2, 3]), epochs=1, verbose=0)
    expected = net.predict(x, verbose=0)
    np.testing.assert_allclose(expected.sum(axis=1), 1.0, atol=1e-5)
    path = tmp_path / "small.keras"
    net.save(path)
    np.testing.assert_allclose(
        keras.saving.load_model(path).predict(x, verbose=0), expected, rtol=1e-6, atol=1e-6
    )
    with pytest.raises(ValueError, match="num_classes"):
        small_convnet(num_classes=-2)
