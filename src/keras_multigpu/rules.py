"""The exactness rules, written once in `keras.ops`, for engines whose replicas see only
their own rows (TensorFlow's replica functions, torch's processes).

Every reduction a step makes keeps one rule:

    one device's value = sum over replicas r of (k_r / n) * value_r

where replica r holds k_r of the global batch's n real rows (contiguous, from `start`),
and a replica's value is what one device computes on its rows. Each rule below is a
Keras function as a replica must compute it. An engine supplies the primitives as a
`Replica` (its counts, and a sum across replicas) and installs the rules for the length
of a call with `installed(table(...))`. The JAX engine has a global view of the batch and
needs none of them.

`tests/test_rules.py` checks each rule in one process, with replicas simulated by threads
over uneven splits and splits of no rows.
"""

import contextlib
import dataclasses
import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import keras

from keras_multigpu import rules_rows
from keras_multigpu._keras import backend, base_trainer, loss_module
from keras_multigpu.rules_gather import (
    batch_contraction,
    compiled_loss,
    loss_calls,
    loss_classes,
    one_value_loss,
    own_call_loss,
    switched_on,
)
from keras_multigpu.rules_metrics import (
    generic_metrics_result,
    global_result,
    metric_classes,
    metrics_owner,
    metrics_result,
    own_logs,
    wrapped_update,
    wrapped_value,
)
from keras_multigpu.rules_mixing import (
    _Marked,
    mixing_function,
    mixing_layer,
    mixing_layers,
    unmarked_product,
)
from keras_multigpu.rules_random import batch_draw, categorical, dropout, random_draw
from keras_multigpu.rules_weights import (
    held,
    own_step,
    scaled_loss,
    share,
    unscaled,
    weigh,
    weigh_gradient,
    weight,
    weighted_sum,
)

__all__ = [
    "Replica", "held", "weight", "share", "weigh", "weigh_gradient", "scaled_loss",
    "own_step", "unscaled",
    "weighted_scalar", "reduce_values", "apply_mask", "additional_loss", "mean_update",
    "weighted_sum", "moments", "batch_draw", "random_draw", "dropout", "categorical",
    "mixing_layer", "mixing_function", "batch_contraction", "compiled_loss", "one_value_loss",
    "own_call_loss",
    "global_result", "metrics_result", "generic_metrics_result", "own_logs", "wrapped_update",
    "metrics_owner", "metric_classes", "table", "installed", "suspended"]
_SUMS = weakref.WeakKeyDictionary()  # a model's `add_loss` scalars: which sum the rows


@dataclasses.dataclass
class Replica:
    """What the rules need from the engine, for one replica's step.

    Attributes:
        k, n, start: this replica's real rows, the global batch's, and where its rows
            start in the global batch: Python ints (eager engines), or scalar int tensors
            (engines that trace the step with a dynamic batch). None outside a step (a
            metric's `result()` read at the end of an epoch needs only the sums). The
            engines split the rows evenly: k is n // replicas, or one more.
        replicas: how many replicas there are (a Python int).
        index: this replica's place among them, 0 to replicas - 1 (an int, or a scalar
            int tensor): where `moments` puts its sums in the buffer every replica fills.
        all_reduce: `all_reduce(values, what)` sums a list of tensors across replicas,
            with no gradient; `what` names the collective in an error.
        traced: whether the step is traced with a dynamic batch dimension, so that a
            static first dimension (a Python int) is never the batch's rows.
        masked: set by `apply_mask` when it has divided a mean by the valid entries of
            every replica, and read (then cleared) by `reduce_values`.
        results: the step's values that are the batch's already (metric results it read,
            losses computed on the gathered batch), which `own_logs` leaves as they are.
        reduced: gradients summed across replicas where the step took them (TensorFlow's
            tape, a torch backward pass), which the optimizer's apply takes as they are.
        own_step: whether Keras's own `train_step` runs (`own_step`: its loss is weighed
            before the backward pass; torch overlaps its all-reduce).
        weighed: set by `scaled_loss`: the step's loss is weighed by k / n already.
        summed: `summed(replica, loss)`, whether a step's scalar loss is a sum over this
            replica's rows, or a ratio of two such sums, rather than a mean (the engine's
            graph tells; None: every loss is taken for a mean).
        sums: `sums(replica, x)`: whether a scalar `x` (an `add_loss` value) sums this
            replica's rows, as `summed` tells but for ratios; None where no graph tells.
        added: the `add_loss` values this step has summed so far.
        scaled: (what `scaled_loss` returned, the loss it was handed) for each loss that sums
            the rows in this step, which `unscaled` reads where the step takes a gradient.
    """

    k: Any
    n: Any
    start: Any
    replicas: int
    all_reduce: Callable
    index: Any = None
    traced: bool = False
    masked: bool = False
    results: list = dataclasses.field(default_factory=list)
    reduced: list = dataclasses.field(default_factory=list)
    own_step: bool = False
    weighed: bool = False
    summed: Callable | None = None
    sums: Callable | None = None
    added: int = 0
    scaled: list = dataclasses.field(default_factory=list)


def reduce_values(replica, original, values, sample_weight=None,
                  reduction="sum_over_batch_size"):
    """Keras's `reduce_values` (`original`): a loss's reduction over this replica's rows.

    A mean over the rows is already the replica's value. A sum, a weighted mean
    (`mean_with_sample_weight`, whose divisor is every replica's weight) and a masked
    mean (divided by every replica's valid entries in `apply_mask`) are rescaled by
    n / k, so that k / n of them is this replica's part of one device's value.
    """
    if reduction is None or reduction == "none" or len(values.shape) == 0:
        return original(values, sample_weight, reduction)
    total = keras.ops.sum(values)
    scale = share(replica, total.dtype)
    masked, replica.masked = replica.masked, False
    if reduction == "sum":
        return total * scale
    if reduction == "mean_with_sample_weight" and sample_weight is not None:
        # Every replica joins this all-reduce, with rows or without.
        divisor = replica.all_reduce(
            [keras.ops.cast(keras.ops.sum(sample_weight), total.dtype)],
            "all-reduce of a loss's divisor")[0]
        return keras.ops.divide_no_nan(total, divisor) * scale
    if masked:
        return total * scale
    return keras.ops.divide_no_nan(total, keras.ops.cast(keras.ops.size(values), total.dtype))


def weighted_scalar(replica, original, values, sample_weight=None, mask=None,
                    reduction="sum_over_batch_size", dtype=None):
    """Keras's `reduce_weighted_values` (`original`) where a loss returned one value for
    the batch (a custom loss that takes its own mean) and has sample weights or a mask:
    Keras multiplies that value by them and reduces the products, so one device's loss is
    the value times their reduction over the whole batch. The value is weighed as a mean
    (as a scalar alone is); the weights' reduction is made by the rules above, and summed
    across replicas. Any other loss goes to Keras's function.

    A traced step knows the values' rank, the same on every replica. An eager one (torch)
    sees a replica of one row squeeze a per-row loss to one value (`ops.squeeze`), so there
    every replica joins the all-reduce, which also counts the replicas of two rows or more
    that saw one value: those decide, and no replica waits alone.
    """
    values = keras.ops.convert_to_tensor(values, dtype=dtype)
    one_value = len(values.shape) == 0
    if (sample_weight is None and mask is None) or reduction in (None, "none") or (
            replica.traced and not one_value):
        return original(values, sample_weight, mask, reduction, dtype)
    # The weights' reduction, as of a loss of 1 per row (Keras would squeeze a replica's
    # single weight to a scalar against the one value: a reduction no rule could weigh).
    ones = keras.ops.ones(keras.ops.shape(sample_weight if mask is None else mask),
                          values.dtype)
    part = original(ones, sample_weight, mask, reduction, dtype)
    votes = keras.ops.cast(one_value and not replica.traced and replica.k >= 2, part.dtype)
    whole, votes = replica.all_reduce([weigh(replica, part), votes],
                                      "all-reduce of the sample weights of a one-value loss")
    if not one_value or (not replica.traced and not keras.ops.convert_to_numpy(votes) > 0):
        return original(values, sample_weight, mask, reduction, dtype)
    return values * keras.ops.cast(whole, values.dtype)


def apply_mask(replica, original, sample_weight, mask, dtype, reduction):
    """Keras's `apply_mask` (`original`): a mean's mask divides by the valid entries of
    every replica, not by this replica's, so that its part of the sum is its part of one
    device's mean. Tells `reduce_values` that the division is done."""
    if mask is None or reduction not in ("mean", "sum_over_batch_size"):
        return original(sample_weight, mask, dtype, reduction)
    valid = replica.all_reduce([keras.ops.sum(keras.ops.cast(mask, dtype))],
                               "all-reduce of a mask's valid entries")[0]
    replica.masked = True
    float_mask = keras.ops.where(keras.ops.cast(mask, "bool"),
                                 keras.ops.divide_no_nan(keras.ops.cast(1.0, dtype), valid), 0)
    if sample_weight is None:
        return float_mask
    sample_weight = keras.ops.cast(sample_weight, dtype)
    float_mask, sample_weight = loss_module.squeeze_or_expand_to_same_rank(
        float_mask, sample_weight)
    return sample_weight * float_mask


def additional_loss(replica, original, trainer, loss):
    """Keras's sum of an `add_loss` value (`original`): a value with a row per sample
    (Keras's CTC example adds one) is summed over the batch, so this replica's part is
    rescaled as `reduction="sum"` is, and so is a scalar that sums such rows
    (`add_loss(ops.sum(x))`: `Replica.sums`, else as an earlier step found). Other
    scalars (means, regularisers) are weighed as means.
    A replica without rows adds nothing (a mean over no rows is NaN), yet still depends on
    the model, so its backward pass runs the same collectives as the others'."""
    total = _select(replica.k > 0, original(trainer, loss),
                    lambda total: keras.ops.nan_to_num(total) * 0)
    if _rank(loss) in (None, 0):
        summed = replica.sums is not None and replica.sums(replica, loss)
        if replica.sums is not None:  # by its place in the step, as found before where no
            found = _SUMS.setdefault(trainer, {})  # graph tells (torch's evaluation)
            place, replica.added = replica.added, replica.added + 1
            found[place] = summed = found.get(place, False) if summed is None else summed
        return total * share(replica, total.dtype) if summed else total
    rows = keras.ops.shape(loss)[0]
    if isinstance(rows, int) and isinstance(replica.k, int):
        rows = rows == replica.k
    elif replica.traced and isinstance(rows, int):
        return total  # a static first dimension is not this step's rows
    else:
        rows = keras.ops.equal(rows, replica.k)
    return _select(rows, total,
                   lambda total: total, lambda total: total * share(replica, total.dtype))


def _rank(x):
    """The rank of `x`; None where a traced tensor's is unknown, or `x` has no shape."""
    try:
        return len(x.shape)
    except (TypeError, ValueError, AttributeError):
        return None


def _select(condition, value, otherwise, then=lambda value: value):
    """`then(value)` where `condition` holds, else `otherwise(value)`: a Python choice for
    eager engines' plain values, `keras.ops.where` for traced ones."""
    if isinstance(condition, bool) or not keras.ops.is_tensor(condition):
        return then(value) if condition else otherwise(value)
    return keras.ops.where(condition, then(value), otherwise(value))


def mean_update(replica, original, metric, values, sample_weight=None):
    """Keras's `Mean.update_state` (`original`): a scalar without a weight (a custom step's
    loss tracker, a per-output loss) is this replica's mean, weighed by k / n; a metric
    function's one value for the batch is `wrapped_update`'s, a row's counts one row."""
    values = keras.ops.convert_to_tensor(values)
    wrapped = wrapped_value(replica, metric, values, sample_weight)
    if wrapped == "batch":
        return None
    if len(values.shape) == 0 and wrapped != "rows":  # "rows": a row's value, not a mean
        w = weight(replica, values.dtype)
        values = keras.ops.where(w > 0, values, keras.ops.zeros_like(values))
        if sample_weight is None:
            sample_weight = w
    return original(metric, values, sample_weight=sample_weight)


def moments(replica, original, layer, inputs, mask):
    """BatchNormalization's `_moments` (`original`, Keras's formulas) over the real rows
    of every replica, with one all-reduce forward and one backward.

    Each replica sums its rows (s_r), counts them (c_r) and sums their squared distances
    to its own mean (q_r); one `weighted_sum` gathers every replica's three (each fills
    its own row of a replicas-long buffer). Then, for any `mean`,

        sum of squared distances to `mean` = sum over r of q_r + (s_r - c_r * mean)^2 / c_r

    (Chan et al.'s parallel variance), which keeps the two-pass formula's accuracy: a
    one-pass E[x^2] - E[x]^2 over the replicas cancels far from one device's figures.
    """
    low = keras.backend.standardize_dtype(inputs.dtype) in ("float16", "bfloat16")
    x = keras.ops.cast(inputs, "float32") if low else inputs
    axes = list(layer._reduction_axes)
    if mask is None:  # Keras's `ops.moments`
        total = keras.ops.sum(x, axes, keepdims=True)
        dims = keras.ops.shape(x)
        entries = functools.reduce(lambda a, b: a * b, [dims[a] for a in axes], 1)
        count = keras.ops.ones_like(total) * keras.ops.cast(entries, x.dtype)
        own = keras.ops.sum(keras.ops.square(x - keras.ops.divide_no_nan(total, count)),
                            axes, keepdims=True)
        epsilon = 0.0
    else:  # Keras's masked formula
        weights = keras.ops.broadcast_to(
            keras.ops.expand_dims(keras.ops.cast(mask, x.dtype), -1), keras.ops.shape(x))
        total = keras.ops.sum(x * weights, axes, keepdims=True)
        count = keras.ops.sum(weights, axes, keepdims=True)
        own = keras.ops.sum(
            keras.ops.square((x - keras.ops.divide_no_nan(total, count)) * weights),
            axes, keepdims=True)
        epsilon = keras.backend.epsilon()
    shape = keras.ops.shape(total)
    parts = keras.ops.concatenate([keras.ops.reshape(p, (1, -1)) for p in (total, own, count)],
                                  axis=0)
    slot = keras.ops.one_hot(replica.index, replica.replicas, dtype=x.dtype)
    gathered = weighted_sum(replica, slot[:, None, None] * parts[None])  # (replicas, 3, C)
    totals, owns, counts = (gathered[:, i] for i in range(3))
    everyone = keras.ops.sum(counts, axis=0) + epsilon
    mean = keras.ops.divide_no_nan(keras.ops.sum(totals, axis=0), everyone)
    squares = keras.ops.sum(owns + keras.ops.divide_no_nan(
        keras.ops.square(totals - counts * mean), counts), axis=0)
    variance = keras.ops.divide_no_nan(squares, everyone)
    mean = keras.ops.squeeze(keras.ops.reshape(mean, shape), tuple(axes))
    variance = keras.ops.squeeze(keras.ops.reshape(variance, shape), tuple(axes))
    return keras.ops.cast(mean, inputs.dtype), keras.ops.cast(variance, inputs.dtype)


def table(step, call, random_module, draws, logs=None):
    """The rules as `installed` takes them, for an engine whose `step()` returns this
    replica's `Replica` inside a step (None elsewhere) and `call()` one for the call
    (metrics are read outside the step too). Keras's backend `random_module` has its
    `draws`, `dropout` and `categorical` patched. `logs()` (else `call()`) gives the
    `Replica` that reads a step's logs, whose all-reduce may carry more (a stop flag)."""
    return [
        (loss_module, "reduce_weighted_values", weighted_scalar, step),
        (loss_module, "reduce_values", reduce_values, step),
        (loss_module, "apply_mask", apply_mask, step),
        (base_trainer.Trainer, "_aggregate_additional_loss", additional_loss, step),
        (keras.metrics.Mean, "update_state", mean_update, step),
        (keras.metrics.MeanMetricWrapper, "update_state", wrapped_update, step),
        (keras.layers.BatchNormalization, "_moments", moments, step),
        (keras.Model, "train_step", own_step, step),
        (keras.optimizers.Optimizer, "scale_loss", scaled_loss, step),
        (keras.optimizers.LossScaleOptimizer, "scale_loss", scaled_loss, step),
        *((random_module, name, random_draw, step) for name in draws),
        (random_module, "dropout", dropout, step),
        (random_module, "categorical", categorical, step),
        *((cls, "call", mixing_layer, step) for cls in mixing_layers()),
        (_Marked, "call", mixing_function, step),
        (backend.numpy, "tensordot", batch_contraction, step),
        (backend.numpy, "matmul", unmarked_product, step),
        *rules_rows.table(step),
        (base_trainer.CompileLoss, "call", compiled_loss, step),
        *((cls, "call", one_value_loss, step) for cls in loss_classes()),
        *((cls, "__call__", own_call_loss, step) for cls in loss_calls()),
        *((cls, "result", global_result, call) for cls in metric_classes()),
        (metrics_owner(), "get_metrics_result", metrics_result, logs or call),
    ]


def _patched(owner, name, rule, guard):
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        replica = None if getattr(_suspended, "on", False) else guard()
        if replica is None:
            return original(*args, **kwargs)
        return rule(replica, original, *args, **kwargs)

    wrapper._keras_multigpu_original = original
    return original, wrapper


_suspended = threading.local()


def suspended():
    """Keras's own functions, not the rules, in this thread for the duration: for a loss
    that runs on the batch gathered from every replica, as one device runs it."""
    return switched_on(_suspended)


@contextlib.contextmanager
def installed(rules):
    """Patches every `(owner, name, rule, guard)` of `rules` for the duration.

    Where `guard()` returns a `Replica`, the patched function calls `rule(replica, original,
    *args, **kwargs)`; elsewhere (None), Keras's own. Everything is restored on exit.
    """
    saved = []
    try:
        for owner, name, rule, guard in rules:
            original, wrapper = _patched(owner, name, rule, guard)
            saved.append((owner, name, name in vars(owner), original))
            setattr(owner, name, wrapper)
        yield
    finally:
        for owner, name, own, original in reversed(saved):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
