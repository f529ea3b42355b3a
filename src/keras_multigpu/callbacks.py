"""Callbacks for the experiment: per-epoch timing and learning rate."""

import time

import keras
import numpy as np


class EpochStats(keras.callbacks.Callback):
    """Adds `seconds`, `images_per_second` and `learning_rate` to each epoch's logs.

    `seconds` is the training part of the epoch (validation excluded), so
    `images_per_second = num_samples / seconds` is training throughput. Keras
    syncs the device state at the end of the training loop, before
    validation starts, so the time includes the last step's completion.

    Args:
        num_samples: training images per epoch.
    """

    def __init__(self, num_samples):
        super().__init__()
        self.num_samples = num_samples
        self._start = None
        self._train_seconds = None

    def on_epoch_begin(self, epoch, logs=None):
        self._train_seconds = None
        self._start = time.perf_counter()

    def on_test_begin(self, logs=None):
        if self._start is not None and self._train_seconds is None:
            self._train_seconds = time.perf_counter() - self._start

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        seconds = self._train_seconds or time.perf_counter() - self._start
        logs["seconds"] = seconds
        logs["images_per_second"] = self.num_samples / seconds
        logs["learning_rate"] = float(
            np.asarray(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
        )
