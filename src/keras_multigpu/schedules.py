"""Learning-rate schedules for training with large global batches.

`LinearScaling` is the recipe of Goyal et al. 2017, "Accurate, Large
Minibatch SGD: Training ImageNet in 1 Hour" (arXiv:1706.02677): scale the
learning rate linearly with the global batch size, and reach the scaled
rate through a gradual warm-up.
"""

import math
import numbers

import keras
import numpy as np
from keras import ops

LearningRateSchedule = keras.optimizers.schedules.LearningRateSchedule


@keras.saving.register_keras_serializable(package="keras_multigpu")
class LinearScaling(LearningRateSchedule):
    """The linear scaling rule with gradual warm-up (Goyal et al. 2017).

    With `k = global_batch_size / reference_batch_size`, `W` the warm-up
    steps and `base(t)` the wrapped rate at step `t` (the constant
    `learning_rate` when it is a float), the rate at step `t` is

    ```
    lr(t) = base(t) * (1 + (k - 1) * min(t / W, 1))    # W > 0
    lr(t) = base(t) * k                                # W = 0
    ```

    so it rises linearly from the unscaled `base(0)` at step 0 to the scaled
    `k * base(W)` at step `W`, then follows `k * base(t)`. The wrapped
    schedule sees the same step `t`. `k < 1` (a global batch smaller than
    the reference) scales the rate down, and the warm-up then goes down
    from `base` to `k * base`.

    Reference: P. Goyal et al., "Accurate, Large Minibatch SGD: Training
    ImageNet in 1 Hour", 2017, arXiv:1706.02677 (sections 2.1 and 2.2:
    `eta -> k * eta` over 5 epochs).

    Steps are what the optimizer passes to its schedule: its raw iteration
    counter `optimizer._iterations`, one per batch, counted from the first
    batch the optimizer ever saw (resumed training continues the count).

    Gradient accumulation: with `gradient_accumulation_steps=A` on the
    optimizer, the variables move once every `A` batches, with gradients
    averaged over `A` global batches, so the effective batch is
    `global_batch * A`: pass `global_batch_size=batch_size * A` to scale by
    it. The schedule still counts *batches*, not updates (Keras calls it
    with `optimizer._iterations`, which goes up at every batch): the `u`-th
    update (from 0) uses `lr(u * A + A - 1)`, the rate at the last batch of
    its group, so `warmup_steps`, `steps_per_epoch` and the wrapped
    schedule's `decay_steps` are all counted in batches. Keras's public
    `optimizer.iterations` then reports updates (`batches // A`), not the
    step the schedule sees; `optimizer.learning_rate` is always the rate at
    the next batch, `lr(optimizer._iterations)`.

    Saving: the class is registered as `"keras_multigpu>LinearScaling"`, so
    a model compiled with it and saved to `.keras` reloads, optimizer state
    included, with `keras.saving.load_model` in any process that has
    imported `keras_multigpu` (or `keras_multigpu.schedules`). In a process
    that has not, Keras cannot rebuild the optimizer: `load_model(path)`
    raises a `TypeError` ("<class 'SGD'> could not be deserialized
    properly ... Could not locate class 'LinearScaling'"), while
    `load_model(path, compile=False)` loads the model and its weights,
    uncompiled, ready for `predict` (the optimizer state in the file is
    ignored; compile again to train).

    Args:
        learning_rate: the rate for `reference_batch_size`: a float, or any
            `keras.optimizers.schedules.LearningRateSchedule` (e.g.
            `PolynomialDecay`), which is evaluated at the same step and
            multiplied by the scale.
        global_batch_size: int, the batch one optimizer update averages
            over (on a `ParallelModel`, fit's `batch_size`; times
            `gradient_accumulation_steps` when the optimizer accumulates).
        reference_batch_size: int, the batch size `learning_rate` was
            tuned for (Goyal et al. use 256 for ImageNet).
        warmup_steps: int >= 0, the steps over which the rate rises from
            `base` to `k * base`. None (the default) or 0: no warm-up, the
            rate is `k * base(t)` from step 0.
        warmup_epochs: instead of `warmup_steps`, the warm-up in epochs (an
            int or a float >= 0); needs `steps_per_epoch`, and gives
            `warmup_steps = warmup_epochs * steps_per_epoch`, rounded to the
            nearest step (halves up).
        steps_per_epoch: int, the batches in one epoch; only with
            `warmup_epochs`.
        name: the schedule's name.

    Example:

    ```python
    parallel = keras_multigpu.multi_gpu_model(model)
    steps = math.ceil(len(x) / (64 * parallel.num_replicas))
    schedule = keras_multigpu.schedules.LinearScaling(
        keras.optimizers.schedules.PolynomialDecay(0.1, 70 * steps, 0.0, power=1),
        global_batch_size=64 * parallel.num_replicas, reference_batch_size=64,
        warmup_epochs=5, steps_per_epoch=steps)
    parallel.compile(optimizer=keras.optimizers.SGD(schedule, momentum=0.9),
                     loss="categorical_crossentropy")
    parallel.fit(x, y, batch_size=64 * parallel.num_replicas, epochs=70)
    ```
    """

    def __init__(
        self,
        learning_rate,
        global_batch_size,
        reference_batch_size=256,
        warmup_steps=None,
        warmup_epochs=None,
        steps_per_epoch=None,
        name="linear_scaling",
    ):
        super().__init__()
        self.learning_rate = _check_learning_rate(learning_rate)
        self.global_batch_size = _check_int("global_batch_size", global_batch_size, minimum=1)
        self.reference_batch_size = _check_int(
            "reference_batch_size", reference_batch_size, minimum=1
        )
        self.warmup_steps = _resolve_warmup(warmup_steps, warmup_epochs, steps_per_epoch)
        self.name = name

    @property
    def scale(self):
        """`k = global_batch_size / reference_batch_size`."""
        return self.global_batch_size / self.reference_batch_size

    def __call__(self, step):
        if isinstance(self.learning_rate, LearningRateSchedule):
            base = ops.cast(self.learning_rate(step), "float32")
        else:
            base = ops.convert_to_tensor(self.learning_rate, "float32")
        if self.warmup_steps == 0:
            return base * self.scale
        progress = ops.minimum(ops.cast(step, "float32") / float(self.warmup_steps), 1.0)
        return base * (1.0 + (self.scale - 1.0) * progress)

    def get_config(self):
        learning_rate = self.learning_rate
        if isinstance(learning_rate, LearningRateSchedule):
            learning_rate = keras.optimizers.schedules.serialize(learning_rate)
        return {
            "learning_rate": learning_rate,
            "global_batch_size": self.global_batch_size,
            "reference_batch_size": self.reference_batch_size,
            "warmup_steps": self.warmup_steps,
            "name": self.name,
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        if isinstance(config.get("learning_rate"), dict):
            config["learning_rate"] = keras.optimizers.schedules.deserialize(
                config["learning_rate"]
            )
        return cls(**config)


def _is_int(value):
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _check_int(name, value, minimum):
    if not _is_int(value):
        raise TypeError(
            f"{name} must be an int. Received: {name}={value!r} "
            f"of type {type(value).__name__}."
        )
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}. Received: {name}={value}.")
    return int(value)


def _check_learning_rate(value):
    if isinstance(value, LearningRateSchedule):
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(
            "learning_rate must be a float or a keras.optimizers.schedules."
            f"LearningRateSchedule. Received: learning_rate={value!r} of type "
            f"{type(value).__name__}."
        )
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            "learning_rate must be a positive, finite float (the rate for "
            f"reference_batch_size). Received: learning_rate={value!r}."
        )
    return float(value)


def _resolve_warmup(warmup_steps, warmup_epochs, steps_per_epoch):
    """The warm-up in steps, from `warmup_steps` or from epochs."""
    if warmup_epochs is None:
        if steps_per_epoch is not None:
            raise ValueError(
                "steps_per_epoch is only used to turn warmup_epochs into steps, and "
                f"warmup_epochs is None. Received: steps_per_epoch={steps_per_epoch!r}. "
                "Pass warmup_epochs too, or drop steps_per_epoch."
            )
        return 0 if warmup_steps is None else _check_int("warmup_steps", warmup_steps, minimum=0)
    if warmup_steps is not None:
        raise ValueError(
            "Pass the warm-up either in steps or in epochs, not both. Received: "
            f"warmup_steps={warmup_steps!r} and warmup_epochs={warmup_epochs!r}."
        )
    if isinstance(warmup_epochs, (bool, np.bool_)) or not isinstance(warmup_epochs, numbers.Real):
        raise TypeError(
            "warmup_epochs must be an int or a float. Received: "
            f"warmup_epochs={warmup_epochs!r} of type {type(warmup_epochs).__name__}."
        )
    if not math.isfinite(warmup_epochs) or warmup_epochs < 0:
        raise ValueError(
            f"warmup_epochs must be >= 0. Received: warmup_epochs={warmup_epochs!r}."
        )
    if steps_per_epoch is None:
        raise ValueError(
            f"warmup_epochs={warmup_epochs!r} needs steps_per_epoch (the batches in "
            "one epoch) to count the warm-up in steps. Pass steps_per_epoch, or "
            "warmup_steps instead."
        )
    steps_per_epoch = _check_int("steps_per_epoch", steps_per_epoch, minimum=1)
    # The nearest step, halves up (round() would take 2.5 to 2).
    return int(math.floor(warmup_epochs * steps_per_epoch + 0.5))
