"""Transfer learning, then fine-tuning: a frozen base called with `training=False` under a
new head, trained; then the base unfrozen, the model compiled again with a learning rate
100 times lower, and trained again (`fine_tune`, the second phase).

Source: https://github.com/keras-team/keras-io/blob/master/guides/transfer_learning.py
("An end-to-end example: fine-tuning an image classification model on a cats vs. dogs
dataset": RandomFlip and RandomRotation, Rescaling(1/127.5, offset=-1), the base called with
`training=False`, GlobalAveragePooling2D, Dropout(0.2), Dense(1); Adam() and
BinaryCrossentropy(from_logits=True) with BinaryAccuracy; then `base_model.trainable = True`
and Adam(1e-5)). No weights can be downloaded: ImageNet's Xception becomes a small base of
Xception's own blocks (convolutions without bias, BatchNormalization, a separable block with
a residual), built from the seed. The 150x150 cats and dogs become 83 synthetic 20x20
images; the batch 32 becomes 20; each phase trains 2 epochs.
"""

import keras
import numpy as np
from keras import layers

SOURCE = "https://github.com/keras-team/keras-io/blob/master/guides/transfer_learning.py"
SAVE = "keras"
SAMPLES, SIZE = 83, 20


def _data():
    rng = np.random.default_rng(24)
    x = rng.uniform(0, 255, (SAMPLES, SIZE, SIZE, 3)).astype("float32")
    y = rng.integers(0, 2, (SAMPLES, 1)).astype("float32")
    x[y[:, 0] == 1, :, : SIZE // 2] *= 0.6  # something to learn: a darker left half
    return x, y


def _base():
    """The stand-in for `keras.applications.Xception(include_top=False)`: its entry flow,
    narrower."""
    inputs = keras.Input((SIZE, SIZE, 3))
    x = layers.Conv2D(16, 3, strides=2, use_bias=False)(inputs)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)
    residual = layers.Conv2D(32, 1, strides=2, padding="same", use_bias=False)(x)
    residual = layers.BatchNormalization()(residual)
    x = layers.SeparableConv2D(32, 3, padding="same", use_bias=False)(x)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)
    x = layers.SeparableConv2D(32, 3, padding="same", use_bias=False)(x)
    x = layers.BatchNormalization()(x)
    x = layers.MaxPooling2D(3, strides=2, padding="same")(x)
    return keras.Model(inputs, layers.add([x, residual]), name="base_model")


def build():
    base_model = _base()
    base_model.trainable = False  # freeze the base

    data_augmentation = keras.Sequential(
        [layers.RandomFlip("horizontal"), layers.RandomRotation(0.1)]
    )
    inputs = keras.Input(shape=(SIZE, SIZE, 3))
    x = data_augmentation(inputs)
    scale_layer = layers.Rescaling(scale=1 / 127.5, offset=-1)
    x = scale_layer(x)
    # The base runs in inference mode here, as the guide explains for BatchNormalization.
    x = base_model(x, training=False)
    x = layers.GlobalAveragePooling2D()(x)
    x = layers.Dropout(0.2)(x)
    outputs = layers.Dense(1)(x)
    return keras.Model(inputs, outputs)


def compile(model, optimizer=None):
    model.compile(
        optimizer=optimizer or keras.optimizers.Adam(),
        loss=keras.losses.BinaryCrossentropy(from_logits=True),
        metrics=[keras.metrics.BinaryAccuracy()],
    )


def fine_tune(model, target, optimizer=None):
    """The guide's second phase: unfreeze the base, compile again with a low rate."""
    model.get_layer("base_model").trainable = True
    target.compile(
        optimizer=optimizer or keras.optimizers.Adam(1e-5),
        loss=keras.losses.BinaryCrossentropy(from_logits=True),
        metrics=[keras.metrics.BinaryAccuracy()],
    )


def fit_kwargs(workdir):
    x, y = _data()
    return {"x": x, "y": y, "batch_size": 20, "epochs": 2, "validation_split": 0.15,
            "verbose": 0}


def predict_x():
    return _data()[0][:30]
