"""The exactness rules for metrics read by a replica (see `rules`), written once in
`keras.ops`: a metric's `result()` and a step's logs from every replica's state, summed
(or averaged) with one all-reduce, so that every replica's logs and callbacks see one
device's figures."""

import threading

import keras

from keras_multigpu import _keras
from keras_multigpu._keras import base_trainer
from keras_multigpu.rules_gather import classes_defining, on_the_batch, one_value
from keras_multigpu.rules_weights import weigh, weight

# The `MeanMetricWrapper` whose update is under way in this thread (`wrapped_update`).
_updating = threading.local()


def _global_state(replica, variables, what="all-reduce of the metrics"):
    """`(variable, value)` pairs of every replica's state for `variables`: summed ones
    summed, averaged ones averaged (one all-reduce); None when none is shared."""
    kinds = [getattr(v, "aggregation", None) for v in variables]
    shared = [i for i, kind in enumerate(kinds) if kind in ("sum", "mean")]
    if not shared:
        return None
    values = [keras.ops.convert_to_tensor(v.value) for v in variables]
    reduced = replica.all_reduce([values[i] for i in shared], what)
    for i, value in zip(shared, reduced):
        values[i] = value / replica.replicas if kinds[i] == "mean" else value
    return list(zip(variables, values))


def global_result(replica, original, metric):
    """A metric's `result()` (`original`) from every replica's state: its summed variables
    summed and its averaged ones averaged first, so that every replica's logs and
    callbacks (the progress bar, EarlyStopping) see one device's figures."""
    if _keras.backend.in_stateless_scope() or not metric.variables:
        return original(metric)
    state = _global_state(replica, metric.variables)
    if state is None:
        return original(metric)
    with keras.StatelessScope(state_mapping=state):
        result = original(metric)
    replica.results.extend(keras.tree.flatten(result))
    return result


def metrics_result(replica, original, trainer):
    """Keras's `get_metrics_result` (`original`, the logs of a step): every metric's
    `result()` from every replica's state, read with one all-reduce for them all.

    Where the backend's trainer has a `get_metrics_result` of its own (`metrics_owner`),
    its generic one, `Trainer`'s, reads the state: the next Keras's torch trainer sums every
    metric variable across processes itself, one all-reduce each, whatever its aggregation.
    """
    if _keras.backend.in_stateless_scope():
        return original(trainer)
    variables = list({id(v): v for m in trainer.metrics for v in m.variables}.values())
    state = _global_state(replica, variables) if variables else None
    if state is None:
        logs = generic_metrics_result(trainer)
    else:
        with keras.StatelessScope(state_mapping=state):
            logs = generic_metrics_result(trainer)
    replica.results.extend(keras.tree.flatten(logs))
    return logs


def wrapped_update(replica, original, metric, y_true, y_pred, sample_weight=None):
    """`MeanMetricWrapper.update_state` (`original`), the metric a function makes (a
    compiled `metrics=[fn]`): where the function returns one value for the batch, not one
    per row (the TensorFlow tutorials' masked accuracy, a ratio of sums over the batch),
    that value is computed again on the `y_true` and `y_pred` gathered from every replica,
    as one device computes it (the rules suspended), and weighed by k / n: the replicas'
    updates add one device's value once. Keras's `Mean` would average the replicas' own
    values (a replica of no rows: 0 / 0). `wrapped_value` decides, where the update reaches
    `Mean.update_state`; any other update is Keras's own."""

    if sample_weight is not None:
        return original(metric, y_true, y_pred, sample_weight)
    before = getattr(_updating, "call", None)
    _updating.call = call = {"metric": metric, "parts": (y_true, y_pred), "one": False}
    try:
        result = original(metric, y_true, y_pred, sample_weight)
    finally:
        _updating.call = before
    if not call["one"]:
        return result
    return on_the_batch(replica, original, metric, y_true, y_pred,
                        sample_weight=weight(replica, metric.dtype))


def updating(metric):
    """Whether `wrapped_update` is updating `metric` in this thread."""
    call = getattr(_updating, "call", None)
    return call is not None and call["metric"] is metric


def wrapped_value(replica, metric, values, sample_weight):
    """What `Mean.update_state(values)` holds where `wrapped_update`'s metric calls it:
    "batch" (one value for the batch, which `wrapped_update` then adds instead), "rows"
    (a value per row, squeezed to one on a replica of one row too: Keras's own update,
    which counts its rows) or None (not such a call). Every replica asks alike."""
    if not updating(metric) or sample_weight is not None:
        return None
    call, _updating.call = _updating.call, None  # asked once per update
    call["one"] = one_value(replica, metric, values, call["parts"],
                            lambda parts: metric._fn(*parts, **metric._fn_kwargs))
    return "batch" if call["one"] else "rows"


def own_logs(replica, logs):
    """The logs a step returned (`logs`), as one device's. A metric's result is the batch's
    already (`global_result`, `metrics_result`); any other float tensor (a loss a custom
    `train_step` returns as it computed it, on its replica's rows) is taken for a mean over
    the rows, as the gradients are, and weighed by k / n across the replicas: one
    all-reduce for them all, none where every value is a metric's. Keras's own reduction
    of the replicas' logs then finds them equal."""
    if not isinstance(logs, dict):
        return logs
    own = {key: value for key, value in logs.items()
           if keras.ops.is_tensor(value) and not any(value is r for r in replica.results)
           and keras.backend.standardize_dtype(value.dtype).startswith(("float", "bfloat"))}
    if not own:
        return logs

    weighed = [weigh(replica, keras.ops.cast(keras.ops.stop_gradient(v), "float32"))
               for v in own.values()]
    summed = replica.all_reduce(weighed, "all-reduce of the logs the step returned")
    return {**logs, **{key: keras.ops.cast(value, own[key].dtype)
                       for key, value in zip(own, summed)}}


def generic_metrics_result(trainer):
    """Keras's generic `get_metrics_result` (`Trainer`'s, not a backend trainer's): every
    metric's `result()`, from the state it holds."""
    generic = base_trainer.Trainer.get_metrics_result
    return getattr(generic, "_keras_multigpu_original", generic)(trainer)  # where patched


def metrics_owner():
    """The class whose `get_metrics_result` a Keras model runs: `Trainer`, or the
    backend's trainer where it has its own (the next Keras's torch trainer)."""
    return next(cls for cls in keras.Model.__mro__ if "get_metrics_result" in vars(cls))


def metric_classes():
    """Every Metric class defined so far that has its own `result` (the user's too)."""
    return classes_defining(keras.metrics.Metric, "result")
