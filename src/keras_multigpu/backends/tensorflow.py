"""TensorFlow engine: replica functions through tf.distribute.MirroredStrategy.

Each replica runs the model's own step on its part of the global batch, and
the strategy all-reduces (NCCL on GPUs; on CPU devices, through one device).
A replica sees only its rows, so exactness cannot come from a global view.
It comes from `keras_multigpu.rules`, installed for the length of a call with the
replica context's all-reduce (the torch engine keeps the same rules):

    one device's value = sum over replicas r of (k_r / n) * value_r

where k_r is replica r's real rows and n the global batch's. Here, beside them:

- gradients are weighed (`rules.weigh_gradient`, kept sparse where they are) and all-reduced once,
  before the optimizer clips, accumulates or applies them (Keras's own sum is then
  skipped), so a custom `train_step` with its own mean loss is exact;
- Keras's 1/R loss scaling is off (the weights replace it);
- each replica keeps its own `add_loss` values (Keras keeps them in a list on the layer,
  which every replica's thread shares).

A padded batch travels with a marker row per row, and each replica keeps
its own contiguous run of the real rows (`_tf_batches`: `tag`, `untag`).

The user's model is built outside any strategy. For the length of each
call its variables are swapped for mirrored ones (same values, same
`keras.Variable` objects), and swapped back, holding the trained values,
when it ends: the trained model is the user's own, and trains, saves, loads
and predicts on its own as any Keras model.

One device, the one TensorFlow places ops on anyway (the first GPU, else the CPU), runs
without a strategy, as plain Keras does: any strategy, OneDeviceStrategy too, halves `fit`
there (benchmarks/tf_one_device.py), and one replica needs no collective.

Several workers (`TF_CONFIG` naming more than one, one process per host):
the strategy is a `MultiWorkerMirroredStrategy` over this worker's devices,
joined when the package is imported (TensorFlow fixes its collectives when
its runtime starts) or given a clear error after KERAS_MULTIGPU_TIMEOUT
seconds. Replica indexes and counts are global (worker-major), and every
worker's devices get only their own contiguous runs of each global batch
(`_tf_workers._MultiWorker`), so the rules above (`_tf_rules`) hold
unchanged. The process rules are `keras_multigpu.processes`', over the
coordination service's key-value store.
"""

import contextlib
import functools
import warnings

import keras
import tensorflow as tf
from keras import tree

from keras_multigpu import rules
from keras_multigpu.backends import _tf_grads, _tf_rules, _tf_workers, _tf_xla
from keras_multigpu.backends._tf_batches import _counts, _replica_id, _tagged, _unwrap
from keras_multigpu.backends._tf_batches import tag as tag  # the seam's (backends.API)
from keras_multigpu.backends._tf_batches import untag as untag
from keras_multigpu.backends._tf_variables import _is_default
from keras_multigpu.backends._tf_variables import copies as copies  # the seam's (variables)
from keras_multigpu.backends._tf_variables import recompiled as recompiled
from keras_multigpu.backends._tf_variables import release as release
from keras_multigpu.backends._tf_variables import replicate as replicate
from keras_multigpu.devices import (
    CPU_DEVICES_ENV,
    Device,
    cpu_device_count,
    framework_started_with,
    refuse_several_processes,
)

# What this engine does beyond the seam's common names (see `keras_multigpu.backends`).
CAPABILITIES = frozenset({"cpu_devices", "check_model", "release", "batch_spec", "recompile",
                          "text", "xla_draws", "copies", "collective_errors",
                          "lone_multi_step"})


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
            framework_started_with(have)
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
        if strategy is None and _framework_default(self.devices):
            strategy = tf.distribute.get_strategy()  # no strategy (see the module's doc)
        self.strategy = strategy or _strategy(tuple(f"/device:{d.kind.upper()}:{d.id}"
                                                    for d in devices))
        self.num_replicas = self.strategy.num_replicas_in_sync

    def scope(self):
        return scope(self)


def _framework_default(devices):
    """Whether `devices` is the one device TensorFlow places ops on by default: the first
    GPU, or the CPU where there is no GPU."""
    if len(devices) != 1 or devices[0].id != 0:
        return False
    gpus = tf.config.list_logical_devices("GPU")
    return devices[0].kind == ("gpu" if gpus else "cpu")


def steps_per_execution(distribution, wanted):
    """The steps per execution for a model whose own is `wanted`: as asked without a
    strategy (plain Keras's path); else 1, for Keras's multi-step loop fails under
    tf.distribute (keras-team/keras#19246)."""
    return wanted if _is_default(distribution.strategy) else 1


def jit_compile(distribution, wanted):
    """The `jit_compile` the steps take for a model whose own is `wanted` (one device's
    choice): as asked without a strategy (plain Keras's path), else none, with the draws
    inside them made by XLA where `wanted` (`_tf_xla`)."""
    if _is_default(distribution.strategy):
        return wanted
    distribution.xla_draws = bool(wanted)
    return False


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
    _workers.check(devices, list_devices())
    return Engine(devices, _workers.strategy)


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
    with distribution.strategy.scope(), _tf_rules.installed(_workers), _tf_xla.drawing(
            distribution):
        yield


def run_step(step, data, rows_out=False):
    """Runs `step` (the model's own) on this replica's real rows, under the rules above.

    With `rows_out` (predict), Keras concatenates the replicas' rows itself."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1 and not _tagged(_unwrap(data)):
        return step(untag(data))
    replica = _tf_rules._replica
    previous = getattr(replica, "state", None), getattr(replica, "losses", None)
    replica.state = rules.Replica(*_counts(data), replicas=context.num_replicas_in_sync,
                                  all_reduce=_tf_rules.all_reduce, index=_replica_id(),
                                  traced=True, summed=_tf_grads.summed,
                                  sums=_tf_grads.sums_rows)
    replica.losses = {}  # this replica's `add_loss` values (see `_tf_rules._add_loss`)
    try:
        result = step(_dynamic_rows(untag(data)))
        return result if rows_out else _tf_grads.own_logs(replica.state, result)
    finally:
        replica.state, replica.losses = previous


def _dynamic_rows(data):
    """`data` with its first dimension unknown to the trace, as the rules take a traced
    step's rows to be (`rules.Replica.traced`): a draw shaped by the batch is then told from
    a draw of a fixed shape. A trace made on a concrete batch knows it (the next Keras's
    trainer traces the first step so): then RandomFlip's draw of 10 rows, on a replica of
    10 rows, was taken for a fixed one, and each replica drew what the first rows draw."""
    def relax(a):
        if not isinstance(a, tf.Tensor) or a.shape.rank in (None, 0) or a.shape[0] is None:
            return a
        return tf.compat.v1.placeholder_with_default(a, [None, *a.shape[1:]])

    return tree.map_structure(relax, data)


def batch_spec(iterator):
    """The structure of a distributed batch as KerasTensors, read from its dataset's spec.

    Not from an iterator: making one draws a new order from a dataset that reshuffles each
    epoch (`shuffle(n, seed=s)`), so every epoch would take the next one's."""
    spec = iterator._get_iterator().element_spec  # Keras's tf.distribute dataset

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


def collective_error(error):
    return None if _workers is None else _tf_workers.collective_error(_workers, error)


_workers, _late = _tf_workers.start(configure_cpu_devices)
