"""Layers and a model with their own `training` argument: a seeded custom Dropout whose
`call(inputs, training=None)` acts only in training, an MLP block, and a model whose
`call(self, inputs, training=False)` passes the flag down.

Source: https://github.com/keras-team/keras-io/blob/master/guides/
making_new_layers_and_models_via_subclassing.py ("Privileged training argument in the call()
method": CustomDropout with a SeedGenerator; the Linear layer and MLPBlock). Adapted: the
blocks form a small regression model trained with SGD on 107 synthetic rows of 64 features,
batch 25.
"""

import keras
import numpy as np
from keras import ops

SOURCE = (
    "https://github.com/keras-team/keras-io/blob/master/guides/"
    "making_new_layers_and_models_via_subclassing.py"
)
SAVE = "weights"
SAMPLES = 107


class Linear(keras.layers.Layer):
    def __init__(self, units=32):
        super().__init__()
        self.units = units

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1], self.units),
                                 initializer="random_normal", trainable=True)
        self.b = self.add_weight(shape=(self.units,), initializer="random_normal",
                                 trainable=True)

    def call(self, inputs):
        return ops.matmul(inputs, self.w) + self.b


class CustomDropout(keras.layers.Layer):
    def __init__(self, rate, **kwargs):
        super().__init__(**kwargs)
        self.rate = rate
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs, training=None):
        if training:
            return keras.random.dropout(inputs, rate=self.rate, seed=self.seed_generator)
        return inputs


class MLPBlock(keras.Model):
    def __init__(self):
        super().__init__()
        self.linear_1 = Linear(32)
        self.dropout = CustomDropout(0.5)
        self.linear_2 = Linear(32)
        self.linear_3 = Linear(1)

    def call(self, inputs, training=False):
        x = ops.relu(self.linear_1(inputs))
        x = self.dropout(x, training=training)
        x = ops.relu(self.linear_2(x))
        return self.linear_3(x)


def build():
    model = MLPBlock()
    model(np.zeros((1, 64), "float32"))
    return model


def compile(model):
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])


def _data():
    rng = np.random.default_rng(13)
    x = rng.normal(size=(SAMPLES, 64)).astype("float32")
    return x, (x[:, :4].sum(axis=1, keepdims=True) > 0).astype("float32")


def fit_kwargs(workdir):
    x, y = _data()
    return {"x": x, "y": y, "batch_size": 25, "epochs": 3, "verbose": 0}


def predict_x():
    return _data()[0]
