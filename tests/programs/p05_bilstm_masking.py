"""A bidirectional LSTM sentiment classifier over zero-padded token sequences, with the
padding masked by `Embedding(mask_zero=True)`.

Source: https://github.com/keras-team/keras-io/blob/master/examples/nlp/
bidirectional_lstm_imdb.py (Embedding 20,000 x 128, two Bidirectional LSTM(64), sigmoid
output, adam, binary crossentropy, accuracy, maxlen 200), with the mask of
https://github.com/keras-team/keras-io/blob/master/guides/understanding_masking_and_padding.py.
IMDB becomes 107 synthetic reviews of random lengths, zero-padded to 32 (not 200: the
LSTMs' steps are this program's time, on every engine); the batch 32 becomes 25.
"""

import keras
import numpy as np
from keras import layers

SOURCE = (
    "https://github.com/keras-team/keras-io/blob/master/examples/nlp/bidirectional_lstm_imdb.py"
)
SAVE = "keras"
MAX_FEATURES, MAXLEN, SAMPLES = 20000, 32, 107


def build():
    inputs = keras.Input(shape=(None,), dtype="int32")
    x = layers.Embedding(MAX_FEATURES, 128, mask_zero=True)(inputs)
    x = layers.Bidirectional(layers.LSTM(64, return_sequences=True))(x)
    x = layers.Bidirectional(layers.LSTM(64))(x)
    outputs = layers.Dense(1, activation="sigmoid")(x)
    return keras.Model(inputs, outputs)


def compile(model):
    model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])


def _reviews(count, seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(5, MAXLEN, count)
    x = np.zeros((count, MAXLEN), "int32")
    for row, length in enumerate(lengths):
        x[row, MAXLEN - length :] = rng.integers(1, MAX_FEATURES, length)  # pre-padding
    return x, rng.integers(0, 2, count).astype("float32")


def fit_kwargs(workdir):
    x_train, y_train = _reviews(SAMPLES, 5)
    x_val, y_val = _reviews(31, 55)
    return {"x": x_train, "y": y_train, "batch_size": 25, "epochs": 2,
            "validation_data": (x_val, y_val), "verbose": 0}


def predict_x():
    return _reviews(SAMPLES, 5)[0]
