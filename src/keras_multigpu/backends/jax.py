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
is imported, before JAX starts (see `_join`), and the mesh holds every
device of every process (`jax.devices()`). The program stays the one above,
run by every process on the same data: each process computes the same
global batch (the same order, drawn from the same seeds) and places only
its own devices' rows of it (`_global`), and XLA's collectives (gloo between
CPU processes, NCCL between GPUs) do the rest. `batch_size` is still the
global batch, and the results are one device's. The process rules (process 0
alone writes files, every process takes its random state and stops at the same
step after a Ctrl-C) are `keras_multigpu.processes`', over `jax.distributed`'s
key-value store; and a process that fails leaves at once, so that the others
fail too instead of waiting (`_leave_at_once_on_failure`).
"""

import atexit
import collections
import contextlib
import functools
import json
import logging
import math
import os
import socket
import struct
import sys
import threading
import time
import warnings
import zlib

import jax
import keras
import numpy as np
from jax._src import distributed as jax_distributed
from jax._src import xla_bridge

from keras_multigpu import _xla, processes, rules
from keras_multigpu import devices as devices_lib
from keras_multigpu._keras.jax import distribution_lib as keras_jax_distribution
from keras_multigpu.backends._marker import tag, untag  # noqa: F401 (the seam's names)
from keras_multigpu.devices import Device

logger = logging.getLogger(__name__)

# What this engine does beyond the seam's common names (see `keras_multigpu.backends`).
CAPABILITIES = frozenset({"cpu_devices", "jit", "resident", "shard", "free_memory", "watch"})

# Seconds a process waits for the others to join (and a non-first process for
# the first one's save), as for the torch engine.
TIMEOUT_ENV = devices_lib.TIMEOUT_ENV


# -- several processes: joining -------------------------------------------------
#
# `jax.distributed.initialize` must run before JAX starts, and it cannot fail
# cleanly: a peer that never connects, or a coordinator that is not there,
# ends the process from inside XLA once twice its timeout has passed (a fatal
# "Terminating process because the JAX distributed service detected fatal
# errors ... DEADLINE_EXCEEDED ... RegisterTask" from xla/pjrt/distributed/
# client.h, then SIGABRT), naming neither the address nor the missing process.
# So the processes first meet on the coordinator's port over a plain socket:
# process 0 listens there until every other process has said hello
# (`_await_peers`, `_reach_coordinator`), and only then does everyone call
# `jax.distributed.initialize`, whose coordinator takes the port over. Every
# way the meeting can fail is a Python exception naming the address, the
# processes and the timeout.


def _world():
    """WORLD_SIZE as the launcher set it (1 when it is unset or not a count)."""
    raw = os.environ.get("WORLD_SIZE", "1").strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else 1


_timeout = devices_lib.collective_timeout


def _launch_variables(world):
    missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        raise ValueError(
            f"This program runs as {world} processes (WORLD_SIZE={world}), but "
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set. Start every "
            "process with `keras-multigpu launch` (or torchrun), or set RANK, MASTER_ADDR and "
            "MASTER_PORT in each as they do."
        )
    rank, port = os.environ["RANK"].strip(), os.environ["MASTER_PORT"].strip()
    if not (rank.isdigit() and int(rank) < world) or not (port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(
            f"RANK must be a process index below WORLD_SIZE={world} and MASTER_PORT a port "
            f"number. Received: RANK={rank!r}, MASTER_PORT={port!r}."
        )
    return int(rank), os.environ["MASTER_ADDR"].strip(), int(port)


_LENGTH = struct.Struct("!Q")
_HELLO = "keras_multigpu join"


def _send(connection, payload):
    connection.sendall(_LENGTH.pack(len(payload)) + payload)


def _read(connection, size, deadline):
    chunks = []
    while size:
        connection.settimeout(max(deadline - time.monotonic(), 0.001))
        chunk = connection.recv(min(size, 1 << 16))
        if not chunk:
            raise ConnectionError("the other side closed the connection")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _receive(connection, deadline):
    (size,) = _LENGTH.unpack(_read(connection, _LENGTH.size, deadline))
    if size > 1 << 24:
        raise ConnectionError("not a keras_multigpu process")
    return _read(connection, size, deadline)


def _listen(port):
    """Process 0's socket on the coordinator's port, on every interface (as JAX's own)."""
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
    return socket.create_server(("", port))


def _await_peers(port, world, timeout, payload):
    """Process 0: waits until the other `world - 1` processes say hello, then sends each
    `payload` and waits for it to hang up (the peer closes first, so that the port is
    free at once for JAX's coordinator)."""
    deadline = time.monotonic() + timeout
    try:
        server = _listen(port)
    except OSError as error:
        raise RuntimeError(
            f"Process 0 of {world} (the coordinator) cannot listen on MASTER_PORT={port}: "
            f"{error.strerror or error}. Another program holds it: pick another port."
        ) from error
    peers = {}
    try:
        with server:
            while len(peers) < world - 1:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(1, world)) - set(peers))
                    raise RuntimeError(
                        f"Process 0 of {world} (the coordinator, on port {port}) waited "
                        f"{timeout:g} s ({TIMEOUT_ENV}) for process(es) {missing} to join, and "
                        f"they never did ({len(peers) + 1} of {world} joined). Start every "
                        "process with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE "
                        f"(keras-multigpu launch does), or raise {TIMEOUT_ENV} if they start "
                        "slowly."
                    )
                server.settimeout(left)
                try:
                    connection, _ = server.accept()
                except TimeoutError:
                    continue
                try:
                    hello = json.loads(_receive(connection, min(deadline, time.monotonic() + 10)))
                    rank, their_world = int(hello["rank"]), int(hello["world"])
                    if hello["hello"] != _HELLO:
                        raise ValueError(hello)
                except (OSError, ValueError, KeyError, TypeError):
                    connection.close()  # not one of ours (a port scan, a stale process)
                    continue
                if their_world != world or rank in peers or not 0 < rank < world:
                    connection.close()
                    raise RuntimeError(
                        f"Process 0 of {world} was joined on port {port} by a process that "
                        f"says it is rank {rank} of {their_world}: "
                        + ("the world sizes differ. " if their_world != world else
                           "that rank has joined already. ")
                        + "Give every process the same WORLD_SIZE and a distinct RANK."
                    )
                peers[rank] = connection
            for connection in peers.values():
                _send(connection, payload)
            for connection in peers.values():
                with contextlib.suppress(OSError):
                    connection.settimeout(max(deadline - time.monotonic(), 1.0))
                    while connection.recv(1):
                        pass
    finally:
        for connection in peers.values():
            connection.close()


def _reach_coordinator(address, port, rank, world, timeout):
    """Another process: says hello to process 0 (retrying until it listens); returns its payload."""
    deadline = time.monotonic() + timeout
    hello = json.dumps({"hello": _HELLO, "rank": rank, "world": world}).encode()
    last = "nothing answered"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(
                f"Process {rank} of {world} could not join process 0 (the coordinator) at "
                f"{address}:{port} within {timeout:g} s ({TIMEOUT_ENV}): {last}. Start every "
                "process with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE "
                f"(keras-multigpu launch does), with process 0 among them, or raise "
                f"{TIMEOUT_ENV} if it starts slowly."
            )
        try:
            connection = socket.create_connection((address, port), timeout=min(left, 5.0))
        except OSError as error:
            last = error.strerror or str(error)
            time.sleep(min(0.2, max(left, 0.0)))
            continue
        with connection:
            try:
                _send(connection, hello)
                return _receive(connection, deadline)
            except OSError as error:  # ConnectionError and timeouts included
                last = str(error) or type(error).__name__
                time.sleep(min(0.2, max(deadline - time.monotonic(), 0.0)))


def _local_device_ids():
    """With several processes on one host (LOCAL_WORLD_SIZE > 1), each takes an equal share
    of its GPUs: JAX would give every one of them all. CPU devices are each process's own."""
    raw = os.environ.get("LOCAL_WORLD_SIZE", "1").strip()
    local_world = int(raw) if raw.isdigit() else 1
    if local_world <= 1:
        return None
    gpus = [d for d in devices_lib.list_devices() if d.kind == "gpu"]
    if not gpus:
        return None
    if len(gpus) % local_world:
        raise ValueError(
            f"This host runs {local_world} processes (LOCAL_WORLD_SIZE={local_world}) and has "
            f"{len(gpus)} GPUs, which do not divide equally among them. Start one process per "
            "host, or a number of processes that divides the GPU count."
        )
    share = len(gpus) // local_world
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return [d.id for d in gpus[local_rank * share:(local_rank + 1) * share]]


def _join():
    """Joins the other processes the launcher described (WORLD_SIZE > 1), once.

    Every process then starts from process 0's Python and NumPy random state, so
    that programs that seed nothing still build the same model and draw the same
    batch order everywhere (as the torch engine does). Does nothing with one
    process, or when `jax.distributed` was initialized already (by the user).
    """
    world = _world()
    if world == 1:
        return
    if jax.distributed.is_initialized():  # by an earlier call, or by the user
        _set_up_processes()
        return
    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            f"This program runs as {world} processes (WORLD_SIZE={world}), but JAX started "
            "before keras_multigpu could join them (jax.distributed must be initialized "
            "before JAX starts: building a model or calling jax.devices() starts it). "
            "Import keras_multigpu before anything calls into JAX."
        )
    rank, address, port = _launch_variables(world)
    timeout = _timeout()
    local_device_ids = _local_device_ids()
    if rank == 0:
        _await_peers(port, world, timeout, b"")
    else:
        _reach_coordinator(address, port, rank, world, timeout)
    coordinator = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
    if "JAX_ENABLE_PREEMPTION_SERVICE" not in os.environ:
        # JAX's preemption service catches SIGTERM (to checkpoint at a sync point, which
        # Keras never reaches): the launcher's SIGTERM must end the process, as it ends a
        # process on one host.
        jax.config.update("jax_enable_preemption_service", False)
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator, num_processes=world, process_id=rank,
            local_device_ids=local_device_ids, cluster_detection_method="deactivate",
            initialization_timeout=max(1, math.ceil(timeout)),
        )
    except Exception as error:  # noqa: BLE001 (XLA raises several kinds here)
        raise RuntimeError(
            f"Process {rank} of {world} met the others at {coordinator}, but could not start "
            f"jax.distributed there: {error}"
        ) from error
    logger.info("Process %d of %d joined the others at %s.", rank, world, coordinator)
    _set_up_processes()


class _Store(processes.Store):
    """`jax.distributed`'s key-value store (its coordination service)."""

    def __init__(self):
        state = jax_distributed.global_state  # not jax.process_index(): it would start JAX
        self.rank, self.count, self._client = state.process_id, state.num_processes, state.client

    def set(self, key, value):
        self._client.key_value_set(key, value)

    def get(self, key, timeout):
        return self._client.blocking_key_value_get(key, int(timeout * 1000))

    def delete(self, key):
        self._client.key_value_delete(key)


@functools.cache
def _set_up_processes():
    """What several processes need once joined: the process rules (saving, stopping
    and random state, see `keras_multigpu.processes`), and failing together."""
    processes.join(_Store())
    _leave_at_once_on_failure()


_failure = []  # the type of the exception this process is ending with, if any


def _leave_at_once_on_failure():
    """Makes a process that ends with an exception leave at once.

    At exit, JAX waits (up to 5 minutes) for every process to reach its shutdown
    barrier. A process that failed alone (a callback that only process 0 runs, a
    file only it lacks) would sit there while the others wait in the step's
    collectives for it: nothing would move for minutes. Leaving at once instead
    (after the traceback is printed) closes its connections, so the others' next
    collective fails at once too, and they leave the same way; the launcher then
    reports the first failure. Other `atexit` functions registered before the
    processes joined do not run after a failure.
    """
    previous = sys.excepthook

    def excepthook(kind, value, traceback):
        if not (hasattr(sys, "ps1") or sys.flags.interactive):  # a REPL goes on after one
            _failure.append(kind)
        previous(kind, value, traceback)

    sys.excepthook = excepthook
    atexit.register(_exit_if_failed)  # after JAX's own, so it runs before JAX's barrier


def _exit_if_failed():
    if not _failure:
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(130 if issubclass(_failure[0], KeyboardInterrupt) else 1)


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


def jit_compile(value):
    return value  # one program for the whole mesh: XLA as the model asks


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


# -- the watchdog ------------------------------------------------------------------
#
# A collective that never completes (XLA:CPU devices that deadlock, a process that hangs
# inside a step) blocks inside XLA, where no Python exception can reach it, and XLA's own
# CPU timeout is set past KERAS_MULTIGPU_TIMEOUT (`_xla`). So each step Keras dispatches is
# watched: when no step has finished for KERAS_MULTIGPU_TIMEOUT seconds while one is in
# flight, the process says which step waits and why, and exits (the launcher then stops
# the others). Compilation happens before a step is dispatched and does not count.


class _Watchdog:
    def __init__(self, timeout):
        self.timeout = timeout
        self.pending = collections.deque()  # (what, when dispatched, an output array)
        self.done = time.monotonic()
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="keras_multigpu-watchdog",
                                       daemon=True)
        self.thread.start()
        # Stopped before the interpreter finalizes: a daemon thread inside jaxlib then
        # would be unwound through C++ frames, which aborts the process.
        atexit.register(self.stop)

    def stop(self):
        self.stopped.set()
        self.thread.join(timeout=5)

    def dispatched(self, what, outputs):
        # The logs (or predictions), never the state, whose buffers the next step donates.
        logs = outputs[0] if isinstance(outputs, tuple) else outputs
        leaf = next((a for a in jax.tree.leaves(logs) if isinstance(a, jax.Array)), None)
        if leaf is not None:
            with self.lock:
                self.pending.append((what, time.monotonic(), leaf))

    @staticmethod
    def _ready(array):
        try:
            return array.is_ready()
        except Exception:  # noqa: BLE001 (a deleted array is done with)
            return True

    def _watch(self):
        while not self.stopped.wait(min(1.0, self.timeout / 10)):
            now = time.monotonic()
            with self.lock:
                while self.pending and self._ready(self.pending[0][2]):
                    self.pending.popleft()
                    self.done = now
                if not self.pending:
                    self.done = now
                    continue
                what, since, _ = self.pending[0]
                waited = now - max(since, self.done)
            if waited > self.timeout:
                _stuck(what, waited)


def _stuck(what, waited):
    devices = jax.devices()
    where = (f"the {jax.process_count()} processes" if jax.process_count() > 1
             else f"this process's {len(devices)} {devices[0].platform.upper()} devices")
    message = (
        f"keras_multigpu: {what} has waited {waited:.0f} s ({TIMEOUT_ENV}="
        f"{_timeout():g}) without finishing: a device waits in a collective across {where} "
        "for another that never joins it (a process that hangs, or XLA's CPU devices "
        "deadlocked). Nothing can end that wait from Python: exiting. Raise "
        f"{TIMEOUT_ENV} if one step is this slow for good reason.\n")
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os.write(2, message.encode())
    os._exit(1)


@functools.cache
def _watchdog():
    return _Watchdog(_timeout())


def watch(function, distribution, what):
    """`function` (one of Keras's compiled steps), its dispatches watched (see `_Watchdog`)
    where a collective can wait for ever: across processes, or across CPU devices."""
    devices = distribution.device_mesh.backend_mesh.devices.flat
    several = jax.process_count() > 1 or (
        distribution.device_mesh.backend_mesh.devices.size > 1
        and any(d.platform == "cpu" for d in devices))
    if not several or getattr(function, "_keras_multigpu_watched", False):
        return function

    @functools.wraps(function)
    def watched(*args, **kwargs):
        outputs = function(*args, **kwargs)
        _watchdog().dispatched(what, outputs)
        return outputs

    watched._keras_multigpu_watched = True
    return watched


def process_index():
    return jax.process_index()


def process_count():
    return jax.process_count()


# Several processes (hosts): join before anything starts JAX (see `_join`). Importing
# keras_multigpu under a launcher (LOCAL_RANK set) imports this module at once. Where
# JAX had started already, `list_devices` and `make_distribution` say so.
if _world() > 1 and not xla_bridge.backends_are_initialized():
    _join()
