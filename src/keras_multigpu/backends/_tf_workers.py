"""The TensorFlow engine on several workers (TF_CONFIG naming more than one).

Every worker joins the others as TensorFlow's runtime starts (when the package is
imported), through a `MultiWorkerMirroredStrategy` whose dataset split gives each replica
its contiguous run of the global batch, and hands `keras_multigpu.processes` the
coordination service's key-value store.
"""

import atexit
import concurrent.futures
import json
import os
import random
import re

import tensorflow as tf
from tensorflow.python.distribute import collective_all_reduce_strategy as tf_collective
from tensorflow.python.distribute import multi_worker_util
from tensorflow.python.distribute.cluster_resolver import tfconfig_cluster_resolver
from tensorflow.python.eager import context as tf_context

from keras_multigpu import processes
from keras_multigpu.devices import TIMEOUT_ENV, collective_timeout, cpu_device_count

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
    contiguous runs that `_tf_batches.tag` deals and `_counts` assumes, as one worker's
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

    def check(self, devices, local):
        """Refuses a choice of `devices` other than all of this worker's (`local`)."""
        world = os.environ.get("WORLD_SIZE", "")
        if world.isdigit() and int(world) != self.count:
            raise RuntimeError(
                f"TF_CONFIG names {self.count} workers but WORLD_SIZE={world}. Start one "
                "process per worker in TF_CONFIG, each with the same cluster."
            )
        if list(devices) != local:
            raise ValueError(
                f"{self.who()}: with several workers every worker trains on all of its "
                f"devices ({', '.join(map(str, local))}), but multi_gpu_model chose "
                f"{', '.join(map(str, devices))}. Pass gpus=None, or limit the devices each "
                "worker sees (CUDA_VISIBLE_DEVICES, KERAS_MULTIGPU_CPU_DEVICES)."
            )


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


def _join(spec, task_type, task_id, configure_cpu_devices):
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
    # The timeout ends a collective that waits for a worker which hangs (its heartbeats go
    # on, so the coordination service sees nothing wrong); without it the others waited for
    # ever. The next step boundary's stop agreement (`processes`) then names the worker.
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=implementation.RING if cpu else implementation.AUTO,
        timeout_seconds=timeout)
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
    # Worker 0 runs the coordination service, whose store the others may still read at
    # exit (the outcome of the last save): it leaves last.
    atexit.register(processes.leave)
    return workers


# The remote task in TensorFlow's error from a collective whose peer has stopped.
_REMOTE = re.compile(r"/job:(chief|worker)(?:/replica:\d+)?/task:(\d+)")
# Its own words for what happened, among the graph's lines around them.
_SAID = re.compile(r"Collective ops is aborted by: [^\n]*|Collective has timed out[^\n]*")


def collective_error(workers, error):
    """The `processes.CollectiveError` that says what TensorFlow's `error` from a step's
    collective means (a peer that stopped, or one that did not join within the
    timeout), or None for any other error.

    A worker that dies while the others are in a step's all-reduce leaves them TensorFlow's
    own error from deep inside the step ("Socket closed" from a remote task); one that hangs
    there, its collective's timeout. The stop agreement at the step boundaries names them
    only when the peer stops between steps.
    """
    text = str(error)
    if not isinstance(error, (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
                              tf.errors.AbortedError, tf.errors.CancelledError)) \
            or "collective" not in text.lower():
        return None
    me = f"Process {workers.index} of {workers.count}"
    said = _SAID.search(text)
    said = said[0].strip() if said else text.strip().splitlines()[-1]
    if isinstance(error, tf.errors.DeadlineExceededError):
        return processes.CollectiveError(
            f"{me} waited {_timeout():g} s ({TIMEOUT_ENV}) for the others in a step's "
            "all-reduce, and they did not join it: one hangs, is far behind, or has stopped "
            "(see its own output). Every process must run the same program; raise "
            f"{TIMEOUT_ENV} if one is slow for good reason. TensorFlow said: {said}")
    who = "another process"
    for remote in _REMOTE.finditer(text):
        peer = multi_worker_util.id_in_cluster(workers.spec, remote[1], int(remote[2]))
        if peer != workers.index:
            who = f"process {peer} ({remote[1]} {remote[2]} in TF_CONFIG)"
            break
    return processes.CollectiveError(
        f"{me}: a step's all-reduce across the processes failed: {who} has stopped "
        f"(see its own output). TensorFlow said: {said}")


def start(configure_cpu_devices):
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
    return _join(*cluster, configure_cpu_devices), None
