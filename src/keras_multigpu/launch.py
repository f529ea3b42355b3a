"""`keras-multigpu launch -n N script.py args...`: one process per device, as torchrun starts them.

Each process gets torchrun's variables (`MASTER_ADDR`, `MASTER_PORT`, `RANK`,
`WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`), so a script written for
torchrun runs unchanged, and the torch engine joins the others through them.
The launcher:

- prefixes every line a process prints with its rank (`quiet_ranks`: only
  rank 0's lines are shown; the others' are kept for error reports);
- forwards Ctrl-C (SIGINT) and SIGTERM to every process; a second Ctrl-C
  kills them;
- when a process fails, stops the others (SIGTERM, then SIGKILL after
  `grace` seconds) and exits non-zero, naming the rank and its last lines.

Processes die with the launcher too (Linux's parent-death signal), so none
is left behind.
"""

import collections
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time

TAIL_LINES = 15
GRACE_SECONDS = 10.0


class LaunchError(Exception):
    """A launch that cannot start: a bad script, port or count."""


def free_port(address="127.0.0.1"):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def check_port(address, port):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((address, port))
        except OSError as error:
            raise LaunchError(
                f"--master-port {port} on {address} cannot be used ({error.strerror}): another "
                "program holds it. Pass another port, or leave --master-port out to pick a "
                "free one."
            ) from error


def _prepare_child():  # runs in the child, before the script
    # The launcher forwards Ctrl-C itself: a process must not inherit SIGINT ignored (as a
    # launcher started in the background, `cmd &`, has it).
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _signal_name(code):
    with contextlib.suppress(ValueError):
        return signal.Signals(-code).name
    return f"signal {-code}"


def _describe_exit(code):
    return f"was killed by {_signal_name(code)}" if code < 0 else f"exited with status {code}"


def child_env(rank, world, address, port, timeout=None, base=None):
    """The environment of process `rank`: torchrun's variables on top of `base`."""
    env = dict(os.environ if base is None else base)
    env.update({
        "MASTER_ADDR": address, "MASTER_PORT": str(port),
        "RANK": str(rank), "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
        "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world),
        "PYTHONUNBUFFERED": "1",
    })
    if world > 1 and "OMP_NUM_THREADS" not in env:
        # The processes share the cores (torchrun sets 1; a share uses them all).
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world))
    if timeout is not None:
        env["KERAS_MULTIGPU_TIMEOUT"] = f"{timeout:g}"
    return env


class _Rank:
    def __init__(self, rank, process, show):
        self.rank = rank
        self.process = process
        self.show = show
        self.tail = collections.deque(maxlen=TAIL_LINES)
        self.readers = []
        self.ended_at = None


def _pump(rank, stream, out, lock):
    prefix = f"[rank {rank.rank}] "
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        rank.tail.append(line)
        if rank.show:
            with lock:
                out.write(prefix + line + "\n")
                out.flush()
    stream.close()


def launch(nproc, command, *, address="127.0.0.1", port=None, quiet_ranks=False,
           timeout=None, grace=GRACE_SECONDS, base_env=None, out=None, err=None):
    """Runs `command` (`[script, args...]` or `["-m", module, args...]`) as `nproc` processes.

    Returns:
        The exit status: 0 when every process succeeded; the failed
        process's status (128 + the signal when killed) after a failure;
        130 after a Ctrl-C.
    """
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise LaunchError(f"-n must be a positive number of processes. Received: -n {nproc!r}.")
    if not command:
        raise LaunchError("No script to launch. Usage: keras-multigpu launch -n N script.py "
                          "[args...] (or -m module [args...]).")
    if command[0] == "-m":
        if len(command) < 2:
            raise LaunchError("-m needs a module name, e.g. `keras-multigpu launch -n 2 -m "
                              "package.train`.")
    elif not os.path.isfile(command[0]):
        raise LaunchError(
            f"No such script: {command[0]!r} (from {os.getcwd()}). Pass the path of a Python "
            "file, or -m and a module name."
        )
    if port is None:
        port = free_port(address)
    else:
        check_port(address, port)

    lock = threading.Lock()
    ranks = []
    interrupted = []

    def send(sig):
        for rank in ranks:
            if rank.process.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(rank.process.pid, sig)

    def on_signal(signum, frame):
        interrupted.append(signum)
        if len(interrupted) > 1:
            send(signal.SIGKILL)
        else:
            send(signum)

    # Installed before any process starts: a Ctrl-C that comes early is forwarded too.
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            handlers[sig] = signal.signal(sig, on_signal)
    for r in range(nproc):
        if interrupted:  # stopped while starting: start no more
            break
        process = subprocess.Popen(
            [sys.executable, *command], env=child_env(r, nproc, address, port, timeout, base_env),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=_prepare_child,
        )
        ranks.append(_Rank(r, process, show=not quiet_ranks or r == 0))
    for rank in ranks:
        for stream, sink in ((rank.process.stdout, out), (rank.process.stderr, err)):
            reader = threading.Thread(target=_pump, args=(rank, stream, sink, lock), daemon=True)
            reader.start()
            rank.readers.append(reader)

    try:
        failed = None
        while True:
            running = False
            for rank in ranks:
                code = rank.process.poll()
                if code is None:
                    running = True
                elif rank.ended_at is None:
                    rank.ended_at = time.monotonic()
                    if code != 0 and failed is None and not interrupted:
                        failed = rank
            if failed is not None or not running:
                break
            time.sleep(0.05)
        if failed is not None:
            failed = _root_cause(ranks, failed)
            _stop(ranks, send, grace)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    for rank in ranks:
        rank.process.wait()
        for reader in rank.readers:
            reader.join(timeout=5)

    if interrupted:
        with lock:
            err.write(f"keras-multigpu launch: stopped by {signal.Signals(interrupted[0]).name}; "
                      f"{nproc} process(es) ended.\n")
        return 130
    if failed is None:
        return 0
    code = failed.process.returncode
    lines = "\n".join(f"    {line}" for line in failed.tail) or "    (it printed nothing)"
    others = [r.rank for r in ranks if r is not failed]
    with lock:
        err.write(
            f"keras-multigpu launch: rank {failed.rank} of {nproc} {_describe_exit(code)}. "
            f"Its last lines:\n{lines}\n"
            + (f"keras-multigpu launch: stopped the other rank(s) {others}.\n" if others else "")
        )
        err.flush()
    return code if code > 0 else 128 - code


# What a process prints when it fails because another one did.
_SECONDARY = ("CollectiveError", "Connection closed by peer", "Connection reset by peer")


def _root_cause(ranks, first):
    """The failed process to blame: a process whose peer died fails too, moments later,
    and may be seen first. Among those failed within a second, one that did not fail
    for a peer is chosen."""
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline and any(r.process.poll() is None for r in ranks):
        time.sleep(0.05)
    for reader in first.readers:
        reader.join(timeout=1)
    failed = [r for r in ranks if r.process.poll() not in (None, 0)]
    for rank in failed:
        for reader in rank.readers:
            reader.join(timeout=1)
        if not any(marker in line for line in rank.tail for marker in _SECONDARY):
            return rank
    return first


def _stop(ranks, send, grace):
    """SIGTERM to every running process, then SIGKILL to those still running after `grace`."""
    send(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(r.process.poll() is None for r in ranks):
        time.sleep(0.05)
    send(signal.SIGKILL)
