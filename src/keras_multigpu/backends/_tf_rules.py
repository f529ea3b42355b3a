"""The TensorFlow engine's rules, in force inside its scope.

`keras_multigpu.rules` with the replica context's all-reduce, and this engine's own:
gradients weighed and all-reduced once before the optimizer (kept sparse where they
are), Keras's 1/R loss scaling off, each replica's own `add_loss` values, and, with
several workers, Keras's scalar reduction across them.
"""

import contextlib
import threading

import keras
import tensorflow as tf
from keras import tree

from keras_multigpu import _keras, rules
from keras_multigpu._keras import loss_module, seed_generator
from keras_multigpu._keras.tensorflow import DRAWS, device_datasets
from keras_multigpu._keras.tensorflow import optimizer as tf_optimizer
from keras_multigpu._keras.tensorflow import random as tf_random
from keras_multigpu._keras.tensorflow import trainer as tf_trainer
from keras_multigpu.backends import _tf_batches, _tf_grads, _tf_seeds, _tf_xla

# Inside a replica's step: `state`, its `rules.Replica` (k, n, start as int32 tensors).
_replica = threading.local()


# -- the rules, in force inside `scope` ---------------------------------


def _step():
    """This replica's `rules.Replica` inside a step run by `run_step`, else None."""
    state = getattr(_replica, "state", None)
    if state is None or tf.distribute.get_replica_context() is None:
        return None
    return state


def _placed(value):
    """`value`, on this replica's device where TensorFlow placed it on none.

    A replica's all-reduce sends each value to its own device. With one
    replica per worker its values reach the reduction as they are (with
    several, as a PerReplica that names the devices), and one on no device
    fails: "destinations can not be empty". A variable's read is one:
    `ResourceVariable.value` leaves every device scope; an identity, made
    in the replica's scope, is on its device.
    """
    if isinstance(value, tf.Tensor) and not tf.executing_eagerly() and not value.device:
        return tf.identity(value)
    return value


def _all_reduce(values, reduction=tf.distribute.ReduceOp.SUM):
    """`values` (a list) reduced across replicas, one all-reduce per dtype: TensorFlow packs
    a list into one buffer, which fails where the dtypes differ (OneHotMeanIoU's int64
    confusion matrix beside a float metric's sums)."""
    context = tf.distribute.get_replica_context()
    values = [_placed(v) for v in values]
    groups = {}
    for i, value in enumerate(values):
        groups.setdefault(value.dtype, []).append(i)
    reduced = list(values)
    for indices in groups.values():
        for i, value in zip(indices, context.all_reduce(reduction, [values[i] for i in indices])):
            reduced[i] = value
    return reduced


def all_reduce(values, what):
    """Sums `values` across replicas (`rules.Replica.all_reduce`). A variable is read first
    (`keras.ops.convert_to_tensor` hands a `tf.Variable` back as it is), so that `_placed`
    can give its read a device."""
    return list(_all_reduce([tf.convert_to_tensor(v) for v in values]))


def _weighed(replica, gradient):
    """`rules.weigh_gradient`, kept sparse where the gradient is, as one device's is."""
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(_weighed(replica, gradient.values), gradient.indices,
                                gradient.dense_shape)
    return rules.weigh_gradient(replica, gradient)


def _fixed_rows(gradient):
    """Whether `gradient` is sparse with rows that do not depend on the batch.

    A lookup's gradient has one row per index looked up. Indices that come
    from the data (token ids) have the batch's dynamic size: the replicas'
    rows, concatenated in replica order by the all-reduce, are one device's
    rows in one device's order. Indices of a static size (positions
    `arange(maxlen)`) are looked up once per step on one device, with the
    batch summed into each row: every replica holds the same indices, and one
    device's gradient is theirs with the values summed. The two differ for
    an optimizer that squares a sparse gradient row by row (Adam, RMSprop).
    """
    return isinstance(gradient, tf.IndexedSlices) and gradient.indices.shape.is_fully_defined()


def _summable(gradient):
    return gradient.values if _fixed_rows(gradient) else gradient


def _unsummable(gradient, reduced):
    if _fixed_rows(gradient):
        return tf.IndexedSlices(reduced, gradient.indices, gradient.dense_shape)
    return reduced


def _built(optimizer, trainable_variables):
    """An optimizer first used inside the step (a GAN's `d_optimizer`, built by its first
    `apply`) is built outside the traced step first, as the model's own optimizer is
    before the step: mirrored variables made inside a replica's traced step have
    initialisers `tf.function` cannot lift, and the step it then builds around them fails."""
    if not optimizer.built and trainable_variables is not None:
        with tf.init_scope(), keras.name_scope(optimizer.name, caller=optimizer):
            optimizer.build(list(trainable_variables))


def _reduced(replica, grads):
    """The gradients weighed by k/n and summed across replicas, in one all-reduce."""
    present = [_summable(_weighed(replica, g)) for g in grads if g is not None]
    if not present:
        return grads
    reduced = iter(_all_reduce(present))
    return [None if g is None else _unsummable(g, next(reduced)) for g in grads]


def _held(replica, grads):
    """`grads` as reduced where the step took them (`_tf_grads.tape_gradient`, `rules.held`), else
    reduced now: a step that changed them reduces them again, which leaves one device's
    gradients as they are (the weights k/n sum to 1)."""
    return grads if rules.held(replica, grads) else _reduced(replica, grads)


def _apply(replica, original, self, grads, trainable_variables=None):
    """Weighted all-reduce of the gradients (`_held`), then the optimizer's own apply."""
    _built(self, trainable_variables)
    grads = _held(replica, grads)
    _replica.reduced = True
    try:
        return original(self, grads, trainable_variables)
    finally:
        _replica.reduced = False


def _once_across(apply, grads):
    """`apply(grads)` once, outside the replicas, on the first replica's gradients (all
    reduced already, the same on every replica), updating every copy of every variable
    alike, as `strategy.extended.update` does: tf.distribute cannot cross from a replica
    into a mirrored update inside an `ops.cond`."""

    def across(strategy, *grads):
        first = [None if g is None else strategy.experimental_local_results(g)[0]
                 for g in grads]
        # Keras's TensorFlow optimizer reaches its mirrored updates through
        # `maybe_merge_call`, which assumes a replica; here the merge is made.
        interim = tf.__internal__.distribute.interim
        maybe_merge_call = interim.maybe_merge_call
        interim.maybe_merge_call = lambda fn, strategy, *args, **kwargs: fn(
            strategy, *args, **kwargs)
        try:
            apply(first)
        finally:
            interim.maybe_merge_call = maybe_merge_call

    tf.distribute.get_replica_context().merge_call(across, args=tuple(grads))


def _apply_gradients(replica, original, self, grads, trainable_variables):
    """Keras's apply, once, across replicas, where it chooses with `ops.cond`: gradient
    accumulation (and an EMA overwrite frequency) pick between updating and accumulating
    with a condition (see `_once_across`)."""
    if not getattr(_replica, "reduced", False) or not (
        self.gradient_accumulation_steps or (self.use_ema and self.ema_overwrite_frequency)
    ):
        return original(self, grads, trainable_variables)
    _once_across(lambda first: original(self, first, trainable_variables), grads)


def _loss_scale_apply(replica, original, self, grads, trainable_variables=None):
    """`LossScaleOptimizer.apply` (mixed_float16): the weighted all-reduce, then Keras's
    own apply once across replicas (`_once_across`): its finite check, on the summed
    gradients as one device checks its own, then the inner optimizer's update or a skipped
    step, and the scale's update, each chosen with `ops.cond`. (Keras's own TensorFlow path
    checks each replica's unreduced gradients and takes the first replica's verdict.)"""
    _built(self, trainable_variables)
    _once_across(lambda first: self._common_apply(first, trainable_variables),
                 _held(replica, grads))


def _all_reduce_sum(replica, original, self, grads_and_vars):
    if getattr(_replica, "reduced", False):
        return grads_and_vars  # reduced, with the weights, in `_apply`
    return original(self, grads_and_vars)


def _scale(replica, original, value):
    return value  # the weights k/n replace Keras's 1/R


def _add_loss(replica, original, self, loss):
    """Keras's `Layer.add_loss` as a rule: each replica keeps its own values.

    Keras keeps them in a list on the layer, which every replica's thread shares: a
    replica's step then summed the other replicas' losses with its own (the CTC example's
    loss came out 25 % too large on 2 devices).
    """
    if _keras.backend.in_stateless_scope():
        return original(self, loss)
    losses = tree.flatten(loss)
    for value in losses:
        if not keras.ops.is_tensor(value):
            return original(self, loss)  # Keras's own error
    _replica.losses.setdefault(id(self), []).extend(losses)
    return None


def _own_losses(replica, original, self):
    if _keras.backend.in_stateless_scope():
        return original(self)
    return list(_replica.losses.get(id(self), ()))


def _clear_losses(replica, original, self):
    if _keras.backend.in_stateless_scope():
        return original(self)
    for layer in self._flatten_layers():
        _replica.losses.pop(id(layer), None)
    return None


def _reduce_per_replica(replica, original, values, strategy, reduction):
    """Keras's reduction of a step's outputs, with several workers.

    Keras's own (`trainer.reduce_per_replica`) reduces a "mean" with
    `strategy.reduce("MEAN", v, axis=0)`, which fails on the scalar logs of
    every step ("Invalid reduction dimension 0 for input with 0 dimensions",
    tensorflow#72388), and orders a "concat" (predict) as TensorFlow's own
    dataset split deals the rows. Here the mean is over replicas (as Keras's
    one-worker mean), and the concat is in replica order: the replicas hold
    contiguous runs (`_MultiWorker`).
    """
    if not tf_trainer._collective_all_reduce_multi_worker(strategy):
        return original(values, strategy, reduction)
    if reduction == "auto":
        reduction = "mean"

    def reduce(value):
        if reduction == "concat":
            return strategy.gather(value, axis=0)
        if reduction in ("mean", "sum"):
            return strategy.reduce(reduction.upper(), value, axis=None)
        if reduction == "first":
            return strategy.experimental_local_results(value)[0]
        return original(value, strategy, reduction)

    return tree.map_structure(reduce, values)


def _rules_table():
    convolutions = ("conv", "depthwise_conv", "separable_conv", "conv_transpose")
    if not _tf_batches.empty_convolution_misshaped():
        convolutions = ()
    return [
        *((_keras.backend.nn, name, _tf_batches.any_rows, _step) for name in convolutions),
        (_keras.backend.nn, "max_pool", _tf_batches.pooled, _step),
        (tf.GradientTape, "gradient", _tf_grads.tape_gradient, _step),
        (tf_optimizer.TFOptimizer, "apply", _apply, _step),
        (keras.optimizers.LossScaleOptimizer, "apply", _loss_scale_apply, _step),
        (tf_optimizer.TFOptimizer, "_all_reduce_sum_gradients", _all_reduce_sum, _step),
        (tf_optimizer.TFOptimizer, "_backend_apply_gradients", _apply_gradients, _step),
        (loss_module, "scale_loss_for_distribution", _scale, _step),
        (loss_module, "unscale_loss_for_distribution", _scale, _step),
        (keras.layers.Layer, "add_loss", _add_loss, _step),
        (keras.layers.TimeDistributed, "call", _tf_batches.time_distributed, _step),
        (keras.layers.Layer, "_get_own_losses", _own_losses, _step),
        (keras.layers.Layer, "_clear_losses", _clear_losses, _step),
        (seed_generator, "global_seed_generator", _tf_seeds.global_generator,
         _tf_seeds.shared),
        *((owner, name, _tf_xla.by_xla(rule) if owner is tf_random else _TF_RULES.get(rule, rule),
           guard) for owner, name, rule, guard in rules.table(_step, _step, tf_random, DRAWS)),
    ]


# Rules of `rules.table` that this engine takes with more in front (`_tf_grads`).
_TF_RULES = {rules.mean_update: _tf_grads.mean_update}


def _process_rules_table(workers):
    """Rules that act outside the replicas: with several workers, Keras's scalar reduction;
    on every call, the per-device pipelines without autotuning (`without_autotune`)."""
    table = [(tf_trainer, "reduce_per_replica", _reduce_per_replica, lambda: workers),
             (keras.Variable, "__int__", _python_scalar, lambda: int),
             (keras.Variable, "__float__", _python_scalar, lambda: float)]
    if device_datasets is not None:
        table.append((device_datasets, "_create_device_dataset", without_autotune,
                      lambda: True))
    return table


def _python_scalar(convert, original, variable):
    """`int(variable)` or `float(variable)` (`convert`) of a scalar variable whose value is
    distributed for the call (`int(self.model.optimizer.iterations)` in a callback: Keras
    converts its value, which a distributed variable refuses): its first replica's, which
    one device's is."""
    value = variable._value
    if isinstance(value, tf.distribute.DistributedValues) and variable.ndim == 0:
        return convert(tf.convert_to_tensor(value))
    return original(variable)


NO_AUTOTUNE = tf.data.Options()
NO_AUTOTUNE.autotune.enabled = False


def without_autotune(_, original, *args, **kwargs):
    """One device's pipeline of a distributed dataset, without tf.data's autotuning.

    Keras makes a new iterator every epoch, and dropping the last one waits for the
    autotuning thread of each pipeline to wake from its sleep, which doubles up to a
    minute: TensorFlow stood still for 0.7 to 11 s at epoch starts and at the end of `fit`
    (benchmarks/tf_epoch_gaps.py). A device's pipeline (a generator and a prefetch of a fixed
    size) has nothing to tune, and it takes no options from the dataset it reads.
    """
    return original(*args, **kwargs).with_options(NO_AUTOTUNE)


_installed = threading.local()


@contextlib.contextmanager
def installed(workers):
    """Installs the rules for the duration (nested scopes install them once); `workers`:
    the joined workers, or None with one.

    They act only inside a replica's step run by `run_step` and defer to
    Keras's own code everywhere else, so other models are unaffected.
    """
    depth = getattr(_installed, "depth", 0)
    _installed.depth = depth + 1
    try:
        table = _rules_table() + _process_rules_table(workers)
        with rules.installed(table if depth == 0 else []):
            yield
    finally:
        _installed.depth = depth
