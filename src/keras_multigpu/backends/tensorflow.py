"""TensorFlow engine: replica functions through tf.distribute.MirroredStrategy.

Each replica runs the model's own step on its part of the global batch, and
the strategy all-reduces (NCCL on GPUs; on CPU devices, through one device).
A replica sees only its rows, so exactness cannot come from a global view.
It comes from `keras_multigpu.rules`, installed for the length of a call with the
replica context's all-reduce (the torch engine keeps the same rules):

    one device's value = sum over replicas r of (k_r / n) * value_r

where k_r is replica r's real rows and n the global batch's. Here, beside them:

- gradients are weighed (`rules.weigh`, kept sparse where they are) and all-reduced once,
  before the optimizer clips, accumulates or applies them (Keras's own sum is then
  skipped), so a custom `train_step` with its own mean loss is exact;
- Keras's 1/R loss scaling is off (the weights replace it);
- each replica keeps its own `add_loss` values (Keras keeps them in a list on the layer,
  which every replica's thread shares).

A padded batch travels with one marker row per row (`tag`): whether the row
is real, and n. Real rows are dealt to replicas in contiguous runs that
differ by at most one, so only a batch smaller than the device count leaves
a replica with none; that replica runs on zero rows and weighs nothing.

The user's model is built outside any strategy. For the length of each
call its variables are swapped for mirrored ones (same values, same
`keras.Variable` objects), and swapped back, holding the trained values,
when it ends: the trained model is the user's own, and trains, saves, loads
and predicts on its own as any Keras model.

Several workers (`TF_CONFIG` naming more than one, one process per host):
the strategy is a `MultiWorkerMirroredStrategy` over this worker's devices,
joined when the package is imported (TensorFlow fixes its collectives when
its runtime starts) or given a clear error after KERAS_MULTIGPU_TIMEOUT
seconds. Replica indexes and counts are global (worker-major), and every
worker's devices get only their own contiguous runs of each global batch
(`_MultiWorker.experimental_distribute_dataset`), so the rules above hold
unchanged. The process rules (worker 0 alone writes Keras files, every worker
takes worker 0's random state and stops at the same step after a Ctrl-C) are
`keras_multigpu.processes`', over the coordination service's key-value store.
"""

import concurrent.futures
import contextlib
import functools
import json
import os
import random
import threading
import warnings

import keras
import numpy as np
import tensorflow as tf
from keras import tree
from tensorflow.python.distribute import collective_all_reduce_strategy as tf_collective
from tensorflow.python.distribute import multi_worker_util
from tensorflow.python.distribute.cluster_resolver import tfconfig_cluster_resolver
from tensorflow.python.eager import context as tf_context

from keras_multigpu import _keras, processes, rules
from keras_multigpu._keras import (
    base_layer,
    loss_module,
)
from keras_multigpu._keras.tensorflow import DRAWS
from keras_multigpu._keras.tensorflow import optimizer as tf_optimizer
from keras_multigpu._keras.tensorflow import random as tf_random
from keras_multigpu._keras.tensorflow import trainer as tf_trainer
from keras_multigpu.devices import (
    CPU_DEVICES_ENV,
    TIMEOUT_ENV,
    Device,
    collective_timeout,
    cpu_device_count,
    refuse_several_processes,
)

# What this engine does beyond the seam's common names (see `keras_multigpu.backends`).
CAPABILITIES = frozenset({"cpu_devices", "check_model", "release", "batch_spec"})

# Inside a replica's step: `state`, its `rules.Replica` (k, n, start as int32 tensors).
_replica = threading.local()


def configure_cpu_devices(count):
    """Splits the host CPU into `count` logical devices, if TensorFlow has not started."""
    cpus = tf.config.list_physical_devices("CPU")
    config = [tf.config.LogicalDeviceConfiguration() for _ in range(count)]
    try:
        tf.config.set_logical_device_configuration(cpus[0], config)
        return True
    except RuntimeError:  # the runtime is initialised: the count is fixed
        have = len(_local(tf.config.list_logical_devices("CPU")))
        if have != count:
            warnings.warn(
                f"TensorFlow had already started with {have} CPU device(s), so {count} could "
                f"not be configured. Set {CPU_DEVICES_ENV} (or import keras_multigpu) before "
                "anything runs a TensorFlow operation.",
                stacklevel=3,
            )
        return have == count


def _local(devices):
    """This worker's devices among `devices` (with several workers, TensorFlow lists all)."""
    if _workers is None:
        return devices
    here = (_workers.task_type, _workers.task_id)
    return [d for d in devices
            if (tf.DeviceSpec.from_string(d.name).job, tf.DeviceSpec.from_string(d.name).task)
            == here]


def list_devices():
    gpus = _local(tf.config.list_logical_devices("GPU"))
    if gpus:
        return [Device(i, "gpu", "GPU") for i in range(len(gpus))]
    cpus = _local(tf.config.list_logical_devices("CPU"))
    wanted = cpu_device_count()
    if wanted and wanted != len(cpus):
        raise RuntimeError(
            f"{CPU_DEVICES_ENV}={wanted}, but TensorFlow started with {len(cpus)} CPU "
            f"device(s): it fixes its devices when it first runs an operation. Set "
            f"{CPU_DEVICES_ENV} before the program starts (or import keras_multigpu before "
            "anything runs in TensorFlow)."
        )
    name = "CPU" if len(cpus) == 1 else "virtual CPU"
    return [Device(i, "cpu", name) for i in range(len(cpus))]


@functools.cache
def _strategy(names):
    """One MirroredStrategy per device set, for the life of the process.

    Each strategy numbers its collective groups from its own base: two
    strategies that both started at 1 would join different device sets
    under one group key, which TensorFlow aborts.
    """
    base = tf.distribute.MirroredStrategy._collective_key_base
    tf.distribute.MirroredStrategy._collective_key_base = 1000 * (_strategy.cache_info().currsize
                                                                  + 1)
    try:
        return tf.distribute.MirroredStrategy(list(names))
    finally:
        tf.distribute.MirroredStrategy._collective_key_base = base


class Engine:
    """A MirroredStrategy over `devices` (with several workers, a MultiWorkerMirroredStrategy
    over every worker's: `num_replicas` counts them all)."""

    def __init__(self, devices, strategy=None):
        self.devices = tuple(devices)
        self.strategy = strategy or _strategy(tuple(f"/device:{d.kind.upper()}:{d.id}"
                                                    for d in devices))
        self.num_replicas = self.strategy.num_replicas_in_sync

    def scope(self):
        return scope(self)


def make_distribution(devices):
    if tf.distribute.has_strategy():
        owner = type(tf.distribute.get_strategy()).__name__
        raise RuntimeError(
            f"multi_gpu_model was called inside the scope of {owner}. keras_multigpu runs its "
            "own tf.distribute strategy: build the model and call multi_gpu_model outside any "
            "strategy.scope()."
        )
    if _late is not None:
        raise _late
    if _workers is None:
        refuse_several_processes("TensorFlow")
        return Engine(devices)
    return _workers.distribution(devices)


def check_model(model):
    """Refuses a model that another tf.distribute strategy owns."""
    owner = getattr(model, "_distribute_strategy", None)
    if owner is not None:
        raise ValueError(
            f"The model {model.name!r} was built inside the scope of {type(owner).__name__}, "
            "which owns its variables. Build it outside any strategy.scope() and pass it to "
            "multi_gpu_model, which distributes it itself."
        )


@contextlib.contextmanager
def scope(distribution):
    """The strategy's scope, with the exactness rules of this module in force."""
    with distribution.strategy.scope(), _rules():
        yield


# -- variables ------------------------------------------------------------


def _aggregation(variable):
    aggregation = variable._map_aggregation(variable.aggregation)
    if aggregation == tf.VariableAggregation.NONE and not variable.trainable:
        # Assigned inside replicas (BatchNormalization statistics, seed
        # states): every replica computes the same value; take the first's.
        return tf.VariableAggregation.ONLY_FIRST_REPLICA
    return aggregation


def _mirrored_for(value, strategy):
    return (isinstance(value, tf.distribute.DistributedValues)
            and value._distribute_strategy is strategy)


def _as_tensor(value):
    if isinstance(value, tf.distribute.DistributedValues):
        return tf.convert_to_tensor(value)
    return value.read_value()


def _reindex(optimizer):
    """The optimizer finds a variable's slots by its TF variable's id: renew the index."""
    if optimizer is not None and optimizer.built:
        optimizer._trainable_variables_indices = {
            optimizer._var_key(v): i for i, v in enumerate(optimizer._trainable_variables)
        }


def replicate(variables, distribution, optimizers=()):
    """Puts each variable's value on every device of `distribution`, for one call.

    The `keras.Variable` objects stay the same; only the TensorFlow variable
    behind each is swapped for a mirrored one (kept per strategy, so that
    compiled steps stay valid from call to call) holding the same value.
    `release` swaps the plain ones back at the end of the call.
    """
    strategy = distribution.strategy
    swapped = False
    for variable in variables:
        value = variable._value
        if value is None:
            continue  # not initialised yet: it will be created in scope
        mirrors = variable.__dict__.setdefault("_keras_multigpu_mirrors", {})
        mirrored = mirrors.get(strategy)
        if value is mirrored:
            continue
        if not isinstance(value, tf.distribute.DistributedValues):
            variable._keras_multigpu_plain = value
        current = _as_tensor(value)
        if mirrored is None:
            with strategy.scope():
                mirrored = tf.Variable(
                    current, trainable=variable.trainable, name=variable.name,
                    aggregation=_aggregation(variable),
                    synchronization=variable._map_synchronization(variable.synchronization),
                )
            mirrors[strategy] = mirrored
        else:
            with strategy.scope():
                mirrored.assign(current)
        variable._value = mirrored
        swapped = True
    for optimizer in optimizers:
        # Optimizers made outside the strategy (all of a GAN's, before it is compiled in a
        # scope) take their strategy at construction: each is pointed at this one.
        optimizer._distribution_strategy = strategy
        if swapped:
            _reindex(optimizer)


def release(variables, distribution, optimizers=(), failed=False):
    """Swaps plain variables, holding the trained values, back in after a call.

    The user's model then trains, predicts and saves on its own, outside any
    strategy, as if it had never been distributed.
    """
    strategy = distribution.strategy
    for variable in variables:
        value = variable._value
        if not isinstance(value, tf.distribute.DistributedValues):
            continue
        if not _mirrored_for(value, strategy):
            continue
        # Created in the strategy's scope (the optimizer's slots): keep it for
        # the next call, and give the variable a plain twin.
        variable.__dict__.setdefault("_keras_multigpu_mirrors", {})[strategy] = value
        plain = variable.__dict__.get("_keras_multigpu_plain")
        current = tf.convert_to_tensor(value)
        if plain is None:
            with tf.init_scope():
                plain = tf.Variable(current, trainable=variable.trainable, name=variable.name,
                                    aggregation=value.aggregation,
                                    synchronization=variable._map_synchronization(
                                        variable.synchronization))
            variable._keras_multigpu_plain = plain
        else:
            plain.assign(current)
        variable._value = plain
    for optimizer in optimizers:
        optimizer._distribution_strategy = tf.distribute.get_strategy()
        _reindex(optimizer)


# -- data -----------------------------------------------------------------


_BATCH, _ROWS = "keras_multigpu_batch", "keras_multigpu_rows"


def _deal(rows, replicas):
    """Row order of a padded batch: each replica's real rows, then its padding.

    >>> _deal(5, 4).tolist()   # replicas get [0, 1], [2, 0*], [3, 0*], [4, 0*]
    [0, 1, 2, 0, 3, 0, 4, 0]
    """
    per = -(-rows // replicas)
    counts = [rows // replicas + (r < rows % replicas) for r in range(replicas)]
    order, start = [], 0
    for count in counts:
        real = list(range(start, start + count))
        order += real + [real[0] if real else 0] * (per - count)
        start += count
    return np.asarray(order), np.repeat(counts, per) > np.tile(np.arange(per), replicas)


def tag(batch, rows, replicas):
    """The padded `batch` (real rows first) reordered for the replicas, with a marker per row.

    Returns `(tagged,)`, as the JAX engine's: Keras takes it for an `(x,)`
    batch and hands it to the step whole; the strategy splits every part.
    """
    order, real = _deal(rows, replicas)  # covers the padded size, a multiple of replicas
    dealt = tree.map_structure(lambda a: None if a is None else np.asarray(a)[order], batch)
    marker = np.stack([real.astype("int32"), np.full(len(order), rows, "int32")], axis=1)
    return ({_BATCH: dealt, _ROWS: marker},)


def _tagged(data):
    return isinstance(data, dict) and data.keys() == {_BATCH, _ROWS}


def _unwrap(data):
    if isinstance(data, tuple) and data and _tagged(data[0]):
        if any(part is not None for part in data[1:]):
            raise ValueError("A tagged batch must travel alone.")
        return data[0]
    return data


def untag(data):
    """The real rows of this replica's part of a tagged batch, else `data` itself."""
    data = _unwrap(data)
    if not _tagged(data):
        return data
    batch, marker = data[_BATCH], data[_ROWS]
    if isinstance(marker, keras.KerasTensor):  # a symbolic build: shapes only
        return batch
    real = tf.reduce_sum(marker[:, 0])
    return tree.map_structure(lambda a: None if a is None else a[:real], batch)


def _counts(data):
    """(k, n, start) of this replica as int32 tensors: its real rows, the global batch's, and
    where its rows start in the global batch (`_deal`'s contiguous runs)."""
    data = _unwrap(data)
    context = tf.distribute.get_replica_context()
    replicas = context.num_replicas_in_sync
    replica = tf.cast(context.replica_id_in_sync_group, "int32")
    if _tagged(data):
        marker = data[_ROWS]
        # Every replica's part holds at least one marker row, so n is read there.
        k, n = tf.reduce_sum(marker[:, 0]), tf.reduce_max(marker[:, 1])
        return k, n, replica * (n // replicas) + tf.minimum(replica, n % replicas)
    first = next(leaf for leaf in tree.flatten(data) if leaf is not None)
    k = tf.shape(first)[0]
    return k, k * replicas, replica * k


def run_step(step, data, rows_out=False):
    """Runs `step` (the model's own) on this replica's real rows, under the rules above.

    With `rows_out` (predict), Keras concatenates the replicas' rows itself."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1 and not _tagged(_unwrap(data)):
        return step(untag(data))
    previous = getattr(_replica, "state", None), getattr(_replica, "losses", None)
    _replica.state = rules.Replica(*_counts(data), replicas=context.num_replicas_in_sync,
                                   all_reduce=_sum, traced=True)
    _replica.losses = {}  # this replica's `add_loss` values (see `_add_loss`)
    try:
        return step(untag(data))
    finally:
        _replica.state, _replica.losses = previous


def batch_spec(iterator):
    """The structure of a distributed batch as KerasTensors, read from its spec, not its data."""
    for _, _, data in iterator:
        spec = data.element_spec
        break
    else:
        return None

    def symbolic(s):
        s = getattr(s, "_value_specs", (s,))[0]  # PerReplicaSpec: every replica's is alike
        if isinstance(s, tf.TensorSpec):
            return keras.KerasTensor(tuple(s.shape), s.dtype.name)
        return None

    return tree.map_structure(symbolic, spec)


def process_index():
    return 0 if _workers is None else _workers.index


def process_count():
    return 1 if _workers is None else _workers.count


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
    return tf.distribute.get_replica_context().all_reduce(
        reduction, tf.nest.map_structure(_placed, values))


def _sum(values, what):
    """Sums `values` across replicas (`rules.Replica.all_reduce`). A variable is read first
    (`keras.ops.convert_to_tensor` hands a `tf.Variable` back as it is), so that `_placed`
    can give its read a device."""
    return list(_all_reduce([tf.convert_to_tensor(v) for v in values]))


def _weighed(replica, gradient):
    """`rules.weigh`, kept sparse where the gradient is, as one device's is."""
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(_weighed(replica, gradient.values), gradient.indices,
                                gradient.dense_shape)
    return rules.weigh(replica, gradient)


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


def _apply(replica, original, self, grads, trainable_variables=None):
    """Weighted all-reduce of the gradients, then the optimizer's own apply.

    An optimizer first used inside the step (a GAN's `d_optimizer`, built by its first
    `apply`) is built outside the traced step first, as the model's own optimizer is
    before the step: mirrored variables made inside a replica's traced step have
    initialisers `tf.function` cannot lift, and the step it then builds around them fails.
    """
    if not self.built and trainable_variables is not None:
        with tf.init_scope(), keras.name_scope(self.name, caller=self):
            self.build(list(trainable_variables))
    present = [_summable(_weighed(replica, g)) for g in grads if g is not None]
    if present:
        reduced = iter(_all_reduce(present))
        grads = [None if g is None else _unsummable(g, next(reduced)) for g in grads]
    _replica.reduced = True
    try:
        return original(self, grads, trainable_variables)
    finally:
        _replica.reduced = False


def _apply_gradients(replica, original, self, grads, trainable_variables):
    """Keras's apply, once, across replicas, where it chooses with `ops.cond`.

    Gradient accumulation (and an EMA overwrite frequency) pick between
    updating and accumulating with a condition, and tf.distribute cannot
    cross from a replica into the mirrored update inside one. The gradients
    are all-reduced already, the same on every replica, so the whole apply
    runs once outside the replicas, on the first replica's, and updates every
    copy of every variable alike, as `strategy.extended.update` does.
    """
    if not getattr(_replica, "reduced", False) or not (
        self.gradient_accumulation_steps or (self.use_ema and self.ema_overwrite_frequency)
    ):
        return original(self, grads, trainable_variables)

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
            original(self, first, trainable_variables)
        finally:
            interim.maybe_merge_call = maybe_merge_call

    tf.distribute.get_replica_context().merge_call(across, args=tuple(grads))


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
        if not _keras.backend.is_tensor(value):
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


def _several_workers():
    return _workers


def _rules_table():
    return [
        (tf_optimizer.TFOptimizer, "apply", _apply, _step),
        (tf_optimizer.TFOptimizer, "_all_reduce_sum_gradients", _all_reduce_sum, _step),
        (tf_optimizer.TFOptimizer, "_backend_apply_gradients", _apply_gradients, _step),
        (loss_module, "scale_loss_for_distribution", _scale, _step),
        (loss_module, "unscale_loss_for_distribution", _scale, _step),
        (base_layer.Layer, "add_loss", _add_loss, _step),
        (base_layer.Layer, "_get_own_losses", _own_losses, _step),
        (base_layer.Layer, "_clear_losses", _clear_losses, _step),
        *rules.table(_step, _step, tf_random, DRAWS),
    ]


def _process_rules_table():
    """Rules that act outside the replicas, with several workers only."""
    return [(tf_trainer, "reduce_per_replica", _reduce_per_replica, _several_workers)]


_installed = threading.local()


@contextlib.contextmanager
def _rules():
    """Installs the rules for the duration (nested scopes install them once).

    They act only inside a replica's step run by `run_step` and defer to
    Keras's own code everywhere else, so other models are unaffected.
    """
    depth = getattr(_installed, "depth", 0)
    _installed.depth = depth + 1
    try:
        table = _rules_table() + _process_rules_table()
        with rules.installed(table if depth == 0 else []):
            yield
    finally:
        _installed.depth = depth


# -- several workers (TF_CONFIG) ---------------------------------------------

# Seconds a worker waits for the others (to join, at a save) before it fails.


_timeout = collective_timeout


def _worker_count(spec):
    return sum(len(spec.as_dict().get(job, [])) for job in ("chief", "worker"))


def _cluster():
    """`(cluster_spec, task_type, task_id)` when TF_CONFIG names several workers, else None."""
    raw = os.environ.get("TF_CONFIG", "")
    if not raw.strip():
        return None
    try:
        config = json.loads(raw)
    except ValueError as error:
        raise ValueError(
            f"TF_CONFIG is not valid JSON ({error}). Received: TF_CONFIG={raw!r}. It should "
            'look like {"cluster": {"worker": ["host0:port", "host1:port"]}, "task": '
            '{"type": "worker", "index": 0}}.'
        ) from error
    resolver = tfconfig_cluster_resolver.TFConfigClusterResolver()
    spec = multi_worker_util.normalize_cluster_spec(resolver.cluster_spec())
    workers = _worker_count(spec)
    if workers <= 1:
        return None
    task = config.get("task", {}) if isinstance(config, dict) else {}
    task_type, task_id = task.get("type"), task.get("index")
    if task_type not in ("chief", "worker") or not isinstance(task_id, int) \
            or not 0 <= task_id < len(spec.as_dict().get(task_type, [])):
        raise ValueError(
            f"TF_CONFIG names {workers} workers, but its task ({task!r}) is not one of them. "
            'Set "task": {"type": "worker", "index": i} with i this worker\'s position in '
            '"cluster": {"worker": [...]} (0 to ' f"{workers - 1})."
        )
    return spec, task_type, task_id


class _MultiWorker(tf.distribute.MultiWorkerMirroredStrategy):
    """MultiWorkerMirroredStrategy whose replicas get contiguous runs of each global batch.

    TensorFlow's own split gives replica r of worker w the part w + W * r
    of the global batch (it splits the batch among all replicas, then deals
    the parts to workers in turn), while replica indexes run worker by
    worker (w * G + r). Here every worker reads the global batch and keeps
    its own parts, in replica order, so that replica i gets part i: the
    contiguous runs that `tag` deals and `_counts` assumes, as one worker's
    MirroredStrategy gets them.
    """

    def experimental_distribute_dataset(self, dataset, options=None):
        replicas = self.num_replicas_in_sync
        local = len(self.extended.worker_devices)
        first = self.extended._id_in_cluster * local

        def parts(*element):  # tf.data unpacks a tuple element into arguments
            element = element[0] if len(element) == 1 else element

            def part(i):
                def cut(a):
                    if not isinstance(a, tf.Tensor):
                        return a  # None travels as an empty Optional: every replica's
                    per = tf.shape(a)[0] // replicas
                    start = (first + tf.cast(i, "int32")) * per
                    return a[start : start + per]

                return tf.nest.map_structure(cut, element)

            return tf.data.Dataset.range(local).map(part)

        return self.distribute_datasets_from_function(
            lambda context: dataset.flat_map(parts), options)


class _Workers:
    """This worker's place among several, and the one strategy they share."""

    def __init__(self, spec, task_type, task_id, strategy):
        self.spec, self.task_type, self.task_id = spec, task_type, task_id
        self.strategy = strategy
        self.index = strategy.extended._id_in_cluster
        self.count = strategy.extended._num_workers

    def who(self):
        return f"Worker {self.index} of {self.count} ({self.task_type} {self.task_id} in TF_CONFIG)"

    def distribution(self, devices):
        world = os.environ.get("WORLD_SIZE", "")
        if world.isdigit() and int(world) != self.count:
            raise RuntimeError(
                f"TF_CONFIG names {self.count} workers but WORLD_SIZE={world}. Start one "
                "process per worker in TF_CONFIG, each with the same cluster."
            )
        local = list_devices()
        if list(devices) != local:
            raise ValueError(
                f"{self.who()}: with several workers every worker trains on all of its "
                f"devices ({', '.join(map(str, local))}), but multi_gpu_model chose "
                f"{', '.join(map(str, devices))}. Pass gpus=None, or limit the devices each "
                "worker sees (CUDA_VISIBLE_DEVICES, KERAS_MULTIGPU_CPU_DEVICES)."
            )
        return Engine(devices, self.strategy)


def _global_seed():
    """TensorFlow's global seed (tf.data's shuffles draw their op seeds from it), chosen
    here where none is set: every worker's op seeds would differ."""
    seed = tf_context.context()._seed
    if seed is None:
        seed = random.SystemRandom().randrange(2**31)
        tf.random.set_seed(seed)
    return seed


def _set_global_seed(seed):
    if tf_context.context()._seed != seed:
        tf.random.set_seed(seed)


class _Store(processes.Store):
    """The coordination service's key-value store, which MultiWorkerMirroredStrategy runs."""

    def __init__(self, workers):
        self.rank, self.count = workers.index, workers.count
        self.generator = (_global_seed, _set_global_seed)

    def set(self, key, value):
        tf_context.context().set_config_key_value(key, value)

    def get(self, key, timeout):
        return tf_context.context().get_config_key_value(key, timeout_in_ms=int(timeout * 1000))

    def delete(self, key):
        tf_context.context().delete_config_key_value(key)

    def alone(self, function, *args, **kwargs):
        # In a thread of its own, outside the strategy's scope (thread-local): Keras's
        # saving creates variables (a throwaway optimizer), and a variable created in the
        # scope of a call (ModelCheckpoint, Checkpoint) is broadcast to every worker, which
        # waits for the others forever when only worker 0 saves.
        with concurrent.futures.ThreadPoolExecutor(1) as thread:
            return thread.submit(function, *args, **kwargs).result()


def _join(spec, task_type, task_id):
    """Starts TensorFlow as one of the workers of `spec`, and waits for the others.

    TensorFlow's coordination service registers every worker before the
    runtime starts; the strategy's own defaults would wait an hour for a
    missing one, so the registration is given KERAS_MULTIGPU_TIMEOUT.
    """
    timeout = _timeout()
    count = cpu_device_count()
    if count and not tf.config.list_physical_devices("GPU"):
        configure_cpu_devices(count)
    context = tf_context.context()
    jobs = [job for job in ("chief", "worker") if job in spec.jobs]
    context.configure_coordination_service(
        service_type="standalone",
        service_leader=multi_worker_util.coordination_leader(spec),
        coordinated_jobs=[
            tf_collective.coordination_config_pb2.CoordinatedJob(
                name=job, num_tasks=spec.num_tasks(job))
            for job in jobs
        ],
        cluster_register_timeout_in_ms=int(timeout * 1000),
    )
    # Without the barrier the first worker waits for the others without a deadline.
    context.coordination_service.cluster_register_with_barrier = True
    cpu = not tf.config.list_physical_devices("GPU")
    implementation = tf.distribute.experimental.CommunicationImplementation
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=implementation.RING if cpu else implementation.AUTO)
    local_devices = tf_collective.CollectiveAllReduceExtended._initialize_local_devices

    def every_cpu_device(self, resolver, worker_device):
        # TensorFlow takes one CPU device per worker, named by the worker alone (which the
        # engine's per-device placement cannot use); here, each of its logical ones, by name.
        found, kind = local_devices(self, resolver, worker_device)
        if kind == "CPU":
            found = tuple(f"{worker_device}/device:CPU:{i}" for i in range(count or 1))
        return found, kind

    tf_collective.CollectiveAllReduceExtended._initialize_local_devices = every_cpu_device
    try:
        strategy = _MultiWorker(communication_options=options)
    except tf.errors.OpError as error:
        workers = [f"{job} {i} ({address})" for job in jobs
                   for i, address in enumerate(spec.job_tasks(job))]
        raise RuntimeError(
            f"{task_type} {task_id} of the TF_CONFIG cluster [{', '.join(workers)}] could not "
            f"join the others within {TIMEOUT_ENV}={timeout:g} s: start every worker (one "
            "process per entry of TF_CONFIG's cluster, each with its own task index), with "
            "the same cluster, and check that their addresses can be reached. TensorFlow "
            f"said: {error.message.splitlines()[0] if error.message else error}"
        ) from error
    finally:
        tf_collective.CollectiveAllReduceExtended._initialize_local_devices = local_devices
    workers = _Workers(spec, task_type, task_id, strategy)
    processes.join(_Store(workers))
    return workers


def _start():
    """`(workers, late)`: the joined workers (None with one), or the error that stops
    `make_distribution` where TensorFlow started before this module could join them."""
    cluster = _cluster()
    if cluster is None:
        return None, None
    if tf_context.context()._context_handle is not None:
        return None, RuntimeError(
            f"TF_CONFIG names {_worker_count(cluster[0])} workers, but TensorFlow had already "
            "started when keras_multigpu was imported, and it joins other workers only as it "
            "starts. Import keras_multigpu before anything runs a TensorFlow operation."
        )
    return _join(*cluster), None


_workers, _late = _start()
