"""The reference experiment: MiniGoogLeNet on CIFAR-10, on every device.

Reproduces the post this project started from (70 epochs, 64 images per
device per step, SGD with momentum 0.9 from 5e-3 decaying linearly to 0,
random shifts and flips, mean subtraction) and writes what it showed:
`plot.png`, `history.json` and the trained `model.keras`, after every epoch,
so that a crash or a Ctrl-C keeps the epochs already done, and `monitor/`
(`DeviceMonitor`'s timeline, step times, figure and verdict) when training ends.
"""

import dataclasses
import logging
import math
import os
import shutil
import sys
import time

import keras
import numpy as np

from keras_multigpu import callbacks as callbacks_lib
from keras_multigpu import data as data_lib
from keras_multigpu import models, processes
from keras_multigpu._io import atomic_path, write_json
from keras_multigpu.experiment_config import Config  # noqa: F401 - its home before
from keras_multigpu.parallel import multi_gpu_model

logger = logging.getLogger(__name__)


def build_models(mean, width=1.0, augment=True, seed=None, batchnorm=True):
    """MiniGoogLeNet with the recipe's preprocessing, for training and for saving.

    Returns `(train_model, saved_model)`, which share every weight. The
    training model shifts and flips its inputs inside the compiled step, on
    the device. The saved model omits that training-only layer (an identity
    at inference) and so loads with plain Keras. Both subtract the training
    mean themselves: they take raw pixel values.
    """
    inputs = keras.Input(mean.shape, name="image")
    normalize = keras.layers.Normalization(
        axis=(1, 2, 3), mean=mean, variance=np.ones_like(mean), name="subtract_mean"
    )
    network = models.mini_googlenet(mean.shape, width=width, batchnorm=batchnorm)
    saved = keras.Model(inputs, network(normalize(inputs)), name="minigooglenet_cifar10")
    if not augment:
        return saved, saved
    shifted = data_lib.RandomShiftFlip(0.1, seed=seed, name="shift_flip")(inputs)
    train = keras.Model(inputs, network(normalize(shifted)), name="minigooglenet_train")
    return train, saved


def save_model(model, path):
    """Writes `model` to a `.keras` file atomically; with several processes (torch's), Keras's
    save, which process 0 alone writes, atomically, as the others wait (`processes`)."""
    if processes.count() > 1:
        return model.save(path)
    with atomic_path(path, ".keras") as tmp:
        model.save(tmp)


OUTPUT_FILES = ("model.keras", "history.json", "plot.png")
MONITOR_DIR = "monitor"  # DeviceMonitor's timeline.csv, steps.csv and monitor.png


def keras_verbose(verbose):
    """Keras's `verbose` for `fit`: "auto" is a progress bar on a terminal, else one line
    per epoch (a piped or redirected log gets no progress-bar escapes)."""
    if verbose == "auto":
        isatty = getattr(sys.stdout, "isatty", None)
        return 1 if isatty is not None and isatty() else 2
    return verbose


def _summarize(config, parallel, template, x_train, x_test, batch_size, epochs, total):
    seconds = [e["seconds"] for e in epochs]
    # The first epoch includes compilation: the steady state excludes it.
    steady = seconds[1:] or seconds
    return {
        "config": dataclasses.asdict(config),
        "devices": [str(d) for d in parallel.devices],
        "device_names": sorted({d.name for d in parallel.devices}),
        "train_images": len(x_train),
        "test_images": len(x_test),
        "global_batch": batch_size,
        "parameters": int(template.count_params()),
        "total_seconds": total,
        "first_epoch_seconds": seconds[0],
        "mean_epoch_seconds": float(np.mean(steady)),
        "images_per_second": len(x_train) / float(np.mean(steady)),
        "final_val_accuracy": epochs[-1].get("val_accuracy"),
        "final_val_loss": epochs[-1].get("val_loss"),
    }


def _kept(output, saved, planned):
    if not saved:
        return "nothing was saved: the first epoch had not ended"
    return (f"{output} keeps {saved} of {planned} epoch(s) "
            f"({', '.join(OUTPUT_FILES)}, written after each epoch)")


def run(config):
    """Trains once; writes plot.png, history.json and model.keras into `config.output`.

    The three files are written (atomically) after every epoch, so a run that
    crashes or is interrupted keeps the epochs it finished: `history.json`
    then says `"complete": false`. The folder is created with the first file.
    An exception leaving training gets a note (`add_note`) saying what was kept.

    Returns:
        The summary dict that `history.json` holds (without the per-epoch list).
    """
    from keras_multigpu import plots

    config.validate()
    keras.utils.set_random_seed(config.seed)
    keras.config.set_dtype_policy(config.precision)
    try:
        # The folder found (--data-dir, KERAS_MULTIGPU_DATA, Keras's cache, a download) is
        # recorded in history.json's "data": the config holds --data-dir alone.
        data_folder = data_lib.find_cifar10(config.data_dir)
        (x_train, y_train), (x_test, y_test) = data_lib.load_cifar10(data_folder, config.limit)
        if not len(x_train) or not len(x_test):
            raise ValueError(
                f"The data holds {len(x_train)} training and {len(x_test)} test images; "
                "training needs at least one of each. Check --data-dir."
            )
        x_train, x_test = x_train.astype("float32"), x_test.astype("float32")
        mean = x_train.mean(axis=0)
        y_train, y_test = (keras.utils.to_categorical(y, 10) for y in (y_train, y_test))

        template, saved_model = build_models(mean, config.width, config.augment, config.seed)
        parallel = multi_gpu_model(template, gpus=config.gpus)
        batch_size = config.batch_per_device * parallel.num_replicas
        steps = math.ceil(len(x_train) / batch_size) * config.epochs
        if steps < 1:
            raise ValueError(
                f"{len(x_train)} training images in batches of {batch_size} for "
                f"{config.epochs} epoch(s) make {steps} steps; training needs at least one."
            )
        schedule = keras.optimizers.schedules.PolynomialDecay(config.lr, steps, 0.0, power=1.0)
        parallel.compile(
            optimizer=keras.optimizers.SGD(schedule, momentum=config.momentum),
            loss="categorical_crossentropy",
            metrics=["accuracy"],
        )
        logger.info("Training on %s, global batch %d", parallel.devices, batch_size)
        paths = {name: os.path.join(config.output, name) for name in OUTPUT_FILES}

        def write(epochs, complete):
            summary = _summarize(config, parallel, template, x_train, x_test, batch_size,
                                 epochs, time.perf_counter() - started)
            summary["data"] = str(data_folder)
            if watch.verdict is not None:
                summary["verdict"] = {k: watch.verdict[k] for k in (
                    "bound", "input", "communication", "lagging_device", "lines", "fixes")}
            save_model(saved_model, paths["model.keras"])
            if processes.rank() == 0:  # the other processes' figures are the same run's
                write_json(paths["history.json"], {**summary, "complete": complete,
                                                   "epochs": epochs})
                plots.training_curves(epochs, summary, paths["plot.png"])
            return summary

        recorder = callbacks_lib.EpochRecorder(lambda epochs: write(epochs, False))
        # What held training back (input, compute, communication), printed at the end.
        watch = callbacks_lib.DeviceMonitor(os.path.join(config.output, MONITOR_DIR))
        started = time.perf_counter()
        try:
            parallel.fit(
                x_train, y_train, batch_size=batch_size, epochs=config.epochs,
                validation_data=(x_test, y_test), verbose=keras_verbose(config.verbose),
                callbacks=[callbacks_lib.EpochStats(len(x_train)), recorder, watch],
            )
            return write(recorder.epochs, True)
        except BaseException as error:
            if not recorder.saved:  # nothing kept: no monitor files alone in the folder
                shutil.rmtree(os.path.join(config.output, MONITOR_DIR), ignore_errors=True)
            error.add_note(_kept(config.output, recorder.saved, config.epochs))
            raise
    finally:
        keras.config.set_dtype_policy("float32")


def summary_line(summary):
    """The one closing line `train` prints."""
    return (
        f"devices={len(summary['devices'])} ({', '.join(summary['devices'])}) "
        f"total={summary['total_seconds']:.1f}s "
        f"epoch={summary['mean_epoch_seconds']:.2f}s "
        f"({summary['images_per_second']:.0f} img/s, first epoch "
        f"{summary['first_epoch_seconds']:.1f}s) "
        f"val_accuracy={_number(summary['final_val_accuracy'])}"
    )


def _number(value):
    return "-" if value is None else f"{value:.4f}"
