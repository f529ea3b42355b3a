"""Imbalanced classification (credit-card fraud) with `class_weight` and confusion-matrix
metrics.

Source: https://github.com/keras-team/keras-io/blob/master/examples/structured_data/
imbalanced_classification.py (Dense 256-256 with Dropout 0.3, sigmoid output, Adam 1e-2,
FalseNegatives/FalsePositives/TrueNegatives/TruePositives/Precision/Recall, class weights
1/count). The 284,807 transactions of 30 features become 107 synthetic ones with about 1 in
8 positive; the batch 2,048 becomes 25.
"""

import keras
import numpy as np

SOURCE = (
    "https://github.com/keras-team/keras-io/blob/master/examples/structured_data/"
    "imbalanced_classification.py"
)
SAVE = "keras"
SAMPLES = 107


def build():
    return keras.Sequential(
        [
            keras.Input(shape=(30,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dropout(0.3),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dropout(0.3),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )


def compile(model):
    metrics = [
        keras.metrics.FalseNegatives(name="fn"),
        keras.metrics.FalsePositives(name="fp"),
        keras.metrics.TrueNegatives(name="tn"),
        keras.metrics.TruePositives(name="tp"),
        keras.metrics.Precision(name="precision"),
        keras.metrics.Recall(name="recall"),
    ]
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="binary_crossentropy",
                  metrics=metrics)


def _data():
    rng = np.random.default_rng(8)
    y = (rng.random(SAMPLES) < 0.125).astype("float32")[:, None]
    x = rng.normal(size=(SAMPLES, 30)).astype("float32") + 0.5 * y
    mean, std = x.mean(axis=0), x.std(axis=0)
    return (x - mean) / std, y


def fit_kwargs(workdir):
    x, y = _data()
    counts = np.bincount(y[:, 0].astype(int))
    class_weight = {0: 1.0 / counts[0], 1: 1.0 / counts[1]}
    return {"x": x, "y": y, "batch_size": 25, "epochs": 3, "verbose": 0,
            "validation_data": (x[:40], y[:40]), "class_weight": class_weight}


def predict_x():
    return _data()[0]
