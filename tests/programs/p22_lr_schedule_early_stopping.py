"""A learning-rate schedule (ExponentialDecay, staircase) driving RMSprop, beside a
LearningRateScheduler callback's log of the rate, and EarlyStopping on validation loss with
`min_delta` and `patience`.

Source: https://github.com/keras-team/keras-io/blob/master/guides/
training_with_built_in_methods.py (get_uncompiled_model: Dense 64-64-10 on flattened MNIST;
"Using learning rate schedules": ExponentialDecay(0.1, decay_steps=100000, decay_rate=0.96,
staircase=True) into RMSprop; "Using callbacks": EarlyStopping(monitor="val_loss",
min_delta=1e-2, patience=2)). Adapted to run in a test: MNIST becomes 107 synthetic
784-pixel rows with a validation split of 0.2; the batch 64 becomes 25; decay_steps becomes
3 so that the rate moves within the run, and 0.1 becomes 1e-3; 5 epochs.
"""

import keras
import numpy as np
from keras import layers

SOURCE = (
    "https://github.com/keras-team/keras-io/blob/master/guides/training_with_built_in_methods.py"
)
SAVE = "keras"
SAMPLES = 107


def build():
    inputs = keras.Input(shape=(784,), name="digits")
    x = layers.Dense(64, activation="relu", name="dense_1")(inputs)
    x = layers.Dense(64, activation="relu", name="dense_2")(x)
    outputs = layers.Dense(10, activation="softmax", name="predictions")(x)
    return keras.Model(inputs=inputs, outputs=outputs)


def compile(model):
    lr_schedule = keras.optimizers.schedules.ExponentialDecay(
        1e-3, decay_steps=3, decay_rate=0.96, staircase=True)
    model.compile(optimizer=keras.optimizers.RMSprop(learning_rate=lr_schedule),
                  loss="sparse_categorical_crossentropy",
                  metrics=["sparse_categorical_accuracy"])


def _data():
    rng = np.random.default_rng(22)
    return rng.random((SAMPLES, 784)).astype("float32"), rng.integers(0, 10, SAMPLES)


class _RateLog(keras.callbacks.Callback):
    """The optimizer's current rate in each epoch's logs (as a scheduler callback reports it)."""

    def on_epoch_end(self, epoch, logs=None):
        optimizer = self.model.optimizer
        logs["rate"] = float(keras.ops.convert_to_numpy(
            optimizer.learning_rate if not callable(optimizer._learning_rate)
            else optimizer._learning_rate(optimizer.iterations)))


def fit_kwargs(workdir):
    x, y = _data()
    callbacks = [
        keras.callbacks.EarlyStopping(monitor="val_loss", min_delta=1e-2, patience=2,
                                      verbose=0),
        _RateLog(),
    ]
    return {"x": x, "y": y, "batch_size": 25, "epochs": 5, "validation_split": 0.2,
            "callbacks": callbacks, "verbose": 0}


def predict_x():
    return _data()[0]
