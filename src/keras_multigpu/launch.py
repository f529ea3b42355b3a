"""`keras-multigpu launch -n N script.py args...`: one process per device, as torchrun starts them.

Each process gets torchrun's variables (`MASTER_ADDR`, `MASTER_PORT`, `RANK`,
`WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`, ...), so a
script written for torchrun runs unchanged, and the engines join the others
through them (torch.distributed; jax.distributed; TensorFlow's
MultiWorkerMirroredStrategy through `TF_CONFIG`, which is set for it). The
launcher:

- starts `-n` processes on this machine, as node `node_rank` of `nnodes`
  (one launcher per machine, all given the same `--master-addr` and
  `--master-port`; under SLURM, those come from its variables);
- prefixes every line a process prints with its rank (`quiet_ranks`: only
  rank 0's lines are shown; the others' are kept for error reports);
- forwards Ctrl-C (SIGINT) and SIGTERM to every process, which stop together after the
  same step (`interrupt`); a second signal kills them;
- when a process fails, stops the others (SIGTERM, then SIGKILL after
  `grace` seconds) and exits non-zero, naming the rank and its last lines;
  with `max_restarts`, starts the group again instead, up to that many
  times (`KERAS_MULTIGPU_RESTART_COUNT` and torchrun's
  `TORCHELASTIC_RESTART_COUNT` tell the processes which start it is): a
  script with `keras_multigpu.callbacks.Checkpoint` resumes where the last
  checkpoint left it, as torchrun's `--max-restarts` expects of a script.

Processes die with the launcher too (Linux's parent-death signal), so none
is left behind.
"""

import collections
import contextlib
import ctypes
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

from keras_multigpu._launch_report import report, root_cause
from keras_multigpu._slurm import (  # noqa: F401 (the CLI's)
    LaunchError,
    first_host,
    from_slurm,
    hosts,
)

TAIL_LINES = 15
GRACE_SECONDS = 10.0
# Set to 0 to train on one device instead of relaunching `python script.py` (an engine
# that runs one process per device: torch's).
RELAUNCH_ENV = "KERAS_MULTIGPU_RELAUNCH"
_LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched():
    """Whether this process was started by a launcher (this one, or torchrun)."""
    return all(name in os.environ for name in _LAUNCH_VARIABLES)


def relaunch_allowed():
    return os.environ.get(RELAUNCH_ENV, "1") != "0"


def _script_command():
    """The command that runs this script again, or None where there is none (a REPL)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    path = getattr(main, "__file__", None)
    if hasattr(sys, "ps1") or sys.flags.interactive or path is None or not os.path.isfile(path):
        return None
    if spec is not None and spec.name and spec.name != "__main__":
        return ["-m", spec.name.removesuffix(".__main__"), *sys.argv[1:]]
    return [path, *sys.argv[1:]]


def relaunch(count):
    """Runs this script again under `keras-multigpu launch -n count` (never returns), for an
    engine that runs one process per device when `python script.py` asked for several."""
    command = _script_command()
    if command is None:
        raise RuntimeError(
            f"This engine runs one process per device, and this interactive session "
            f"cannot be relaunched on {count} processes. Save the code as a script and run "
            f"`keras-multigpu launch -n {count} script.py`, or pass gpus=1 to "
            "multi_gpu_model to train on one device here."
        )
    args = [sys.executable, "-m", "keras_multigpu.cli", "launch", "-n", str(count), *command]
    sys.stdout.flush()
    print(f"keras_multigpu: relaunching as `keras-multigpu launch -n {count} "
          f"{shlex.join(command)}` (one process per device; set {RELAUNCH_ENV}=0 to train on "
          "one device instead).", file=sys.stderr, flush=True)
    os.execv(sys.executable, args)


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


def check_resolves(address):
    """A master address that no name server knows is refused at once: the processes waited
    three times `--timeout` to join it, and said the socket timed out. A failure that may
    pass (a busy name server) is left to the processes, which retry."""
    try:
        socket.getaddrinfo(address, None)
    except UnicodeError as error:  # not a host name at all (a label over 63 characters)
        raise LaunchError(f"--master-addr {address!r} is no host name ({error}).") from error
    except socket.gaierror as error:
        if error.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", None)):
            raise LaunchError(
                f"--master-addr {address!r} does not resolve ({error.strerror}). Pass node "
                "0's address, or a host name every node resolves."
            ) from error


def _prepare_child():  # runs in the child, before the script
    # The launcher forwards Ctrl-C itself: a process must not inherit SIGINT ignored (as a
    # launcher started in the background, `cmd &`, has it).
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def child_env(rank, world, address, port, timeout=None, base=None, *, local_rank=None,
              local_world=None, node_rank=0, nnodes=1, restart=0, tf_workers=None):
    """The environment of process `rank`: torchrun's variables on top of `base`."""
    env = dict(os.environ if base is None else base)
    local_rank = rank if local_rank is None else local_rank
    local_world = world if local_world is None else local_world
    env.update({
        "MASTER_ADDR": address, "MASTER_PORT": str(port),
        "RANK": str(rank), "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_world),
        "GROUP_RANK": str(node_rank), "GROUP_WORLD_SIZE": str(nnodes),
        "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world),
        "KERAS_MULTIGPU_RESTART_COUNT": str(restart), "TORCHELASTIC_RESTART_COUNT": str(restart),
        "PYTHONUNBUFFERED": "1",
    })
    if local_world > 1 and "OMP_NUM_THREADS" not in env:
        # The processes share the cores (torchrun sets 1; a share uses them all).
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // local_world))
    if timeout is not None:
        env["KERAS_MULTIGPU_TIMEOUT"] = f"{timeout:g}"
    if tf_workers is not None:
        env["TF_CONFIG"] = json.dumps({"cluster": {"worker": list(tf_workers)},
                                       "task": {"type": "worker", "index": rank}})
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


LOOPBACK = ("127.0.0.1", "localhost", "::1")
DEFAULT_PORT = 29500  # torchrun's: every node must be given the same port


def _check_int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise LaunchError(f"{name} must be an integer >= {minimum}. Received: {name} {value!r}.")


def launch(nproc, command, *, address="127.0.0.1", port=None, quiet_ranks=False,
           timeout=None, grace=GRACE_SECONDS, base_env=None, out=None, err=None,
           nnodes=1, node_rank=0, max_restarts=0, node_hosts=None, tf_config=False):
    """Runs `command` (`[script, args...]` or `["-m", module, args...]`) as `nproc` processes.

    Args:
        nnodes, node_rank: this machine is node `node_rank` of `nnodes`; its
            processes are ranks `node_rank * nproc ...` of `nnodes * nproc`.
        max_restarts: after a process fails, start the group again, up to
            this many times.
        node_hosts: every node's address, for `TF_CONFIG` (default: the
            master's, when the nodes are all this machine).
        tf_config: set `TF_CONFIG` (TensorFlow's workers) for the processes.

    Returns:
        The exit status: 0 when every process succeeded; the failed
        process's status (128 + the signal when killed) after a failure (the
        last one, after the restarts); 130 after a Ctrl-C, 143 after a SIGTERM.
    """
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise LaunchError(f"-n must be a positive number of processes. Received: -n {nproc!r}.")
    _check_int("--nnodes", nnodes, 1)
    _check_int("--max-restarts", max_restarts, 0)
    if isinstance(node_rank, bool) or not isinstance(node_rank, int) or not (
            0 <= node_rank < nnodes):
        raise LaunchError(f"--node-rank must be in 0..{nnodes - 1} (--nnodes {nnodes}). "
                          f"Received: --node-rank {node_rank!r}.")
    if not command:
        raise LaunchError("No script to launch. Usage: keras-multigpu launch -n N script.py "
                          "[args...] (or -m module [args...]).")
    if command[0] == "-m":
        if len(command) < 2:
            raise LaunchError("-m needs a module name, e.g. `keras-multigpu launch -n 2 -m "
                              "package.train`.")
    elif not os.path.isfile(command[0]):
        raise LaunchError(
            f"{'Not a script, a folder' if os.path.isdir(command[0]) else 'No such script'}: "
            f"{command[0]!r} (from {os.getcwd()}). Pass the path of a Python file, or -m and "
            "a module name."
        )
    if nnodes > 1 and port is None:
        port = DEFAULT_PORT
    chosen = port
    if address not in LOOPBACK:
        check_resolves(address)
    if port is not None and node_rank == 0 and address in LOOPBACK + (socket.gethostname(),):
        check_port(address, port)
    workers = None
    if tf_config and nnodes * nproc > 1:
        if node_hosts is None and (nnodes == 1 or address in LOOPBACK):
            node_hosts = [address] * nnodes
        if node_hosts is None or len(node_hosts) != nnodes:
            raise LaunchError(
                "TensorFlow's MultiWorkerMirroredStrategy needs every worker's address: pass "
                "--hosts with the nodes' addresses in node-rank order (SLURM gives them), or "
                "set TF_CONFIG yourself."
            )
    world = nnodes * nproc
    for restart in range(max_restarts + 1):
        group_port = chosen if chosen is not None else free_port(address)
        if tf_config and world > 1:
            workers = [f"{node_hosts[g // nproc]}:{group_port + 1 + g}" for g in range(world)]
        code, interrupted = _run_group(
            nproc, command, address, group_port, quiet_ranks, timeout, grace, base_env, out,
            err, nnodes, node_rank, restart, workers)
        if code == 0 or interrupted or restart == max_restarts:
            return code
        err.write(f"keras-multigpu launch: restarting the {nproc} process(es) of node "
                  f"{node_rank} (restart {restart + 1} of {max_restarts}).\n")
        err.flush()
    return code


def _run_group(nproc, command, address, port, quiet_ranks, timeout, grace, base_env, out, err,
               nnodes, node_rank, restart, workers):
    """Starts one group of processes and waits for it: `(exit status, interrupted)`."""
    lock = threading.Lock()
    ranks = []
    interrupted = []
    world = nnodes * nproc

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
    for local in range(nproc):
        if interrupted:  # stopped while starting: start no more
            break
        rank = node_rank * nproc + local
        env = child_env(rank, world, address, port, timeout, base_env, local_rank=local,
                        local_world=nproc, node_rank=node_rank, nnodes=nnodes, restart=restart,
                        tf_workers=workers)
        process = subprocess.Popen(
            [sys.executable, *command], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=_prepare_child,
        )
        ranks.append(_Rank(rank, process, show=not quiet_ranks or rank == 0))
    for rank in ranks:
        for stream, sink in ((rank.process.stdout, out), (rank.process.stderr, err)):
            reader = threading.Thread(target=_pump, args=(rank, stream, sink, lock), daemon=True)
            reader.start()
            rank.readers.append(reader)

    try:
        failed = None
        while True:
            running = False
            now = time.monotonic()  # (one time for every rank seen ended in this pass)
            for rank in ranks:
                code = rank.process.poll()
                if code is None:
                    running = True
                elif rank.ended_at is None:
                    rank.ended_at = now
                    if code != 0 and failed is None and not interrupted:
                        failed = rank
            if failed is not None or not running:
                break
            time.sleep(0.05)
        first, stopped, how = failed, [], None
        if failed is not None:
            failed, how = root_cause(ranks, failed)
            stopped = [r.rank for r in ranks if r.process.poll() is None]
            _stop(ranks, send, grace)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    for rank in ranks:
        rank.process.wait()
        for reader in rank.readers:
            # The process has ended: its pipe ends too, unless a child of it still holds it
            # open. A loaded machine can take seconds to get the reader its last lines.
            reader.join(timeout=30)

    if interrupted:
        with lock:
            err.write(f"keras-multigpu launch: stopped by {signal.Signals(interrupted[0]).name}; "
                      f"{len(ranks)} process(es) ended.\n")
        return 128 + interrupted[0], True  # as a shell reports the signal: 130, 143
    if failed is None:
        return 0, False
    message, code = report(failed, how, first, world, stopped)
    with lock:
        err.write(message)
        err.flush()
    return code, False


def _stop(ranks, send, grace):
    """SIGTERM to every running process, then SIGKILL to those still running after `grace`."""
    send(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(r.process.poll() is None for r in ranks):
        time.sleep(0.05)
    send(signal.SIGKILL)
