"""The rule's weights, k / n, and the gradients' weighing by them: after a replica's
backward pass (`weigh_gradient`), before it (`scaled_loss`, Keras's own steps'), and through a sum
across replicas (`weighted_sum`). Rules of `rules.table`; see `rules` for the rule."""

import keras


def held(replica, grads):
    """Whether `grads` are all gradients this step all-reduced where it took them
    (`Replica.reduced`; a step may have changed them in place since: a scale, a clip)."""
    reduced = {id(g) for g in replica.reduced}  # the list keeps them alive: ids are theirs
    return bool(reduced) and all(g is None or id(g) in reduced for g in grads)


def weight(replica, dtype="float32"):
    """k / n, in `dtype` (0 for a replica without rows)."""
    return keras.ops.divide_no_nan(keras.ops.cast(replica.k, dtype),
                                   keras.ops.cast(replica.n, dtype))


def share(replica, dtype):
    """n / k: turns this replica's part of a sum into the term the rule weighs."""
    return keras.ops.divide_no_nan(keras.ops.cast(replica.n, dtype),
                                   keras.ops.cast(keras.ops.maximum(replica.k, 1), dtype))


def _with_rows(w, value):
    """`value` where the replica has rows (`w` = k / n > 0), else 0 (a mean over no rows
    may be NaN)."""
    return keras.ops.where(w > 0, value, keras.ops.zeros_like(value))


def weigh(replica, value):
    """A value of this replica's mean (a loss, its gradient) times k / n; 0 without rows."""
    w = weight(replica, value.dtype)
    return _with_rows(w, value * w)


def weigh_gradient(replica, gradient):
    """`weigh` of a gradient of this replica's mean loss; of a loss weighed before its
    backward pass (`scaled_loss`), the gradient as it is."""
    if not replica.weighed:
        return weigh(replica, gradient)
    return _with_rows(weight(replica, gradient.dtype), gradient)


def scaled_loss(replica, original, optimizer, loss):
    """`Optimizer.scale_loss`, through which Keras's own steps hand their loss to the backward
    pass (and `LossScaleOptimizer`'s, mixed_float16's): there, a mean over this replica's rows
    is weighed by k / n before the backward pass, so that every gradient inside the pass is
    one device's. A replica of k rows in n backpropagated n / k times one device's: a gradient
    the model changes as it flows (an `ops.custom_gradient` that clips it) was clipped
    elsewhere, and float16's overflowed where one device's did not, skipping a step one device
    took. `weigh_gradient` then leaves the gradients as they are. In a step of the user's own
    (`Replica.own_step` false), a plain optimizer's scale is left as it is: the step may
    change its gradients before `apply`, or take them of a value made from the loss, and
    its gradients are weighed after the pass. A loss that sums the rows, or divides two sums
    (`Replica.summed`), is weighed where its gradient is taken (`unscaled`)."""
    summed = replica.summed is not None and replica.summed(replica, loss)
    scaled = original(optimizer, loss)
    if summed:
        replica.scaled.append((scaled, loss))
    elif replica.own_step or isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        replica.weighed = True
        scaled = scaled * weight(replica, scaled.dtype)
    return scaled


def own_step(replica, original, model, *args, **kwargs):
    """Keras's own `train_step` (`Replica.own_step`, for `scaled_loss` and torch's buckets)."""
    replica.own_step = True
    try:
        return original(model, *args, **kwargs)
    finally:
        replica.own_step = False


def unscaled(replica, target):
    """The loss `scaled_loss` was handed, where `target` is what it returned for a loss that
    sums the rows or divides two sums (a `LossScaleOptimizer` multiplies it by its scale, and
    the graph the engine reads would take the product for a mean); else `target`."""
    return next((loss for scaled, loss in replica.scaled if target is scaled), target)


def weighted_sum(replica, value, what="all-reduce of BatchNormalization's moments"):
    """The sum of `value` across replicas, whose gradient keeps the rule.

    Each replica's gradient is weighed by k_r / n after its backward pass (`weigh_gradient`),
    but a gradient that crosses replicas here comes from every replica's loss: the upstream
    gradients are weighed by their own k_s / n before they are summed, and multiplied by
    n / k_r, which the later weighing by k_r / n undoes. (Of a loss weighed before its
    backward pass, `scaled_loss`, they are summed as they are.)
    """

    @keras.ops.custom_gradient
    def reduce(value):
        def grad(*args, upstream=None):
            if upstream is None:
                (upstream,) = args
            if replica.weighed:  # each upstream is weighed already, and is left so
                return replica.all_reduce([upstream], f"{what} (backward)")[0]
            w = weight(replica, upstream.dtype)
            summed = replica.all_reduce([upstream * w], f"{what} (backward)")[0]
            return _with_rows(w, summed * share(replica, summed.dtype))

        return replica.all_reduce([value], what)[0], grad

    return reduce(value)
