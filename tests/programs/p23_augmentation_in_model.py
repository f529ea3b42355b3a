"""Image classification from scratch: augmentation layers inside the model (RandomFlip,
RandomRotation), Rescaling, a small Xception-like network (SeparableConv2D, BatchNorm,
residual adds), Dropout and a binary logit; with a Normalization layer adapted to the data
before the model is wrapped, and gradients clipped to a global norm.

Source: https://github.com/keras-team/keras-io/blob/master/examples/vision/
image_classification_from_scratch.py (Adam 3e-4, BinaryCrossentropy(from_logits=True),
BinaryAccuracy "acc"). The 180x180 cats and dogs become 107 synthetic 24x24 images; the
network keeps the source's block structure with fewer, narrower blocks (32 and 64 filters);
the batch 128 becomes 25. The adapted Normalization (from keras-io's structured-data
examples) and `global_clipnorm=1.0` are additions: the one gives the model statistics of the
data that every device must share, the other a norm that must be taken of the whole batch's
gradient, not one device's share.

The augmentation draws one flip and one angle per image: N devices give each image the draw
one device gives it (the rows' own draws, not a device's batch-shaped draw).

Adam amplifies rounding here, as in p06: BatchNormalization cancels the biases of the
convolutions before it, so their gradients are zero up to rounding, and Adam divides each
gradient by its own running magnitude. On JAX, 3 devices moved 11 of the 32 biases of one
such convolution by up to 3.4e-6 (values of 1e-6) while every other weight and log agreed
(2026-11-26). The test shows it with a control that needs no padding (CONTROL) and checks
exactness under SGD, which has no such division, in float32 (FLOAT64 = False): in float64,
Keras 3.15.1's RandomRotation fails on TensorFlow, with or without the wrapper ("Input 'y' of
'Mul' Op has type float32 that does not match type float64").
"""

import keras
import numpy as np
from keras import layers

SOURCE = ("https://github.com/keras-team/keras-io/blob/master/examples/vision/"
          "image_classification_from_scratch.py")
SAVE = "keras"
SAMPLES, SIZE = 107, 24
FLOAT64 = False  # see above: RandomRotation on TensorFlow
AMPLIFIED = "Adam normalises the rounding-level gradients of convolution biases cancelled by " \
            "BatchNorm"


def _data():
    rng = np.random.default_rng(23)
    x = rng.uniform(0, 255, (SAMPLES, SIZE, SIZE, 3)).astype("float32")
    y = rng.integers(0, 2, (SAMPLES, 1)).astype("float32")
    x[y[:, 0] == 1, : SIZE // 2] *= 0.5  # something to learn: a darker top half
    return x, y


def build():
    data_augmentation = keras.Sequential(
        [layers.RandomFlip("horizontal"), layers.RandomRotation(0.1)]
    )
    normalization = layers.Normalization()
    normalization.adapt(_data()[0] / 255.0)

    inputs = keras.Input(shape=(SIZE, SIZE, 3))
    x = data_augmentation(inputs)
    x = layers.Rescaling(1.0 / 255)(x)
    x = normalization(x)
    x = layers.Conv2D(32, 3, strides=2, padding="same")(x)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)
    previous_block_activation = x
    for size in [64]:
        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(size, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(size, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.MaxPooling2D(3, strides=2, padding="same")(x)
        residual = layers.Conv2D(size, 1, strides=2, padding="same")(previous_block_activation)
        x = layers.add([x, residual])
        previous_block_activation = x
    x = layers.SeparableConv2D(64, 3, padding="same")(x)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)
    x = layers.GlobalAveragePooling2D()(x)
    x = layers.Dropout(0.25)(x)
    outputs = layers.Dense(1, activation=None)(x)
    return keras.Model(inputs, outputs)


def EXACT_OPTIMIZER():  # noqa: N802 (a constant-like factory)
    return keras.optimizers.SGD(0.001, momentum=0.9, global_clipnorm=1.0)


def compile(model, optimizer=None):
    model.compile(
        optimizer=optimizer or keras.optimizers.Adam(3e-4, global_clipnorm=1.0),
        loss=keras.losses.BinaryCrossentropy(from_logits=True),
        metrics=[keras.metrics.BinaryAccuracy(name="acc")],
    )


def fit_kwargs(workdir):
    x, y = _data()
    return {"x": x, "y": y, "batch_size": 25, "epochs": 2, "validation_split": 0.1,
            "verbose": 0}


def CONTROL(workdir):  # noqa: N802
    """No padding anywhere: 96 images in batches of 24, on 1, 2 or 3 devices."""
    x, y = _data()
    return {"x": x[:96], "y": y[:96], "batch_size": 24, "epochs": 2, "shuffle": False,
            "verbose": 0}


def predict_x():
    return _data()[0][:30]
