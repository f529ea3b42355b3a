"""A `keras.utils.PyDataset` that Keras shuffles (batch order) every epoch.

Source: https://github.com/keras-team/keras-io/blob/master/guides/
training_with_built_in_methods.py ("Using a keras.utils.PyDataset object" with the guide's
get_compiled_model: Dense 64-64-10 on flattened MNIST, RMSprop, sparse categorical
crossentropy and accuracy). MNIST becomes 107 synthetic 784-pixel rows; the dataset's batch
of 64 becomes 25, so its last batch has 7 rows. `fit` keeps Keras's default shuffle=True.
"""

import math

import keras
import numpy as np
from keras import layers

SOURCE = (
    "https://github.com/keras-team/keras-io/blob/master/guides/training_with_built_in_methods.py"
)
SAVE = "keras"
SAMPLES = 107


class ExamplePyDataset(keras.utils.PyDataset):
    def __init__(self, x, y, batch_size, **kwargs):
        super().__init__(**kwargs)
        self.x = x
        self.y = y
        self.batch_size = batch_size

    def __len__(self):
        return math.ceil(len(self.x) / self.batch_size)

    def __getitem__(self, idx):
        batch_x = self.x[idx * self.batch_size : (idx + 1) * self.batch_size]
        batch_y = self.y[idx * self.batch_size : (idx + 1) * self.batch_size]
        return batch_x, batch_y


def build():
    inputs = keras.Input(shape=(784,), name="digits")
    x = layers.Dense(64, activation="relu", name="dense_1")(inputs)
    x = layers.Dense(64, activation="relu", name="dense_2")(x)
    outputs = layers.Dense(10, activation="softmax", name="predictions")(x)
    return keras.Model(inputs=inputs, outputs=outputs)


def compile(model):
    model.compile(
        optimizer="rmsprop",
        loss="sparse_categorical_crossentropy",
        metrics=["sparse_categorical_accuracy"],
    )


def _data():
    rng = np.random.default_rng(7)
    return rng.random((SAMPLES, 784)).astype("float32"), rng.integers(0, 10, SAMPLES)


def fit_kwargs(workdir):
    x, y = _data()
    return {"x": ExamplePyDataset(x, y, batch_size=25), "epochs": 3, "verbose": 0,
            "validation_data": ExamplePyDataset(x[:50], y[:50], batch_size=25)}


def predict_x():
    return _data()[0]
