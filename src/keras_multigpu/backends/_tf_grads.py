"""A custom step's gradients and losses on TensorFlow, as one device's: rules of the
TensorFlow engine's table (`_tf_rules`), in force inside its replicas' steps.

A step's `tf.GradientTape` hands back one device's gradients, all-reduced where it takes
them (so that a clip by their global norm is exact). A replica's loss is taken for the
mean over its rows, whose weighed sum across replicas is one device's mean; a loss that
is a sum over the rows, or a ratio of two such sums (a masked mean written by hand:
`ops.sum(loss * mask) / ops.sum(mask)`), is found in the step's graph and weighed as one
device's: its gradient by each replica's part, its value (a loss tracker's update, a
value the step returns) as the batch's ratio, or as the replica's part of the batch's sum.
"""

import keras
import tensorflow as tf

from keras_multigpu import rules, rules_metrics
from keras_multigpu.rules_gather import rows_of

_RATIOS = {"RealDiv": tf.math.truediv, "DivNoNan": tf.math.divide_no_nan}


def tape_gradient(replica, original, self, target, sources, *args, **kwargs):
    """`tf.GradientTape.gradient` inside a step, as one device's. Gradients with respect to
    variables (a step's loss with respect to its weights) are weighed by k/n and
    all-reduced at once, so that a step that clips them to a global norm, or moves its
    weights along them (SAM), computes what one device does; the optimizer's `apply` takes
    them as they are. Gradients with respect to tensors of this replica's rows (an
    adversarial step's input gradient) are weighed as one device's: of a mean loss, k/n of
    the replica's, since one device divides by the batch's rows; of a per-row target (a
    gradient penalty's), the replica's own. The gradient of a sum over the rows is weighed
    as this replica's part of one device's sum (`sums_rows`), that of a ratio of two sums
    by its denominator's share of the batch's (`ratio_of_sums`). Gradients with respect to
    other tensors stay the replica's own."""
    from keras_multigpu.backends._tf_rules import _reduced, _weighed  # it imports this module

    flat_sources = tf.nest.flatten(sources)
    variables = [isinstance(s, (tf.Variable, keras.Variable)) for s in flat_sources]
    if not variables or not all(v or rows_of(replica, s) for v, s in zip(variables, flat_sources)):
        return original(self, target, sources, *args, **kwargs)
    part = _part(replica, rules.unscaled(replica, target))  # through a loss scaler's product
    flat = tf.nest.flatten(
        original(self, target, sources, *args, **kwargs) if part is None
        else _from_part(replica, original, self, target, sources, part, *args, **kwargs))
    reduced = _reduced(replica, [g if v else None for g, v in zip(flat, variables)])
    replica.reduced.extend(g for g in reduced if g is not None)
    return tf.nest.pack_sequence_as(sources, [
        r if v else None if g is None else _weighed(replica, g)
        for g, r, v in zip(flat, reduced, variables)])


def _from_part(replica, original, self, target, sources, part, *args, **kwargs):
    """The gradients of `target` whose output gradients (the user's, else ones) are
    multiplied by this replica's `part` of one device's, times n / k: the factor enters at
    the target, so that a gradient that crosses replicas (a gather's, `rules.weighted_sum`)
    is weighed as the target is. Where the factor is 0, so are they (`_scaled`)."""
    given = args[0] if args else kwargs.pop("output_gradients", None)
    targets = tf.nest.flatten(target)
    givens = [None] * len(targets) if given is None else tf.nest.flatten(given)
    factors = [rules.share(replica, t.dtype) * tf.cast(part, t.dtype) for t in targets]
    output = tf.nest.pack_sequence_as(target, [
        (tf.ones_like(t) if g is None else tf.cast(g, t.dtype)) * f
        for t, g, f in zip(targets, givens, factors)])
    grads = original(self, target, sources, output, *args[1:], **kwargs)
    return [None if g is None else _scaled(g, tf.cast(factors[0] != 0, g.dtype))
            for g in tf.nest.flatten(grads)]


def summed(replica, loss):
    """`rules.Replica.summed`: whether `loss` is a sum over this replica's rows, or a ratio of
    two such sums, rather than a mean (the step's graph tells)."""
    return sums_rows(replica, loss) or ratio_of_sums(replica, loss) is not None


def _part(replica, target):
    """This replica's part of one device's gradient of `target`, where that is not a mean
    over the rows: 1 for a sum over them (`sums_rows`), the denominator's share of the
    batch's for a ratio of two sums (`ratio_of_sums`: sum_r (k_r / n) * (n / k_r) *
    (M_r / M) * grad_r = sum_r (M_r / M) * grad_r); None for a mean."""
    if sums_rows(replica, target):
        return 1.0
    ratio = ratio_of_sums(replica, target)
    if ratio is None:
        return None
    batch = replica.all_reduce([ratio[1]], "all-reduce of a ratio's denominator")[0]
    return tf.math.divide_no_nan(ratio[1], batch)


def sums_rows(replica, target):
    """Whether the gradient of `target` is of a sum over this replica's rows, not a mean:
    every target holds the rows (a per-row loss, whose gradient is of its sum: keras-io's
    Siamese network), or sums every axis of a tensor that does (`ops.sum(per_row)`)."""
    targets = tf.nest.flatten(target)
    return bool(targets) and all(rows_of(replica, t) or _row_sum(replica, t) for t in targets)


def _row_sum(replica, t):
    """Whether `t` is a sum of every axis of a tensor of this replica's rows, through casts
    and products with a constant or a variable (`rate * ops.sum(x)`, `ops.sum(x) / 2.0`:
    values that no row changes)."""
    if getattr(t, "shape", None) is None or t.shape.rank != 0:
        return False
    while _op_type(t) in ("Cast", "Identity", "Mul", "RealDiv"):
        if _op_type(t) in ("Cast", "Identity"):
            t = t.op.inputs[0]
        elif _fixed(t.op.inputs[1]):
            t = t.op.inputs[0]
        elif _op_type(t) == "Mul" and _fixed(t.op.inputs[0]):
            t = t.op.inputs[1]
        else:
            return False
    return (_op_type(t) == "Sum" and t.shape.rank == 0 and rows_of(replica, t.op.inputs[0]))


def _fixed(t):
    """Whether `t` (through casts) is a constant or a variable's value: no row changes it."""
    while _op_type(t) in ("Cast", "Identity"):
        t = t.op.inputs[0]
    return _op_type(t) in ("Const", "ReadVariableOp")


def _op_type(t):
    """The type of the graph op that made `t`; None for an eager tensor (a step run
    eagerly, `run_eagerly=True`: no graph tells) or anything else."""
    return getattr(getattr(t, "op", None), "type", None)


def ratio_of_sums(replica, value):
    """`(numerator, denominator)` where `value` is a ratio of two sums over every axis of
    tensors of this replica's rows (a masked mean written by hand: keras-io's image
    captioning), else None. A traced step's graph tells, the same on every replica."""
    if _op_type(value) not in _RATIOS or value.shape.rank != 0 or any(
            getattr(r, "name", None) == value.name for r in replica.results):
        return None  # a compiled loss of one value is the gathered batch's already
    numerator, denominator = value.op.inputs
    if _row_sum(replica, numerator) and _row_sum(replica, denominator):
        return numerator, denominator
    return None


def global_ratio(replica, value):
    """`value`, or the batch's ratio where it is a ratio of two sums over this replica's
    rows: both sums all-reduced, then divided as the step divides them."""
    parts = ratio_of_sums(replica, value)
    if parts is None:
        return value
    numerator, denominator = replica.all_reduce(list(parts), "all-reduce of a ratio's sums")
    return _RATIOS[value.op.type](numerator, denominator)


def mean_update(replica, original, metric, values, sample_weight=None):
    """`rules.mean_update` (a loss tracker's update: a custom step's, or Keras's own step's,
    weighed by the rows), with a ratio of sums over the rows taken as the batch's ratio
    (`global_ratio`), and a sum over them (a `compute_loss` that sums: keras-io's BERT
    masked language model) as this replica's part of the batch's sum times n / k: the
    weighing by k / n (a weight of None), or by the rows (Keras's step's weight), then adds
    each once across replicas."""
    if not rules_metrics.updating(metric):  # (`wrapped_update`'s)
        if _row_sum(replica, values):
            values = values * rules.share(replica, values.dtype)
        else:
            values = global_ratio(replica, values)
    return rules.mean_update(replica, original, metric, values, sample_weight)


def own_logs(replica, logs):
    """`rules.own_logs`, with each ratio of sums the step returns taken as the batch's."""
    if isinstance(logs, dict):
        logs = {key: global_ratio(replica, value) for key, value in logs.items()}
    return rules.own_logs(replica, logs)


def _scaled(gradient, factor):
    """`gradient * factor`, and 0 where the factor is: a ratio whose denominator is 0 on this
    replica (every row masked) has a NaN gradient, and no part of one device's."""
    def times(values):
        return tf.where(factor != 0, values * factor, tf.zeros_like(values))

    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(times(gradient.values), gradient.indices,
                                gradient.dense_shape)
    return times(gradient)
