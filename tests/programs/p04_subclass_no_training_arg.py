"""A subclassed model whose `call(self, x)` takes no `training` argument, so Keras passes
its layers no training flag: its BatchNormalization and Dropout run in inference mode on one
device, and must through the wrapper too.

Source: https://github.com/keras-team/keras/blob/master/examples/demo_subclass.py (MyModel:
three Dense layers, SGD, mean squared error, validation_split=0.2). Adapted: a
BatchNormalization and a Dropout sit between the Dense layers, to hold the case where the
training flag matters; 50,000 random rows become 107 and the batch 32 becomes 25. The class
is registered, so the whole model saves as a .keras file.
"""

import keras
import numpy as np
from keras import layers

SOURCE = "https://github.com/keras-team/keras/blob/master/examples/demo_subclass.py"
SAVE = "keras"
SAMPLES = 107


@keras.saving.register_keras_serializable(package="programs")
class MyModel(keras.Model):
    def __init__(self, hidden_dim, output_dim, **kwargs):
        super().__init__(**kwargs)
        self.hidden_dim, self.output_dim = hidden_dim, output_dim
        self.dense1 = layers.Dense(hidden_dim, activation="relu")
        self.norm = layers.BatchNormalization()
        self.dense2 = layers.Dense(hidden_dim, activation="relu")
        self.dropout = layers.Dropout(0.5)
        self.dense3 = layers.Dense(output_dim)

    def call(self, x):
        x = self.dense1(x)
        x = self.norm(x)
        x = self.dense2(x)
        x = self.dropout(x)
        return self.dense3(x)

    def get_config(self):
        return {**super().get_config(), "hidden_dim": self.hidden_dim,
                "output_dim": self.output_dim}


def build():
    model = MyModel(hidden_dim=256, output_dim=16)
    model(np.zeros((1, 128), "float32"))  # built before wrapping, as usual
    return model


def compile(model):
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=0.001),
        loss=keras.losses.MeanSquaredError(),
        metrics=[keras.metrics.MeanSquaredError()],
    )


def _data():
    rng = np.random.default_rng(4)
    x = (rng.random((SAMPLES, 128)) * 10.0).astype("float32")  # far from BN's initial stats
    y = rng.random((SAMPLES, 16)).astype("float32")
    return x, y


def fit_kwargs(workdir):
    x, y = _data()
    return {"x": x, "y": y, "batch_size": 25, "epochs": 3, "validation_split": 0.2,
            "verbose": 0}


def predict_x():
    return _data()[0]
