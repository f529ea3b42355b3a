"""The reference experiment: MiniGoogLeNet on CIFAR-10, on every device.

Reproduces the post this project started from (70 epochs, 64 images per
device per step, SGD with momentum 0.9 from 5e-3 decaying linearly to 0,
random shifts and flips, mean subtraction) and writes what it showed:
`plot.png`, `history.json` and the trained `model.keras`.
"""

import dataclasses
import logging
import math
import os
import time

import keras
import numpy as np

from keras_multigpu import callbacks as callbacks_lib
from keras_multigpu import data as data_lib
from keras_multigpu import models
from keras_multigpu._io import atomic_path, write_json
from keras_multigpu.parallel import multi_gpu_model

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Config:
    """One training run; CLI flags map one-to-one to these fields."""

    gpus: int | None = None
    epochs: int = 70
    batch_per_device: int = 64
    lr: float = 5e-3
    momentum: float = 0.9
    width: float = 1.0
    limit: int | None = None
    data_dir: str | None = None
    seed: int = 42
    augment: bool = True
    precision: str = "float32"
    output: str = "runs/minigooglenet"
    verbose: int | str = "auto"

    def validate(self):
        for name in ("epochs", "batch_per_device"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer. Received: {name}={value!r}.")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0. Received: lr={self.lr!r}.")
        if self.precision not in ("float32", "mixed_bfloat16", "mixed_float16"):
            raise ValueError(
                "precision must be float32, mixed_bfloat16 or mixed_float16. "
                f"Received: precision={self.precision!r}."
            )


def build_models(mean, width=1.0, augment=True, seed=None):
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
    network = models.mini_googlenet(mean.shape, width=width)
    saved = keras.Model(inputs, network(normalize(inputs)), name="minigooglenet_cifar10")
    if not augment:
        return saved, saved
    shifted = data_lib.RandomShiftFlip(0.1, seed=seed, name="shift_flip")(inputs)
    train = keras.Model(inputs, network(normalize(shifted)), name="minigooglenet_train")
    return train, saved


def save_model(model, path):
    """Writes `model` to a `.keras` file atomically."""
    with atomic_path(path, ".keras") as tmp:
        model.save(tmp)


def run(config):
    """Trains once; writes plot.png, history.json and model.keras into `config.output`.

    Returns:
        The summary dict that `history.json` holds (without the per-epoch list).
    """
    config.validate()
    os.makedirs(config.output, exist_ok=True)
    keras.utils.set_random_seed(config.seed)
    keras.config.set_dtype_policy(config.precision)
    (x_train, y_train), (x_test, y_test) = data_lib.load_cifar10(config.data_dir, config.limit)
    x_train, x_test = x_train.astype("float32"), x_test.astype("float32")
    mean = x_train.mean(axis=0)
    y_train, y_test = (keras.utils.to_categorical(y, 10) for y in (y_train, y_test))

    template, saved_model = build_models(mean, config.width, config.augment, config.seed)
    parallel = multi_gpu_model(template, gpus=config.gpus)
    batch_size = config.batch_per_device * parallel.num_replicas
    steps = math.ceil(len(x_train) / batch_size) * config.epochs
    schedule = keras.optimizers.schedules.PolynomialDecay(config.lr, steps, 0.0, power=1.0)
    parallel.compile(
        optimizer=keras.optimizers.SGD(schedule, momentum=config.momentum),
        loss="categorical_crossentropy",
        metrics=["accuracy"],
    )
    logger.info("Training on %s, global batch %d", parallel.devices, batch_size)
    started = time.perf_counter()
    history = parallel.fit(
        x_train, y_train, batch_size=batch_size, epochs=config.epochs,
        validation_data=(x_test, y_test), verbose=config.verbose,
        callbacks=[callbacks_lib.EpochStats(len(x_train))],
    )
    total = time.perf_counter() - started
    save_model(saved_model, os.path.join(config.output, "model.keras"))
    keras.config.set_dtype_policy("float32")

    epochs = [
        {"epoch": i + 1, **{k: float(v[i]) for k, v in history.history.items()}}
        for i in range(len(history.epoch))
    ]
    seconds = [e["seconds"] for e in epochs]
    # The first epoch includes compilation: the steady state excludes it.
    steady = seconds[1:] or seconds
    summary = {
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
    write_json(os.path.join(config.output, "history.json"), {**summary, "epochs": epochs})
    from keras_multigpu import plots

    plots.training_curves(epochs, summary, os.path.join(config.output, "plot.png"))
    return summary


def summary_line(summary):
    """The one closing line `train` prints."""
    return (
        f"devices={len(summary['devices'])} ({', '.join(summary['devices'])}) "
        f"total={summary['total_seconds']:.1f}s "
        f"epoch={summary['mean_epoch_seconds']:.2f}s "
        f"({summary['images_per_second']:.0f} img/s, first epoch "
        f"{summary['first_epoch_seconds']:.1f}s) "
        f"val_accuracy={summary['final_val_accuracy']:.4f}"
    )
