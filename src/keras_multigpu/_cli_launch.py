"""`keras-multigpu launch`: the flags, SLURM's or torchrun's variables, into
`keras_multigpu.launch.launch`."""

import json
import os

from keras_multigpu import devices as devices_lib
from keras_multigpu._cli_args import UsageError, _env_int


def _default_processes():
    """One process per GPU; on a CPU-only machine, KERAS_MULTIGPU_CPU_DEVICES (else 1)."""
    return len(devices_lib.list_devices())


def cmd_launch(args):
    from keras_multigpu import launch

    if args.script is None:
        raise UsageError("launch needs a script: keras-multigpu launch -n 2 train.py [its "
                         "arguments], or -m and a module name")
    command = (["-m"] if args.module else []) + [args.script, *args.args]
    base = dict(os.environ)
    try:
        nnodes, node_rank, address, port, node_hosts = _nodes(args, launch)
        backend = (os.environ.get("KERAS_BACKEND") or "").strip() or _configured_backend()
        # Neither set: Keras's default, TensorFlow, unless the script names another itself;
        # its workers get TF_CONFIG wherever their addresses are known.
        tf_config = backend == "tensorflow" or backend is None and (
            nnodes == 1 or node_hosts is not None or address in launch.LOOPBACK)
        return launch.launch(
            args.nproc or _default_processes(), command, address=address, port=port,
            quiet_ranks=args.quiet_ranks, timeout=args.timeout, base_env=base,
            nnodes=nnodes, node_rank=node_rank, max_restarts=args.max_restarts,
            node_hosts=node_hosts, tf_config=tf_config,
        )
    except launch.LaunchError as error:
        raise UsageError(str(error)) from None


def _configured_backend():
    """The backend named in Keras's own config file, found as Keras finds it
    (`$KERAS_HOME/keras.json`, else `~/.keras/keras.json`, else `/tmp/.keras/keras.json`
    where the home folder is not writable), read without importing Keras; None when it
    names none."""
    if "KERAS_HOME" in os.environ:
        home = os.environ["KERAS_HOME"]
    else:
        base = os.path.expanduser("~")
        home = os.path.join(base if os.access(base, os.W_OK) else "/tmp", ".keras")
    try:
        with open(os.path.join(home, "keras.json")) as f:
            backend = json.load(f).get("backend")
    except (OSError, ValueError, AttributeError):
        return None
    return backend.strip() if isinstance(backend, str) and backend.strip() else None


def _nodes(args, launch):
    """`(nnodes, node_rank, master address, master port, node hosts)`: the flags, else SLURM's
    variables, else torchrun's (`NNODES`, `NODE_RANK`, `MASTER_ADDR`, `MASTER_PORT`)."""
    slurm = launch.from_slurm(os.environ) if args.nnodes is None else None
    env = os.environ
    if slurm is not None:
        nnodes, node_rank, address, node_hosts = slurm
    else:
        nnodes = args.nnodes if args.nnodes is not None else _env_int("NNODES", 1)
        node_rank = _env_int("NODE_RANK", 0)
        address, node_hosts = None, None
    if args.node_rank is not None:
        node_rank = args.node_rank
    address = args.master_addr or address or env.get("MASTER_ADDR") or "127.0.0.1"
    port = args.master_port if args.master_port is not None else (
        _env_int("MASTER_PORT", None) if env.get("MASTER_PORT") else None)
    if args.hosts:
        node_hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    if not 0 <= node_rank < nnodes:
        raise launch.LaunchError(f"--node-rank must be in 0..{nnodes - 1} (--nnodes {nnodes}). "
                                 f"Received: --node-rank {node_rank}.")
    if nnodes > 1 and node_rank > 0 and address in launch.LOOPBACK and slurm is None and not (
            args.master_addr):
        raise launch.LaunchError(
            f"--node-rank {node_rank} of --nnodes {nnodes} needs --master-addr: the address "
            "of node 0, where rank 0 listens (pass 127.0.0.1 explicitly when every node is "
            "this machine)."
        )
    return nnodes, node_rank, address, port, node_hosts
