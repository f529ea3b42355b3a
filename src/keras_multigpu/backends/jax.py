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
"""

import functools
import logging
import os
import warnings

import jax
import keras
import numpy as np
from jax._src import xla_bridge

from keras_multigpu import _xla
from keras_multigpu import devices as devices_lib
from keras_multigpu.backends._marker import tag, untag  # noqa: F401 (the seam's names)
from keras_multigpu.devices import Device

logger = logging.getLogger(__name__)

def configure_cpu_devices(count):
    """Asks XLA for `count` host (CPU) devices, if JAX has not started yet.

    XLA reads `XLA_FLAGS` once, when its first backend starts; after that the
    device count is fixed for the life of the process. With more than one
    device, XLA's CPU collective timeouts are raised too (where the installed
    jaxlib has them, and unless `XLA_FLAGS` sets them already), so that a
    starved device thread slows a step down instead of aborting the process.
    """
    if xla_bridge.backends_are_initialized():
        have = len(jax.devices("cpu"))
        if have != count:
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
    return [Device(d.id, d.platform, d.device_kind) for d in jax.devices()]


def _jax_device(device):
    for d in jax.devices():
        if d.id == device.id and d.platform == device.kind:
            return d
    raise ValueError(f"JAX has no device {device}. It has: {jax.devices()}.")


def make_distribution(devices):
    devices_lib.refuse_several_processes("JAX")
    return keras.distribution.DataParallel(devices=[_jax_device(d) for d in devices])


def check_model(model):
    """Any Keras model can be distributed here."""


def scope(distribution):
    """Keras's distribution scope: variables and batches are laid out on the mesh."""
    return distribution.scope()


def jit_compile(value):
    return value  # one program for the whole mesh: XLA as the model asks


def replicate(variables, distribution, optimizer=None):
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
    # One transfer for all of them (metrics reset every epoch: several small
    # arrays), rather than one dispatch per variable.
    for variable, value in zip(stale, jax.device_put([v.value for v in stale], target)):
        # A layout left by an earlier distribution would send the value back
        # to its old devices on assignment; this placement supersedes it.
        variable._layout = None
        variable.assign(value)


def release(variables, distribution, optimizer=None, failed=False):
    """Nothing to undo: replicated arrays serve the model on one device too."""


@functools.cache
def _gather(mesh):
    """One compiled gather per mesh, shared by every call and dataset.

    Building the `jax.jit` object anew for each `fit` would compile it anew
    for each `fit` too: jit caches compilations on the function object.
    """
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("batch"))
    return jax.jit(lambda tree, index: jax.tree.map(lambda a: a[index], tree),
                   out_shardings=split)


def resident(arrays, distribution):
    """Places `arrays` (a tree) on every device once; returns `take(index)`.

    `take(index)` gathers those rows on the devices, already split along the
    batch axis as Keras places a batch, so a step's data never leaves the
    devices: no host slicing, no host-to-device copy (Keras's placement
    returns an array that already has its sharding unchanged).
    """
    mesh = distribution.device_mesh.backend_mesh
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    placed = jax.device_put(arrays, replicated)
    gather = _gather(mesh)
    # The host index goes in as it is: jit places it beside `placed` within
    # the same dispatch (no recompilation: an uncommitted argument).
    return lambda index: gather(placed, index)


def array_order(num_samples, batch_size, shuffle):
    """Keras's JAX trainer shuffles arrays with NumPy's generator."""
    return None


def shard(arrays, distribution):
    """Places a host batch (a tree) on the devices, split along the batch axis.

    The result has the sharding Keras gives a batch, so Keras passes it on
    unchanged. `device_put` returns at once; the copy proceeds while the
    caller goes on (the host path prefetches with it).
    """
    mesh = distribution.device_mesh.backend_mesh
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("batch"))
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
    all of them is copied once per device.
    """
    found = {(d.platform, d.id): d for d in jax.devices()}
    free, cpus = [], 0
    for device in devices:
        stats = found[(device.kind, device.id)].memory_stats() or {}
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


def run_step(step, data, rows_out=False):
    """Runs `step` (the model's own) on the real rows of `data`, once for the whole mesh.

    Its outputs cover every row already (`rows_out` needs nothing here)."""
    return step(untag(data))


def batch_spec(iterator):
    """Not used: Keras's JAX trainer reads its build batch itself (`_symbolic_build`)."""
    return None


def process_index():
    return jax.process_index()


def process_count():
    return jax.process_count()
