"""JAX engine: SPMD data parallelism through jax.sharding.

The batch is sharded along a one-axis device mesh and every variable is
replicated, so XLA compiles the step once for the whole mesh and inserts the
gradient all-reduce itself. Batch statistics (BatchNormalization, metrics)
are means over the global batch: the program is written as for one device.

A batch of n rows that does not divide over the R devices travels padded to
P = ceil(n / R) * R rows, with a marker whose *shape* is (R, n). Inside the
compiled step, `untag` slices the real n rows back out. That slice is a
static shape, so XLA's SPMD partitioner carries the uneven split through the
rest of the step itself, masking the padded tail of the last shard in every
reduction (means, BatchNormalization moments, losses, metrics, gradients).
The model's own step then runs on exactly the rows one device would see.

Several processes (`WORLD_SIZE` > 1, as `keras-multigpu launch` or torchrun
describe them: one per host with all its devices, or several per host that
share its GPUs equally): they join with `jax.distributed` when this module
is imported, before JAX starts (`_jax_hosts._join`), and the mesh holds every
device of every process (`jax.devices()`). The program stays the one above,
run by every process on the same data: each process computes the same
global batch (the same order, drawn from the same seeds) and places only
its own devices' rows of it (`_global`), and XLA's collectives (gloo between
CPU processes, NCCL between GPUs) do the rest. `batch_size` is still the
global batch, and the results are one device's. The process rules (process 0
alone writes files, every process takes its random state and stops at the same
step after a Ctrl-C) are `keras_multigpu.processes`', over `jax.distributed`'s
key-value store; and a process that fails leaves at once, so that the others
fail too instead of waiting (`_jax_hosts`). A step stuck in a collective ends
the process with a message (`_jax_watchdog`).
"""

import contextlib
import functools
import os
import warnings
import zlib

import jax
import keras
import numpy as np
from jax._src import xla_bridge

from keras_multigpu import _xla, processes, rules
from keras_multigpu._keras.jax import distribution_lib as keras_jax_distribution
from keras_multigpu.backends._jax_hosts import _join, _world
from keras_multigpu.backends._jax_watchdog import kept, put_back, watch  # noqa: F401 (seam)
from keras_multigpu.backends._marker import tag, untag  # noqa: F401 (the seam's names)
from keras_multigpu.devices import Device, framework_started_with

# What this engine does beyond the seam's common names (see `keras_multigpu.backends`).
CAPABILITIES = frozenset({"cpu_devices", "jit", "resident", "shard", "free_memory", "watch",
                          "kept", "multi_step", "whole_batch"})


# -- the engine -------------------------------------------------------------------

def configure_cpu_devices(count):
    """Asks XLA for `count` host (CPU) devices, if JAX has not started yet.

    XLA reads `XLA_FLAGS` once, when its first backend starts; after that the
    device count is fixed for the life of the process. With more than one
    device, XLA's CPU collective timeouts are raised too (where the installed
    jaxlib has them, and unless `XLA_FLAGS` sets them already), so that a
    starved device thread slows a step down instead of aborting the process.
    With several processes, `count` is this process's share.
    """
    if xla_bridge.backends_are_initialized():
        have = len(jax.local_devices(backend="cpu"))
        if have != count:
            framework_started_with(have)
            warnings.warn(
                f"JAX had already started with {have} CPU device(s), so "
                f"{count} could not be configured. Set "
                "KERAS_MULTIGPU_CPU_DEVICES (or import keras_multigpu) "
                "before anything calls into JAX.",
                stacklevel=3,
            )
        return have == count
    os.environ["XLA_FLAGS"] = _xla.virtual_device_flags(count, os.environ.get("XLA_FLAGS", ""))
    return True


def list_devices():
    """Every device of every process (one process: this machine's)."""
    _join()
    return [Device(d.id, d.platform, d.device_kind) for d in jax.devices()]


def _jax_device(device):
    for d in jax.devices():
        if d.id == device.id and d.platform == device.kind:
            return d
    raise ValueError(f"JAX has no device {device}. It has: {jax.devices()}.")


def make_distribution(devices):
    _join()
    chosen = [_jax_device(d) for d in devices]
    count = jax.process_count()
    if count > 1:
        # Every process runs the same program on its own devices: one without any
        # would have nothing to run it on.
        idle = sorted(set(range(count)) - {d.process_index for d in chosen})
        if idle:
            owned = {p: [d.id for d in jax.devices() if d.process_index == p]
                     for p in range(count)}
            raise ValueError(
                f"multi_gpu_model chose device(s) {[d.id for d in chosen]}, none of which "
                f"belongs to process(es) {idle} of the {count} this program runs as; each "
                "process needs at least one. Pass gpus=None for every device of every "
                f"process, or a list of ids that includes some of each (their devices: "
                f"{owned})."
            )
    # Every process feeds the whole global batch (`scope`): Keras must not split the
    # input among the processes itself.
    return keras.distribution.DataParallel(devices=chosen, auto_shard_dataset=False)


def _always():
    return True


@contextlib.contextmanager
def scope(distribution):
    """Keras's distribution scope: variables and batches are laid out on the mesh.

    With several processes, Keras's JAX trainer would take each batch for this
    process's part of the global batch (`jax.make_array_from_process_local_data`):
    here every process holds the whole global batch, so inside the scope it
    is placed as such (`_global`).
    """
    with distribution.scope():
        if jax.process_count() == 1:
            yield
            return
        with rules.installed((
            (keras_jax_distribution, "distribute_data_input", _distribute_data_input, _always),
            (keras_jax_distribution, "distribute_tensor", _distribute_tensor, _always),
        )):
            yield


def _distribute_data_input(_, original, per_process_batch, layout, batch_dim_name=None):
    """Keras's `distribute_data_input` (`original`) as a rule, with several processes:
    the value is the global batch, the same on every process."""
    if isinstance(layout, keras.distribution.TensorLayout):
        layout = layout.backend_layout
    if per_process_batch is None or not isinstance(layout, jax.sharding.Sharding):
        return original(per_process_batch, layout, batch_dim_name)  # (None: `*_on_batch`)
    return _global(per_process_batch, layout)


def _distribute_tensor(_, original, tensor, layout):
    """Keras's `distribute_tensor` (`original`) as a rule, with several processes: a
    value (a new variable's, an assignment's) is placed without a collective.

    Keras's own `jax.device_put` checks that the value is the same on every
    process, an all-gather that every process must join: a variable created by
    process 0 alone (Keras's saving builds a throwaway optimizer, and only
    process 0 saves) would wait in it for the others forever.
    """
    if isinstance(layout, keras.distribution.TensorLayout):
        layout = layout.backend_layout
    if isinstance(tensor, jax.core.Tracer) or not isinstance(layout, jax.sharding.Sharding):
        return original(tensor, layout)
    return _global(tensor, layout)


def _global(value, sharding):
    """`value`, the same on every process, as one array laid out by `sharding` across them.

    Each process copies only its own devices' parts of it: no data crosses between
    hosts, and nothing waits for the other processes. An array that spans the
    processes already is passed on (relaid out by XLA where its layout differs).
    """
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        if value.sharding == sharding or value.sharding.is_equivalent_to(sharding, value.ndim):
            return value
        if not value.is_fully_replicated:
            return jax.device_put(value, sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _fingerprint(host):
    return zlib.crc32(np.ascontiguousarray(host).view(np.uint8).tobytes())


def _replicated_across_processes(variables, target):
    """The variables' values replicated on `target`'s devices of every process, each
    process placing its own copies from its own host values; those must be the same on
    every process, which one all-gather of their checksums verifies."""
    values, checked = [], []
    for variable in variables:
        value = variable.value
        if (isinstance(value, jax.Array) and not value.is_fully_addressable
                and not value.is_fully_replicated):
            values.append(jax.device_put(value, target))  # laid out otherwise by a step
            continue
        host = np.asarray(value)
        values.append(jax.make_array_from_callback(host.shape, target,
                                                   lambda index, host=host: host[index]))
        checked.append((variable, _fingerprint(host)))
    if checked:
        mine = [f for _, f in checked]
        everyone = processes.all_gather_object(
            mine, "the start of a call, where every process checks that the weights are the same")
        differ = [variable.path for i, (variable, _) in enumerate(checked)
                  if any(other[i] != mine[i] for other in everyone)]
        if differ:
            raise RuntimeError(
                f"The model's variables differ between the {jax.process_count()} processes "
                f"({', '.join(differ[:5])}{' ...' if len(differ) > 5 else ''}): each would "
                "train another model. Every process must build the same model: seed them "
                "alike (keras.utils.set_random_seed(seed) before building it), and load the "
                "same weights on every process."
            )
    return values


def replicate(variables, distribution, optimizers=()):
    mesh = distribution.device_mesh.backend_mesh
    target = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    stale = []
    for variable in variables:
        value = variable.value
        # An uncommitted array (fresh from an assignment) counts as equivalent
        # on a one-device mesh, yet jit keys its cache on commitment: placing
        # it explicitly is what keeps the step compiled once. `==` is the
        # cheap test that a value the step returned passes.
        if value.committed and (value.sharding == target
                                or value.sharding.is_equivalent_to(target, np.ndim(value))):
            continue
        stale.append(variable)
    if not stale:
        return
    if jax.process_count() > 1:
        values = _replicated_across_processes(stale, target)
    else:
        # One transfer for all of them (metrics reset every epoch: several small
        # arrays), rather than one dispatch per variable.
        values = jax.device_put([v.value for v in stale], target)
    for variable, value in zip(stale, values):
        # A layout left by an earlier distribution would send the value back
        # to its old devices on assignment; this placement supersedes it.
        variable._layout = None
        variable.assign(value)


@functools.cache
def _gather(mesh):
    """One compiled gather per mesh, shared by every call and dataset.

    Building the `jax.jit` object anew for each `fit` would compile it anew
    for each `fit` too: jit caches compilations on the function object.
    """
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("batch"))
    return jax.jit(lambda tree, index: jax.tree.map(lambda a: a[index], tree),
                   out_shardings=split)


def _gather_may_deadlock(mesh):
    """Whether a gather program beside the step may deadlock XLA: on several CPU devices.

    Virtual CPU devices are threads of this process. With the gather of the next batch
    in flight beside the step, on a machine with fewer free cores than devices, one
    device waited in the step's all-reduce while the other never started its program: a
    2-device Conv2D/BatchNormalization fit froze in its 2nd or 3rd epoch, every time,
    under `taskset -c 0` (keras.distribution and the host path finish). XLA:CPU's cause,
    not this library's: there, batches come from the host.
    """
    return mesh.devices.size > 1 and any(d.platform == "cpu" for d in mesh.devices.flat)


def resident(arrays, distribution):
    """Places `arrays` (a tree) on every device once; returns `take(index)`.

    `take(index)` gathers those rows on the devices, already split along the
    batch axis as Keras places a batch, so a step's data never leaves the
    devices: no host slicing, no host-to-device copy (Keras's placement
    returns an array that already has its sharding unchanged).

    With several processes, declines (None): each batch is then placed from
    the host, each process copying only its own devices' rows of it, where a
    resident dataset would be copied whole to every device of every host. On
    several CPU devices, declines too (`_gather_may_deadlock`).
    """
    if jax.process_count() > 1:
        return None
    mesh = distribution.device_mesh.backend_mesh
    if _gather_may_deadlock(mesh):
        return None
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    placed = jax.device_put(arrays, replicated)
    gather = _gather(mesh)
    # The host index goes in as it is: jit places it beside `placed` within
    # the same dispatch (no recompilation: an uncommitted argument).
    return lambda index: gather(placed, index)


def shard(arrays, distribution):
    """Places a host batch (a tree) on the devices, split along the batch axis.

    The result has the sharding Keras gives a batch, so Keras passes it on
    unchanged. `device_put` returns at once; the copy proceeds while the
    caller goes on (the host path prefetches with it). With several
    processes, each copies only its own devices' rows (`_global`).
    """
    mesh = distribution.device_mesh.backend_mesh
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("batch"))
    if jax.process_count() > 1:
        return jax.tree.map(lambda a: _global(a, split), arrays)
    return jax.device_put(arrays, split)


def _host_available_bytes():
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def free_memory(devices):
    """Bytes free on each of `devices` (`Device` records), None where unknown.

    Accelerators report their allocator's limit less what is in use. CPU
    devices (virtual ones included) share the host's memory: each gets an
    equal part of what the host has available, since a dataset placed on
    all of them is copied once per device. Another process's devices count
    as this host's CPU devices do (only their own process can ask them).
    """
    found = {(d.platform, d.id): d for d in jax.devices()}
    free, cpus = [], 0
    for device in devices:
        found_device = found[(device.kind, device.id)]
        local = found_device.process_index == jax.process_index()
        stats = (found_device.memory_stats() if local else None) or {}
        if "bytes_limit" in stats:
            free.append(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
        else:
            free.append(None)
            cpus += 1
    if cpus:
        available = _host_available_bytes()
        share = None if available is None else available // cpus
        free = [share if f is None else f for f in free]
    return free


def _replicated_in_step(outputs):
    """Inside the step: `outputs` laid out whole on every device."""
    distribution = keras.distribution.distribution()
    if distribution is None:
        return outputs
    target = jax.sharding.NamedSharding(distribution.device_mesh.backend_mesh,
                                        jax.sharding.PartitionSpec())
    return jax.tree.map(
        lambda a: jax.lax.with_sharding_constraint(a, target) if isinstance(a, jax.Array) else a,
        outputs)


def run_step(step, data, rows_out=False):
    """Runs `step` (the model's own) on the real rows of `data`, once for the whole mesh.

    Its outputs cover every row already (`rows_out` needs nothing here). With
    several processes, what the step hands back to the host (logs,
    predictions; not the state, which keeps its layout) is made whole on
    every device: Keras reads it with NumPy, and a process can read an array
    that spans other processes' devices only when it holds all of it.
    """
    result = step(untag(data))
    if jax.process_count() == 1:
        return result
    if isinstance(result, tuple) and len(result) == 2:  # (logs or outputs, state)
        return _replicated_in_step(result[0]), result[1]
    return _replicated_in_step(result)


def process_index():
    return jax.process_index()


def process_count():
    return jax.process_count()


# Several processes (hosts): join before anything starts JAX (see `_join`). Importing
# keras_multigpu under a launcher (LOCAL_RANK set) imports this module at once. Where
# JAX had started already, `list_devices` and `make_distribution` say so.
if _world() > 1 and not xla_bridge.backends_are_initialized():
    _join()
