"""The JAX engine across hosts: joining the processes a launcher describes.

`jax.distributed.initialize` must run before JAX starts, and it cannot fail cleanly
(see below); so the processes first meet over a plain socket, then initialize, then hand
`keras_multigpu.processes` the coordination service's key-value store. A process that
fails leaves at once (`_leave_at_once_on_failure`), so that the others fail too.
"""

import atexit
import contextlib
import functools
import json
import logging
import math
import os
import socket
import struct
import sys
import time

import jax
from jax._src import distributed as jax_distributed
from jax._src import xla_bridge

from keras_multigpu import devices as devices_lib
from keras_multigpu import processes

logger = logging.getLogger("keras_multigpu.backends.jax")

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
        # Keras never reaches): the launcher's SIGTERM must reach Python, as on one host
        # (interrupt.py: a stop at the next step boundary, where the processes agree).
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


def _leave_at_once_on_failure():
    """Makes a process that ends with an exception leave at once.

    At exit, JAX waits (up to 5 minutes) for every process to reach its shutdown
    barrier. A process that failed alone (a callback that only process 0 runs, a
    file only it lacks) would sit there while the others wait in the step's
    collectives for it: nothing would move for minutes. Leaving at once instead
    (after the traceback is printed) closes its connections, so the others' next
    collective fails at once too, and they leave the same way; the launcher then
    reports the first failure. Other `atexit` functions registered before the
    processes joined do not run after a failure (`processes.failure` records it).
    """
    atexit.register(_exit_if_failed)  # after JAX's own, so it runs before JAX's barrier


def _exit_if_failed():
    failure = processes.failure()
    if failure is None:
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(130 if issubclass(failure, KeyboardInterrupt) else 1)
