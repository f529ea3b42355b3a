"""The ticket classifier of the Functional API guide: three named inputs, two named outputs,
dict data and loss_weights.

Source: https://github.com/keras-team/keras-io/blob/master/guides/functional_api.py
("Models with multiple inputs and outputs"). The guide trains on random data already; here
1,280 samples become 107 and the batch 32 becomes 25.
"""

import keras
import numpy as np

SOURCE = "https://github.com/keras-team/keras-io/blob/master/guides/functional_api.py"
SAVE = "keras"

NUM_TAGS = 12
NUM_WORDS = 10000
NUM_DEPARTMENTS = 4
SAMPLES = 107


def build():
    title_input = keras.Input(shape=(None,), name="title")
    body_input = keras.Input(shape=(None,), name="body")
    tags_input = keras.Input(shape=(NUM_TAGS,), name="tags")
    title_features = keras.layers.Embedding(NUM_WORDS, 64)(title_input)
    body_features = keras.layers.Embedding(NUM_WORDS, 64)(body_input)
    title_features = keras.layers.LSTM(128)(title_features)
    body_features = keras.layers.LSTM(32)(body_features)
    x = keras.layers.concatenate([title_features, body_features, tags_input])
    priority_pred = keras.layers.Dense(1, name="priority")(x)
    department_pred = keras.layers.Dense(NUM_DEPARTMENTS, name="department")(x)
    return keras.Model(
        inputs=[title_input, body_input, tags_input],
        outputs=[priority_pred, department_pred],
    )


def compile(model):
    model.compile(
        optimizer=keras.optimizers.RMSprop(1e-3),
        loss={
            "priority": keras.losses.BinaryCrossentropy(from_logits=True),
            "department": keras.losses.CategoricalCrossentropy(from_logits=True),
        },
        loss_weights={"priority": 1.0, "department": 0.2},
    )


def _data():
    rng = np.random.default_rng(3)
    x = {
        "title": rng.integers(NUM_WORDS, size=(SAMPLES, 10)),
        "body": rng.integers(NUM_WORDS, size=(SAMPLES, 100)),
        "tags": rng.integers(2, size=(SAMPLES, NUM_TAGS)).astype("float32"),
    }
    y = {
        "priority": rng.random(size=(SAMPLES, 1)).astype("float32"),
        "department": rng.integers(2, size=(SAMPLES, NUM_DEPARTMENTS)).astype("float32"),
    }
    return x, y


def fit_kwargs(workdir):
    x, y = _data()
    return {"x": x, "y": y, "epochs": 2, "batch_size": 25, "verbose": 0}


def predict_x():
    return _data()[0]
