"""MiniGoogLeNet (Zhang et al., 2017) and a tiny convnet, built from stock Keras layers.

Both models use only built-in layers, so a saved ``.keras`` file loads with plain
``keras.saving.load_model`` and no custom objects.
"""

import math
import numbers

import keras
from keras import layers

MINI_GOOGLENET_PARAMS = 1_656_250
"""Parameter count of ``mini_googlenet()`` at its defaults (width 1, 10 classes)."""


def _check_input_shape(input_shape, min_size):
    ok = (
        isinstance(input_shape, (tuple, list))
        and len(input_shape) == 3
        and all(isinstance(d, numbers.Integral) and not isinstance(d, bool) for d in input_shape)
        and min(input_shape) >= 1
    )
    if not ok:
        raise ValueError(
            "input_shape must be (height, width, channels) of positive ints. "
            f"Received: input_shape={input_shape!r}"
        )
    if min(input_shape[:2]) < min_size:
        raise ValueError(
            f"input_shape must be at least {min_size}x{min_size} pixels for this model. "
            f"Received: input_shape={tuple(input_shape)!r}"
        )
    return tuple(int(d) for d in input_shape)


def _check_num_classes(num_classes):
    if (
        isinstance(num_classes, bool)
        or not isinstance(num_classes, numbers.Integral)
        or (num_classes < 1)
    ):
        raise ValueError(
            f"num_classes must be a positive integer. Received: num_classes={num_classes!r}"
        )
    return int(num_classes)


def _conv(x, filters, kernel, strides=1, padding="same", batchnorm=True):
    """Conv module: Conv2D -> BatchNormalization -> ReLU (without BatchNormalization, the
    Conv2D has a bias)."""
    x = layers.Conv2D(filters, kernel, strides=strides, padding=padding)(x)
    if batchnorm:
        x = layers.BatchNormalization(axis=-1)(x)
    return layers.Activation("relu")(x)


def _inception(x, k1x1, k3x3, batchnorm=True):
    """Inception module: 1x1 and 3x3 conv modules side by side, concatenated."""
    a = _conv(x, k1x1, 1, batchnorm=batchnorm)
    b = _conv(x, k3x3, 3, batchnorm=batchnorm)
    return layers.Concatenate(axis=-1)([a, b])


def _downsample(x, k, batchnorm=True):
    """Downsample module: strided 3x3 conv module beside 3x3 max-pooling."""
    a = _conv(x, k, 3, strides=2, padding="valid", batchnorm=batchnorm)
    b = layers.MaxPooling2D(pool_size=3, strides=2)(x)
    return layers.Concatenate(axis=-1)([a, b])


def mini_googlenet(
    input_shape=(32, 32, 3), num_classes=10, width=1.0, dropout=0.5, name="mini_googlenet",
    batchnorm=True,
):
    """Builds MiniGoogLeNet, the small Inception network of Zhang et al. (2017).

    Layout (channels-last): conv 3x3/96, inception(32, 32), inception(32, 48),
    downsample(80), inception(112, 48), inception(96, 64), inception(80, 80),
    inception(48, 96), downsample(96), inception(176, 160), inception(176, 160),
    7x7 average pooling, dropout, flatten, dense, softmax. Every conv is followed
    by BatchNormalization and ReLU.

    At the defaults (32x32x3 input, 10 classes, width 1.0) the model has exactly
    1,656,250 parameters (1,652,826 trainable), available as
    ``MINI_GOOGLENET_PARAMS``.

    Args:
        input_shape: ``(height, width, channels)``; height and width must be at
            least 31 so that 7x7 pooling fits after the two downsamples.
        num_classes: Number of output classes (positive int).
        width: Multiplier applied to every filter count (rounded, at least 1);
            a positive finite number.
        dropout: Dropout rate before the classifier, in ``[0, 1)``.
        name: Model name.
        batchnorm: False leaves out every BatchNormalization layer (the benchmarks'
            model whose step has no statistics across the batch).

    Returns:
        An uncompiled functional ``keras.Model`` that outputs class probabilities.

    Raises:
        ValueError: An argument is out of range.
    """
    input_shape = _check_input_shape(input_shape, 31)
    num_classes = _check_num_classes(num_classes)
    if (
        isinstance(width, bool)
        or not isinstance(width, numbers.Real)
        or not math.isfinite(width)
        or width <= 0
    ):
        raise ValueError(f"width must be a positive finite number. Received: width={width!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real) or not 0 <= dropout < 1:
        raise ValueError(f"dropout must be in [0, 1). Received: dropout={dropout!r}")
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string. Received: name={name!r}")

    def k(filters):
        return max(1, round(filters * width))

    bn = bool(batchnorm)
    inputs = keras.Input(shape=input_shape)
    x = _conv(inputs, k(96), 3, batchnorm=bn)
    x = _inception(x, k(32), k(32), bn)
    x = _inception(x, k(32), k(48), bn)
    x = _downsample(x, k(80), bn)
    x = _inception(x, k(112), k(48), bn)
    x = _inception(x, k(96), k(64), bn)
    x = _inception(x, k(80), k(80), bn)
    x = _inception(x, k(48), k(96), bn)
    x = _downsample(x, k(96), bn)
    x = _inception(x, k(176), k(160), bn)
    x = _inception(x, k(176), k(160), bn)
    x = layers.AveragePooling2D(pool_size=7)(x)
    x = layers.Dropout(float(dropout))(x)
    x = layers.Flatten()(x)
    x = layers.Dense(num_classes)(x)
    outputs = layers.Activation("softmax", dtype="float32")(x)
    return keras.Model(inputs, outputs, name=name)


def small_convnet(input_shape=(32, 32, 3), num_classes=10, name="small_convnet"):
    """Builds a tiny convnet (5,610 parameters at the defaults) for tests and benchmarks.

    Conv 3x3/16 -> BatchNorm -> ReLU -> 2x2 max-pool -> conv 3x3/32 -> BatchNorm
    -> ReLU -> global average pooling -> dense softmax.

    Args:
        input_shape: ``(height, width, channels)``, height and width at least 4.
        num_classes: Number of output classes (positive int).
        name: Model name.

    Returns:
        An uncompiled functional ``keras.Model`` that outputs class probabilities.

    Raises:
        ValueError: An argument is out of range.
    """
    input_shape = _check_input_shape(input_shape, 4)
    num_classes = _check_num_classes(num_classes)
    inputs = keras.Input(shape=input_shape)
    x = _conv(inputs, 16, 3)
    x = layers.MaxPooling2D(pool_size=2)(x)
    x = _conv(x, 32, 3)
    x = layers.GlobalAveragePooling2D()(x)
    outputs = layers.Dense(num_classes, activation="softmax", dtype="float32")(x)
    return keras.Model(inputs, outputs, name=name)
