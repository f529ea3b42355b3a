"""The simple MNIST convnet: two Conv2D/MaxPooling2D blocks, Dropout 0.5, softmax, with a
validation split.

Source: https://github.com/keras-team/keras-io/blob/master/examples/vision/mnist_convnet.py
(adam, categorical crossentropy, accuracy, validation_split=0.1). MNIST becomes 107
synthetic 28x28 images; the batch 128 becomes 25.

On TensorFlow, Adam amplifies rounding here: the first Conv2D's kernel gradient, summed over
13 + 12 rows instead of 25, differs by about 2e-6 of its size (oneDNN's convolution; XLA's
differs by a quarter of that), and Adam divides each gradient by its own running magnitude,
so entries near zero move differently and the weights leave 1e-4 within a few steps. In
float64 the runs agree to 1e-13, which the test checks. (Split evenly, 12 + 12 rows, the
runs stay within 1e-4 in float32: the amplification depends on the rows.)
"""

import keras
import numpy as np
from keras import layers

SOURCE = "https://github.com/keras-team/keras-io/blob/master/examples/vision/mnist_convnet.py"
SAVE = "keras"
AMPLIFIED = {"tensorflow": "Adam normalises gradients whose rounding TensorFlow's "
                           "convolutions change with the rows per device"}
NUM_CLASSES, SAMPLES = 10, 107


def build():
    return keras.Sequential(
        [
            keras.Input(shape=(28, 28, 1)),
            layers.Conv2D(32, kernel_size=(3, 3), activation="relu"),
            layers.MaxPooling2D(pool_size=(2, 2)),
            layers.Conv2D(64, kernel_size=(3, 3), activation="relu"),
            layers.MaxPooling2D(pool_size=(2, 2)),
            layers.Flatten(),
            layers.Dropout(0.5),
            layers.Dense(NUM_CLASSES, activation="softmax"),
        ]
    )


def compile(model):
    model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])


def _data():
    rng = np.random.default_rng(10)
    x = rng.random((SAMPLES, 28, 28, 1)).astype("float32")
    y = keras.utils.to_categorical(rng.integers(0, NUM_CLASSES, SAMPLES), NUM_CLASSES)
    return x, y


def fit_kwargs(workdir):
    x, y = _data()
    return {"x": x, "y": y, "batch_size": 25, "epochs": 2, "validation_split": 0.1,
            "verbose": 0}


def predict_x():
    return _data()[0]
