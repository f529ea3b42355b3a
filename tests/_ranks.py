"""Runs a function in N forked processes joined by gloo, as `keras-multigpu launch -n N` would.

Each child gets torchrun's variables and a fresh port, runs the function
(which makes its own assertions), and reports its traceback, if any, through
a pipe. When one fails, the others are killed after a short grace (they
would otherwise wait in a collective for it), and the first failure is
raised in the parent, naming the rank.
"""

import os
import signal
import socket
import time
import traceback

import pytest

GRACE_SECONDS = 5
SKIPPED = 3  # a child's exit status when the test skipped itself
TIMEOUT_SECONDS = 600


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank, world, port, function, writer):
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
        "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
        "KERAS_MULTIGPU_TIMEOUT": "120",
    })
    import torch

    torch.set_num_threads(1)  # forked: OpenMP's pool belongs to the parent
    status, report = 0, b""
    try:
        function()
    except pytest.skip.Exception as skip:
        status, report = SKIPPED, str(skip).encode()
    except BaseException:  # noqa: BLE001 (everything is reported to the parent)
        status, report = 1, traceback.format_exc().encode()
    if status != 1:  # as a process that ends without an exception leaves (rank 0 last)
        from keras_multigpu import processes

        processes.leave()
    try:
        os.write(writer, report[-20000:])
    finally:
        os.close(writer)
        os._exit(status)  # no pytest teardown (nor atexit) in the child


def run(world, function):
    port = _free_port()
    children = []
    for rank in range(world):
        reader, writer = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(reader)
            _child(rank, world, port, function, writer)
        os.close(writer)
        children.append((rank, pid, reader))
    skipped = None
    failures, pending = [], {pid: (rank, reader) for rank, pid, reader in children}
    deadline = time.monotonic() + TIMEOUT_SECONDS
    while pending:
        for pid in list(pending):
            done, status = os.waitpid(pid, os.WNOHANG)
            if not done:
                continue
            rank, reader = pending.pop(pid)
            chunks = []
            while chunk := os.read(reader, 65536):
                chunks.append(chunk)
            os.close(reader)
            if os.WIFEXITED(status) and os.WEXITSTATUS(status) == SKIPPED:
                skipped = b"".join(chunks).decode(errors="replace")
            elif status:
                failures.append((rank, b"".join(chunks).decode(errors="replace")
                                 or f"exit status {status}"))
        if failures and pending:
            time.sleep(GRACE_SECONDS)
            for pid in pending:
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            for pid in pending:
                os.kill(pid, signal.SIGKILL)
            failures.append((-1, f"ranks still running after {TIMEOUT_SECONDS} s: killed"))
        time.sleep(0.05)
    if failures:
        rank, report = failures[0]
        pytest.fail(f"rank {rank} of {world} failed:\n{report}", pytrace=False)
    if skipped is not None:
        pytest.skip(skipped)
