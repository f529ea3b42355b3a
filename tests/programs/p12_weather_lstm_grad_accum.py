"""Weather forecasting with an LSTM over 120 hourly steps of 7 features, trained with
gradient accumulation (the optimizer averages 2 batches' gradients per update) and a
validation set, with EarlyStopping and ModelCheckpoint.

Source: https://github.com/keras-team/keras-io/blob/master/examples/timeseries/
timeseries_weather_forecasting.py (LSTM(32), Dense(1), Adam 1e-3, mse, EarlyStopping on
val_loss, ModelCheckpoint with save_best_only and save_weights_only). Adapted: Adam gets
gradient_accumulation_steps=2. The Jena climate series becomes 107 synthetic windows of the
same shape; the batch 256 becomes 25.
"""

import os

import keras
import numpy as np

SOURCE = (
    "https://github.com/keras-team/keras-io/blob/master/examples/timeseries/"
    "timeseries_weather_forecasting.py"
)
SAVE = "keras"
SAMPLES = 107


def build():
    inputs = keras.layers.Input(shape=(120, 7))
    lstm_out = keras.layers.LSTM(32)(inputs)
    outputs = keras.layers.Dense(1)(lstm_out)
    return keras.Model(inputs=inputs, outputs=outputs)


def compile(model):
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate=0.001, gradient_accumulation_steps=2),
        loss="mse",
    )


def _windows(count, seed):
    rng = np.random.default_rng(seed)
    t = np.arange(120 + 1)[None, :] + rng.integers(0, 1000, (count, 1))
    series = np.sin(2 * np.pi * t[..., None] / 24.0 * (1 + np.arange(7) / 7.0))
    series = series + rng.normal(0, 0.1, series.shape)
    return series[:, :120].astype("float32"), series[:, 120, :1].astype("float32")


def fit_kwargs(workdir):
    x, y = _windows(SAMPLES, 12)
    callbacks = [
        keras.callbacks.EarlyStopping(monitor="val_loss", min_delta=0, patience=5),
        keras.callbacks.ModelCheckpoint(
            monitor="val_loss", filepath=os.path.join(workdir, "model_checkpoint.weights.h5"),
            verbose=0, save_weights_only=True, save_best_only=True,
        ),
    ]
    return {"x": x, "y": y, "batch_size": 25, "epochs": 3, "verbose": 0,
            "validation_data": _windows(33, 13), "callbacks": callbacks}


def predict_x():
    return _windows(SAMPLES, 12)[0]
