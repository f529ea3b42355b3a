"""What the TensorFlow and torch engines share: their exactness rules are Keras functions
patched for the length of a call, and a few of the rules are the same on both.

Each engine keeps `one device's value = sum over replicas r of (k_r / n) * value_r` with
its own collectives (see `tensorflow.py` and `torch.py`); this module holds the parts
that do not depend on them.
"""

import contextlib
import functools
import inspect

import keras

from keras_multigpu._keras import loss_module, metric_module


def metric_classes():
    """Every Metric class defined so far that has its own `result` (the user's too)."""
    found, stack = [], [metric_module.Metric]
    while stack:
        cls = stack.pop()
        if "result" in vars(cls):
            found.append(cls)
        stack.extend(cls.__subclasses__())
    return list(dict.fromkeys(found))


def apply_mask(original, sample_weight, mask, dtype, reduction, *, all_reduce, replica):
    """Keras's `apply_mask` (`original`) as a rule: a mean's mask divides by the valid
    entries of every replica (`all_reduce` sums across them), not by this replica's, so
    that its part of the sum is its part of one device's mean. Sets `replica.masked`,
    which tells the engine's `reduce_values` that the division is done.
    """
    if mask is None or reduction not in ("mean", "sum_over_batch_size"):
        return original(sample_weight, mask, dtype, reduction)
    valid = all_reduce(keras.ops.sum(keras.ops.cast(mask, dtype)))
    replica.masked = True
    float_mask = keras.ops.where(keras.ops.cast(mask, "bool"),
                                 keras.ops.divide_no_nan(keras.ops.cast(1.0, dtype), valid), 0)
    if sample_weight is None:
        return float_mask
    sample_weight = keras.ops.cast(sample_weight, dtype)
    float_mask, sample_weight = loss_module.squeeze_or_expand_to_same_rank(
        float_mask, sample_weight)
    return sample_weight * float_mask


def random_draw(original, *args, batch_draw, **kwargs):
    """Keras's `normal`, `uniform`, ... (`original`, with `shape` and `seed` arguments) as a
    rule: drawn through the engine's `batch_draw(draw, shape, seed)`, which makes a draw
    shaped by the replica's rows for the global batch and takes the replica's rows."""
    arguments = inspect.signature(original).bind(*args, **kwargs).arguments

    def draw(shape, seed):
        return original(**{**arguments, "shape": shape, "seed": seed})

    return batch_draw(draw, arguments["shape"], arguments.get("seed"))


def _patched(owner, name, rule, guard):
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if guard() is None:
            return original(*args, **kwargs)
        return rule(original, *args, **kwargs)

    wrapper._keras_multigpu_original = original
    return original, wrapper


@contextlib.contextmanager
def installed(table):
    """Patches every `(owner, name, rule, guard)` of `table` for the duration.

    The patched function calls `rule(original, *args, **kwargs)` where `guard()` is not
    None, and Keras's own function everywhere else. Everything is restored on exit.
    """
    saved = []
    try:
        for owner, name, rule, guard in table:
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
