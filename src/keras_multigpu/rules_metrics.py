"""The exactness rules for metrics read by a replica (see `rules`), written once in
`keras.ops`: a metric's `result()` and a step's logs from every replica's state, summed
(or averaged) with one all-reduce, so that every replica's logs and callbacks see one
device's figures."""

import keras

from keras_multigpu import _keras
from keras_multigpu._keras import base_trainer
from keras_multigpu.rules_gather import classes_defining


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
    from keras_multigpu.rules import weigh  # `rules` imports this module

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
