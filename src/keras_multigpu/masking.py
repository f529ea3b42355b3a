"""Loss and metrics over the real rows of a padded batch.

Zero sample weights alone do not hide padding: Keras's default loss
reduction ("sum_over_batch_size") divides by the number of rows, padding
included. With P rows of which n are real,

    compiled_loss(y, y_pred, weights * mask) * P / n

is the mean over the n real rows: exactly the one-device loss of that batch,
hence exactly its gradients. Reductions that already divide by the weights
("mean_with_sample_weight") or do not divide ("sum") need no factor.

Metrics get the mask as their sample weight (weighted metrics get
weights * mask), and the loss trackers (the total and each output's) weigh
each batch by its real rows, so epoch-level logs equal one device's too.
"""

import keras
from keras import ops, tree

# Reductions whose value divides by the number of rows (padding included).
_ROW_MEAN = ("sum_over_batch_size", "mean")
_NO_FACTOR = ("sum", "mean_with_sample_weight")


class RowMean(keras.metrics.Mean):
    """The loss tracker of a `ParallelModel`.

    Keras's trainers update the loss tracker with the padded row count as
    weight; that call is ignored here and `record` is called instead, from
    `compute_loss`, with the real row count.
    """

    def update_state(self, values, sample_weight=None):
        del values, sample_weight  # Keras's call: padded rows; see `record`.

    def record(self, values, rows):
        super().update_state(values, sample_weight=rows)


def scales_by_rows(loss):
    """Whether the compiled `loss` divides by the row count.

    Args:
        loss: the `loss` argument given to `compile`: a string, a function, a
            `keras.losses.Loss`, or a list/dict of them.

    Raises:
        ValueError: when outputs mix reductions that need different factors.
    """
    reductions = set()
    for item in tree.flatten(loss):
        reduction = getattr(item, "reduction", "sum_over_batch_size")
        if reduction in _ROW_MEAN:
            reductions.add(True)
        elif reduction in _NO_FACTOR:
            reductions.add(False)
        else:
            raise ValueError(
                f"A ParallelModel needs a scalar loss; the loss {item!r} has "
                f"reduction={reduction!r}. Use 'sum_over_batch_size' (the "
                "default), 'mean_with_sample_weight' or 'sum'."
            )
    if len(reductions) > 1:
        raise ValueError(
            "The losses mix reductions that divide by the batch size with ones "
            "that do not. Received: "
            f"{[getattr(i, 'reduction', 'sum_over_batch_size') for i in tree.flatten(loss)]}. "
            "Give every output the same kind of reduction."
        )
    return reductions != {False}


def compute_loss(model, y, y_pred, weights, mask, scale_by_rows):
    """The total loss of the real rows; records it in the loss tracker.

    `weights` and `mask` are None for a batch with neither padding nor
    weights: then this is Keras's own computation.
    """
    if mask is None:
        mask = ops.ones((ops.shape(tree.flatten(y_pred)[0])[0],), "float32")
    rows = ops.sum(mask)
    padded = ops.cast(ops.shape(mask)[0], rows.dtype)
    losses = []
    if model._compile_loss is not None:
        # Per-output loss trackers ("cls_loss") are updated inside the call
        # below, weighted by the padded row count: re-weigh them after it.
        trackers = [m for m in model._compile_loss.metrics if isinstance(m, keras.metrics.Mean)]
        before = [(m.total.value, m.count.value) for m in trackers]
        loss = model._compile_loss(y, y_pred, weights)
        for tracker, (total, count) in zip(trackers, before):
            added = tracker.total.value - total  # value * padded
            if not scale_by_rows:
                added = added * ops.cast(rows / padded, added.dtype)
            tracker.total.assign(total + added)
            tracker.count.assign(count + ops.cast(rows, count.dtype))
        if loss is not None:
            if scale_by_rows:
                loss = loss * ops.cast(padded / rows, loss.dtype)
            losses.append(loss)
    losses.extend(model._aggregate_additional_loss(loss) for loss in model.losses)
    total = ops.sum(ops.stack(losses)) if losses else ops.zeros(())
    model._loss_tracker.record(total, rows)
    return total


def update_metrics(compile_metrics, y, y_pred, weights, mask):
    """`CompileMetrics.update_state`, with the mask as every metric's weight."""
    if compile_metrics is None:
        return
    if mask is None:  # neither padding nor weights
        compile_metrics.update_state(y, y_pred)
        return
    if not compile_metrics.built:
        compile_metrics.build(y, y_pred)
    y = compile_metrics._flatten_y(y)
    y_pred = compile_metrics._flatten_y(y_pred)
    weights = compile_metrics._flatten_y(weights)
    if len(weights) < len(y):
        weights = [weights[0]] * len(y)
    for metric, y_t, y_p in zip(compile_metrics._flat_metrics, y, y_pred):
        if metric:
            metric.update_state(y_t, y_p, sample_weight=mask)
    for metric, y_t, y_p, w in zip(compile_metrics._flat_weighted_metrics, y, y_pred, weights):
        if metric:
            metric.update_state(y_t, y_p, sample_weight=w)
