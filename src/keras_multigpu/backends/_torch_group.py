"""The torch engine's process group: joining it, its store, and its collectives.

Every collective goes through `_collective`, whose error names what waited and why (a
peer that hung past KERAS_MULTIGPU_TIMEOUT, or one that stopped). The process rules are
`keras_multigpu.processes`', over the store the group was made with.
"""

import atexit
import contextlib
import datetime
import os

import torch
import torch.distributed as dist

from keras_multigpu import devices as devices_lib
from keras_multigpu import processes

TIMEOUT_ENV = devices_lib.TIMEOUT_ENV
_timeout = devices_lib.collective_timeout


def _join(generator):
    """Joins the process group the launcher (or torchrun) described, once."""
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = datetime.timedelta(seconds=_timeout())
    try:
        dist.init_process_group(backend, timeout=timeout)
    except Exception as error:  # noqa: BLE001 (torch raises several kinds here)
        raise RuntimeError(
            f"Rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} could not join the "
            f"others at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}: {error}. "
            "Start every process with `keras-multigpu launch` (or torchrun), with the same "
            "MASTER_ADDR and MASTER_PORT."
        ) from error
    # The process rules: rank 0 writes, every rank draws what rank 0 draws (shuffling,
    # Keras's default seeds, dropout), and all stop at the same step after a Ctrl-C.
    processes.join(_Store(generator))
    atexit.register(_leave)


class _Store(processes.Store):
    """The key-value store the process group was made with (the launcher's TCPStore)."""

    def __init__(self, generator):
        self.rank, self.count = dist.get_rank(), dist.get_world_size()
        self.generator = generator  # torch's own: `(state, set_state)`
        self._store = dist.distributed_c10d._get_default_store()

    def set(self, key, value):
        self._store.set(key, value)

    def get(self, key, timeout):
        self._store.wait([key], datetime.timedelta(seconds=timeout))
        return self._store.get(key).decode()

    def delete(self, key):
        self._store.delete_key(key)


def _leave():
    """Leaves the process group at exit (NCCL warns when it is left to the destructor),
    rank 0 last (`processes.leave`: the group's store is rank 0's)."""
    processes.leave()
    with contextlib.suppress(Exception):
        if dist.is_initialized():
            dist.destroy_process_group()


def _device():
    """Where tensors for a collective must be: the current GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# -- collectives ----------------------------------------------------------


CollectiveError = processes.CollectiveError  # every engine's, `keras_multigpu.CollectiveError`


def _collective(what, function, *args, **kwargs):
    try:
        return function(*args, **kwargs)
    except RuntimeError as error:
        text = str(error)
        hung = "timed out" in text.lower() or "timeout" in text.lower()
        cause = (f"another process did not join it within {TIMEOUT_ENV}={_timeout():g} s "
                 "(it hangs, or is far behind)" if hung else
                 "another process has stopped (see its own error)")
        raise CollectiveError(
            f"Rank {dist.get_rank()} of {dist.get_world_size()}: the {what} across processes "
            f"failed: {cause}. torch.distributed said: {text.splitlines()[0] if text else ''}"
        ) from error


def _flat_all_reduce(tensors, what, op=None):
    """Sums `tensors` (a list) across processes, one flat buffer per dtype and device."""
    op = dist.ReduceOp.SUM if op is None else op
    groups = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(i)
    out = list(tensors)
    for indices in groups.values():
        parts = [tensors[i] for i in indices]
        flat = torch.cat([p.reshape(-1) for p in parts])
        _collective(what, dist.all_reduce, flat, op=op)
        offset = 0
        for i, p in zip(indices, parts):
            out[i] = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
    return out


def _broadcast(variables):
    values = [v.value.detach() for v in variables]
    if not values:
        return
    groups = {}
    for i, t in enumerate(values):
        groups.setdefault((t.dtype, t.device), []).append(i)
    for indices in groups.values():
        flat = torch.cat([values[i].reshape(-1) for i in indices])
        _collective("broadcast of the weights from rank 0", dist.broadcast, flat, src=0)
        offset = 0
        for i in indices:
            size = values[i].numel()
            variables[i].assign(flat[offset:offset + size].view_as(values[i]))
            offset += size
