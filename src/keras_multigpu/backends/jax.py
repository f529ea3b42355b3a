"""JAX engine: SPMD data parallelism through jax.sharding.

The batch is sharded along a one-axis device mesh and every variable is
replicated, so XLA compiles the step once for the whole mesh and inserts the
gradient all-reduce itself. Batch statistics (BatchNormalization, metrics)
are means over the global batch: the program is written as for one device.
"""

import logging
import os
import warnings

import jax
import keras
import numpy as np
from jax._src import xla_bridge

from keras_multigpu.devices import Device

logger = logging.getLogger(__name__)

_CPU_FLAG = "--xla_force_host_platform_device_count"


def configure_cpu_devices(count):
    """Asks XLA for `count` host (CPU) devices, if JAX has not started yet.

    XLA reads `XLA_FLAGS` once, when its first backend starts; after that the
    device count is fixed for the life of the process.
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
    flags = [
        f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_CPU_FLAG)
    ]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"{_CPU_FLAG}={count}"])
    return True


def list_devices():
    return [Device(d.id, d.platform, d.device_kind) for d in jax.devices()]


def _jax_device(device):
    for d in jax.devices():
        if d.id == device.id and d.platform == device.kind:
            return d
    raise ValueError(f"JAX has no device {device}. It has: {jax.devices()}.")


def make_distribution(devices):
    return keras.distribution.DataParallel(devices=[_jax_device(d) for d in devices])


def replicate(variables, distribution):
    mesh = distribution.device_mesh.backend_mesh
    target = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    for variable in variables:
        value = variable.value
        # An uncommitted array (fresh from an assignment) counts as equivalent
        # on a one-device mesh, yet jit keys its cache on commitment: placing
        # it explicitly is what keeps the step compiled once.
        if value.committed and value.sharding.is_equivalent_to(target, np.ndim(value)):
            continue
        # A layout left by an earlier distribution would send the value back
        # to its old devices on assignment; this placement supersedes it.
        variable._layout = None
        variable.assign(jax.device_put(value, target))


def resident(arrays, distribution):
    """Places `arrays` (a tree) on every device once; returns `take(index)`.

    `take(index)` gathers those rows on the devices, already split along the
    batch axis as Keras places a batch, so a step's data never leaves the
    devices: no host slicing, no host-to-device copy (Keras's placement
    returns an array that already has its sharding unchanged).
    """
    mesh = distribution.device_mesh.backend_mesh
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("batch"))
    placed = jax.device_put(arrays, replicated)
    gather = jax.jit(lambda tree, index: jax.tree.map(lambda a: a[index], tree),
                     out_shardings=split)
    return lambda index: gather(placed, jax.device_put(index, replicated))


def process_index():
    return jax.process_index()


def process_count():
    return jax.process_count()
