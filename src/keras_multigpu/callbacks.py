"""Callbacks: per-epoch timing and learning rate for the experiment, `Checkpoint`
(`checkpoint.py`), which resumes a run exactly, mid-epoch included, and `DeviceMonitor`
(`monitor.py`)."""

import time

import keras
import numpy as np

from keras_multigpu._checkpoint_state import CHECKPOINT_FORMAT  # noqa: F401
from keras_multigpu.checkpoint import Checkpoint, CheckpointError  # noqa: F401


class EpochStats(keras.callbacks.Callback):
    """Adds `seconds`, `images_per_second` and `learning_rate` to each epoch's logs.

    `seconds` is the training part of the epoch (validation excluded), so
    `images_per_second = num_samples / seconds` is training throughput. Steps
    run asynchronously, so before reading the clock it waits for the last
    one: it reads the optimizer's iteration count, which that step wrote
    (Keras has handed the state back to the model by then). Nothing waits
    within the epoch.

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

    def _elapsed(self):
        keras.ops.convert_to_numpy(self.model.optimizer.iterations)  # the last step is done
        return time.perf_counter() - self._start

    def on_test_begin(self, logs=None):
        if self._start is not None and self._train_seconds is None:
            self._train_seconds = self._elapsed()

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        seconds = self._train_seconds or self._elapsed()
        logs["seconds"] = seconds
        logs["images_per_second"] = self.num_samples / seconds
        logs["learning_rate"] = float(
            np.asarray(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
        )


class EpochRecorder(keras.callbacks.Callback):
    """Keeps each epoch's logs and hands them all to `write` at every epoch end.

    Place it after `EpochStats` so that the logs it records hold the timings.
    `write(epochs)` gets the list of epoch records so far (`{"epoch": 1,
    "loss": ..., ...}`, floats); `saved` counts the epochs whose `write`
    returned, so after a crash it says how many epochs are on disk.

    Args:
        write: called as `write(epochs)` after each epoch.
    """

    def __init__(self, write):
        super().__init__()
        self.write = write
        self.epochs = []
        self.saved = 0

    def on_epoch_end(self, epoch, logs=None):
        record = {"epoch": epoch + 1}
        for key, value in (logs or {}).items():
            try:
                record[key] = float(np.asarray(keras.ops.convert_to_numpy(value)))
            except (TypeError, ValueError):
                continue  # not a number: nothing to plot or compare
        self.epochs.append(record)
        self.write(list(self.epochs))
        self.saved = len(self.epochs)


def __getattr__(name):
    # `DeviceMonitor` lives in `monitor` and is imported on first use: NVML and matplotlib
    # come with the `monitor` extra, and a plain `import keras_multigpu` loads neither.
    if name == "DeviceMonitor":
        from keras_multigpu.monitor import DeviceMonitor

        return DeviceMonitor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
