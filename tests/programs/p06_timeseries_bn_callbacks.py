"""Time-series classification from scratch (FordA): a Conv1D + BatchNormalization network
with ModelCheckpoint, ReduceLROnPlateau and EarlyStopping on a validation split.

Source: https://github.com/keras-team/keras-io/blob/master/examples/timeseries/
timeseries_classification_from_scratch.py. FordA (3,601 series of 500 steps, 2 classes)
becomes 107 synthetic series of the same shape; the batch 32 becomes 25. The callbacks keep
the source's monitors with patience cut to fit 4 epochs, and EarlyStopping restores the best
weights, so both callbacks act during the run.

Adam amplifies rounding here: BatchNormalization cancels each Conv1D bias, so their
gradients are zero up to rounding, and Adam divides each gradient by its own running
magnitude, turning rounding-level noise into full-size steps. A reduction summed in another
order (any change of device count) then moves those biases differently. The test shows this
with a control that needs no padding (CONTROL), and checks exactness with the same program
under SGD (EXACT_OPTIMIZER), which has no such division, or, on TensorFlow (whose float64
convolutions make it possible), as written in float64.

SGD's learning rate is 0.001, not the 0.01 tried first: at 0.01 with momentum 0.9, the
BatchNorm network amplifies float32 rounding past the tolerance on one device alone. The
same 100 rows reordered within each batch of 25 (the same sums in another order) moved the
weights by 2.0, 13 and 65 times the tolerance after 1, 2 and 4 epochs on JAX (Xeon with
AVX-512, 2026-11-24); at 0.001, by 0.066 times after 4 epochs.
"""

import os

import keras
import numpy as np

SOURCE = (
    "https://github.com/keras-team/keras-io/blob/master/examples/timeseries/"
    "timeseries_classification_from_scratch.py"
)
SAVE = "keras"
SAMPLES = 107
AMPLIFIED = "Adam normalises the rounding-level gradients of Conv1D biases cancelled by BatchNorm"


def build():
    input_layer = keras.layers.Input((500, 1))
    x = input_layer
    for _ in range(3):
        x = keras.layers.Conv1D(filters=64, kernel_size=3, padding="same")(x)
        x = keras.layers.BatchNormalization()(x)
        x = keras.layers.ReLU()(x)
    gap = keras.layers.GlobalAveragePooling1D()(x)
    output_layer = keras.layers.Dense(2, activation="softmax")(gap)
    return keras.models.Model(inputs=input_layer, outputs=output_layer)


def EXACT_OPTIMIZER():  # noqa: N802 (a constant-like factory)
    return keras.optimizers.SGD(0.001, momentum=0.9)


def compile(model, optimizer="adam"):
    model.compile(
        optimizer=optimizer,
        loss="sparse_categorical_crossentropy",
        metrics=["sparse_categorical_accuracy"],
    )


def _data():
    rng = np.random.default_rng(6)
    t = np.linspace(0, 8 * np.pi, 500, dtype="float32")
    y = rng.integers(0, 2, SAMPLES)
    x = np.sin(t[None, :] * (1.0 + y[:, None])) + rng.normal(0, 0.5, (SAMPLES, 500))
    return x.astype("float32")[..., None], y


def fit_kwargs(workdir):
    x, y = _data()
    callbacks = [
        keras.callbacks.ModelCheckpoint(
            os.path.join(workdir, "best_model.keras"), save_best_only=True, monitor="val_loss"
        ),
        keras.callbacks.ReduceLROnPlateau(
            monitor="val_loss", factor=0.5, patience=1, min_lr=0.0001
        ),
        keras.callbacks.EarlyStopping(monitor="val_loss", patience=2, restore_best_weights=True),
    ]
    return {
        "x": x, "y": y, "batch_size": 25, "epochs": 4, "callbacks": callbacks,
        "validation_split": 0.2, "verbose": 0,
    }


def CONTROL(workdir):  # noqa: N802
    """No padding anywhere: 96 samples in batches of 24, on 1, 2 or 3 devices."""
    x, y = _data()
    return {"x": x[:96], "y": y[:96], "batch_size": 24, "epochs": 2, "shuffle": False,
            "verbose": 0}


def predict_x():
    return _data()[0]
