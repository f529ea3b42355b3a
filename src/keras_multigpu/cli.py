"""The `keras-multigpu` command: `devices`, `train`, `compare`, `bench` and `launch`.

Exit status: 0 on success; 1 when a run ends below `--target-acc`; 2 for a
user's mistake (a bad flag, data folder or `--output`), reported in one line
without a traceback; 130 after a Ctrl-C, which `train` and `compare` report
with what was saved (the experiment writes its files after every epoch).
"""

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import sys

from keras_multigpu import backends
from keras_multigpu import devices as devices_lib
from keras_multigpu._io import write_json

EXIT_TARGET_MISSED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class UsageError(Exception):
    """A mistake in the command line, reported without a traceback."""


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: ...)" after every option whose help does not state its default."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS) or isinstance(
            action.default, bool
        ):
            return text
        return super()._get_help_string(action)


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _count(text):
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or a positive integer, got {text!r}")
    return value


def _positive_float(text):
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _fraction(text):
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, got {text!r}")
    return value


def _gpus(text):
    """`train --gpus`, as `multi_gpu_model(gpus=...)`: a count, a list of ids, or all."""
    text = text.strip()
    if text.lower() == "all":
        return None
    try:
        if "," in text:
            ids = [int(part) for part in text.split(",") if part.strip()]
            if ids and min(ids) >= 0 and len(set(ids)) == len(ids):
                return ids
        elif int(text) >= 0:
            return int(text)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(
        "expected a device count (0 and 1 both mean one device), a list of distinct device "
        f"ids such as 0,2 (one id: 3,) or 'all'; got {text!r}"
    )


def _distinct_counts(text, what, example):
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1 or len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(
            f"expected distinct {what} of at least 1, like {example}; got {text!r}"
        )
    return counts


def _gpu_list(text):
    return _distinct_counts(text, "device counts", "1,2,4")


def _prepare_devices(gpus):
    """Checks `gpus` against the devices; on a machine without GPUs, asks for enough
    virtual CPU devices for it.

    Runs before the framework starts; NVML is the only thing consulted.
    """
    if gpus is not None and all(d.kind == "cpu" for d in devices_lib.list_devices()):
        if devices_lib.cpu_device_count() is None:
            needed = max(gpus) + 1 if isinstance(gpus, list) else max(gpus, 1)
            backend = backends.current()
            if backends.has(backend, "cpu_devices"):
                backend.configure_cpu_devices(needed)
            devices_lib.list_devices.cache_clear()
    try:
        devices_lib.select(gpus, devices_lib.list_devices())
    except ValueError as error:
        text = str(error).replace("Pass gpus=None", "Pass --gpus all")
        raise UsageError(f"--gpus: {text}") from None


# Held by the run that writes into an --output folder (see `_claimed`).
LOCK_NAME = ".keras-multigpu.lock"


def _held_files(path):
    return sorted(name for name in os.listdir(path) if name != LOCK_NAME)


def _check_output(path, overwrite):
    """Refuses an `--output` that is not a folder, cannot be created, or holds files."""
    if not path.strip():
        raise UsageError("--output is empty; name a folder for the results")
    if os.path.isdir(path):
        names = _held_files(path)
        if names and not overwrite:
            shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
            raise UsageError(
                f"--output {path} already holds files ({shown}); pass --overwrite to replace "
                "them, or choose another --output"
            )
        parent = path
    elif os.path.lexists(path):
        what = "a file" if os.path.isfile(path) else "not a folder"
        raise UsageError(f"--output {path} is {what}; choose another --output")
    else:
        parent = os.path.dirname(os.path.abspath(path))
        while not os.path.lexists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            raise UsageError(
                f"--output {path} cannot be created: {parent} is a file, not a folder"
            )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"--output {path}: {parent} is not writable; choose another --output")


@contextlib.contextmanager
def _no_empty_folders(path):
    """Removes the folders on the way to `path` that the block created and left empty.

    The experiment creates its folder with its first file; a run that fails
    before writing anything (or whose first write fails) leaves nothing behind.
    """
    missing = None
    probe = os.path.abspath(path)
    while not os.path.lexists(probe):
        missing, probe = probe, os.path.dirname(probe)
    try:
        yield
    finally:
        if missing is not None and os.path.isdir(missing):
            for folder, _, _ in os.walk(missing, topdown=False):
                with contextlib.suppress(OSError):
                    os.rmdir(folder)  # only an empty folder goes


@contextlib.contextmanager
def _claimed(path, overwrite):
    """Holds `path` for this run: a second run into the same --output at the same time is
    refused (its files would silently replace this run's), naming the process that holds it.

    The claim is an exclusive `flock` on a lock file in the folder, released when the
    process ends, however it ends (a kill leaves only the file, which claims nothing). The
    run removes the file when it ends.
    """
    import fcntl
    import time

    os.makedirs(path, exist_ok=True)
    lock = os.path.join(path, LOCK_NAME)
    handle = open(lock, "a+")  # noqa: SIM115 (held for the run)
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise UsageError(
            f"--output {path} is in use by another run ({holder}); wait for it to finish, "
            "or choose another --output") from None
    try:
        # Checked again under the claim: a run that started meanwhile may have written.
        names = _held_files(path)
        if names and not overwrite:
            raise UsageError(
                f"--output {path} already holds files ({', '.join(names[:4])}"
                f"{', ...' if len(names) > 4 else ''}); pass --overwrite to replace them, or "
                "choose another --output")
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        handle.flush()
        yield
    finally:
        with contextlib.suppress(OSError):
            os.remove(lock)
        handle.close()


def _add_training_flags(parser):
    from keras_multigpu.experiment_config import Config

    defaults = Config()
    parser.add_argument("--output", default=defaults.output,
                        help="folder for the results; it must not hold files yet "
                             "unless --overwrite is given")
    parser.add_argument("--overwrite", action="store_true",
                        help="train into an --output that already holds files (by default "
                             "refused); each file is replaced as the new run writes it")
    parser.add_argument("--epochs", type=_positive_int, default=defaults.epochs,
                        help="training epochs")
    parser.add_argument("--data-dir", default=None,
                        help="CIFAR-10 (cifar-10-batches-py or its parent) (default: "
                             "$KERAS_MULTIGPU_DATA, then Keras's cache, then a download)")
    parser.add_argument("--limit", type=_positive_int, default=None,
                        help="use at most this many training and test images (default: all)")
    parser.add_argument("--width", type=_positive_float, default=defaults.width,
                        help="MiniGoogLeNet width multiplier (1.0 = the paper's)")
    parser.add_argument("--batch-per-device", type=_positive_int,
                        default=defaults.batch_per_device,
                        help="images per device per step (the global batch is this times "
                             "the device count)")
    parser.add_argument("--lr", type=_positive_float, default=defaults.lr,
                        help="initial learning rate, decaying linearly to 0")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="random seed")
    parser.add_argument("--no-augment", dest="augment", action="store_false",
                        help="train without random shifts and flips (on by default)")
    parser.add_argument("--precision", default=defaults.precision,
                        choices=["float32", "mixed_bfloat16", "mixed_float16"],
                        help="Keras dtype policy")
    parser.add_argument("--target-acc", type=_fraction, default=None,
                        help="exit with status 1 if the final validation accuracy is lower "
                             "(default: no target)")
    parser.add_argument("--progress", choices=sorted(_PROGRESS), default="auto",
                        help="Keras's output: a progress bar, one line per epoch, or none; "
                             "auto: the bar on a terminal, one line per epoch when stdout "
                             "is piped or redirected")


_PROGRESS = {"auto": "auto", "bar": 1, "epoch": 2, "none": 0}


def _config(args, gpus, output):
    from keras_multigpu.experiment_config import Config

    fields = {f.name for f in dataclasses.fields(Config)}
    values = {k: v for k, v in vars(args).items() if k in fields}
    config = Config(**{**values, "gpus": gpus, "output": output,
                       "verbose": _PROGRESS[args.progress]})
    try:
        config.validate()
    except ValueError as error:
        raise UsageError(str(error)) from None
    return config


def cmd_devices(args):
    from keras_multigpu import nvml

    found = devices_lib.list_devices()
    report = nvml.gpu_report()  # NVML only: no framework, no device memory
    cpus = sum(d.kind == "cpu" for d in found)
    if args.json:
        print(json.dumps({"devices": [dataclasses.asdict(d) for d in found], **report,
                          "cpu_devices": cpus}, indent=2))
        return 0
    for d in found:
        memory = f"{d.memory_bytes / 2**30:.1f} GiB" if d.memory_bytes else "-"
        print(f"{str(d):8} {d.name:32} {memory}")
    if not report["gpus"]:
        reason = report["nvml"] if report["nvml"] != "ok" else "no GPU visible"
        print(f"No GPU found (NVML: {reason}); CPU devices: {cpus}")
    for gpu in report["gpus"]:
        print(_gpu_line(gpu))
    return 0


def _gpu_line(gpu):
    """One GPU's NVML facts on a line; '?' where NVML could not say (e.g. '? W')."""
    def shown(value, form):
        return form.replace("{:.0f}", "?").replace("{}", "?") if value is None else (
            form.format(value))

    used, total = gpu["memory_used_bytes"], gpu["memory_total_bytes"]
    memory = "?" if used is None else f"{used / 2**30:.1f}/{total / 2**30:.1f} GiB"
    links = gpu["nvlink"]
    nvlink = "none" if links is None else f"{sum(links)}/{len(links)} links up"
    return (f"gpu:{gpu['id']} {shown(gpu['name'], '{}')}: memory {memory}, util "
            f"{shown(gpu['utilization_gpu'], '{}%')}, {shown(gpu['temperature_c'], '{} C')}, "
            f"{shown(gpu['power_w'], '{:.0f} W')}, PCIe gen {shown(gpu['pcie_generation'], '{}')}"
            f" x{shown(gpu['pcie_width'], '{}')}, NVLink {nvlink}")


def _verdict(accuracy, target):
    """`(text, exit status)` of `--target-acc`; `(None, 0)` without one."""
    if target is None:
        return None, 0
    shown = "none" if accuracy is None else f"{accuracy:.4f}"
    if accuracy is not None and accuracy >= target:
        return f"--target-acc {target:g} passed ({shown} >= {target:g})", 0
    print(f"FAILED: final validation accuracy {shown} is below --target-acc {target:g}",
          file=sys.stderr)
    return f"--target-acc {target:g} FAILED ({shown} < {target:g})", EXIT_TARGET_MISSED


def _closing(summary, folder, verdict):
    """The line after a run: its numbers, the `--target-acc` verdict and its files."""
    from keras_multigpu import experiment

    parts = [experiment.summary_line(summary)]
    if verdict:
        parts.append(verdict)
    names = list(experiment.OUTPUT_FILES)
    if os.path.isdir(os.path.join(folder, experiment.MONITOR_DIR)):
        names.append(f"{experiment.MONITOR_DIR}/")
    parts.append(f"saved in {folder}: {', '.join(names)}")
    return "; ".join(parts)


def _train_one(config, target, overwrite=None):
    """Runs one experiment into `config.output` (claimed for the run unless `overwrite` is
    None: a `compare` claims the folder of all its runs)."""
    from keras_multigpu import experiment

    with _no_empty_folders(config.output), (
            contextlib.nullcontext() if overwrite is None
            else _claimed(config.output, overwrite)):
        summary = experiment.run(config)
    verdict, status = _verdict(summary["final_val_accuracy"], target)
    print(_closing(summary, config.output, verdict), flush=True)
    return summary, status


def _needs_experiment(command):
    """`train`, `compare` and `bench` draw figures: matplotlib comes with the extra."""
    from keras_multigpu._extras import require

    require("matplotlib", "experiment", f"keras-multigpu {command}")


def cmd_train(args):
    _needs_experiment(args.command)
    config = _config(args, args.gpus, args.output)
    _check_output(args.output, args.overwrite)
    _prepare_devices(args.gpus)
    return _train_one(config, args.target_acc, overwrite=args.overwrite)[1]


def cmd_compare(args):
    _needs_experiment(args.command)
    configs = [_config(args, count, os.path.join(args.output, f"gpus-{count}"))
               for count in args.gpus]
    _check_output(args.output, args.overwrite)
    _prepare_devices(max(args.gpus))
    from keras_multigpu import plots

    runs, missed = [], []
    with _no_empty_folders(args.output), _claimed(args.output, args.overwrite):
        for config in configs:
            summary, status = _train_one(config, args.target_acc)
            if status:
                missed.append(config.gpus)
            with open(os.path.join(config.output, "history.json")) as f:
                runs.append((summary, json.load(f)["epochs"]))
        base = runs[0][0]["mean_epoch_seconds"]
        print(f"\n{'devices':>7} {'s/epoch':>9} {'img/s':>9} {'speed-up':>9} {'val_acc':>8}")
        for summary, _ in runs:
            accuracy = summary["final_val_accuracy"]
            print(f"{len(summary['devices']):>7} {summary['mean_epoch_seconds']:>9.2f} "
                  f"{summary['images_per_second']:>9.0f} "
                  f"{base / summary['mean_epoch_seconds']:>9.2f} "
                  f"{'-' if accuracy is None else format(accuracy, '.4f'):>8}")
        plots.comparison(runs, os.path.join(args.output, "compare.png"))
        write_json(os.path.join(args.output, "compare.json"), [summary for summary, _ in runs])
    parts = [f"saved in {args.output}: compare.json, compare.png, "
             + ", ".join(f"gpus-{count}/" for count in args.gpus)]
    if args.target_acc is not None:
        if missed:
            parts.append(f"--target-acc {args.target_acc:g} FAILED with "
                         f"{', '.join(map(str, missed))} device(s)")
        else:
            parts.append(f"--target-acc {args.target_acc:g} passed by every run")
    print("; ".join(parts))
    return EXIT_TARGET_MISSED if missed else 0


def _host_counts(text):
    return _distinct_counts(text, "host counts", "1,2,4,16")


def _parameter_count(text):
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 1 <= value < math.inf or value != int(value):
        raise argparse.ArgumentTypeError(
            f"expected a whole number of parameters, like 44500000 or 44.5e6; got {text!r}"
        )
    return int(value)


PROJECT_MAX_STEPS = 8  # `bench --project` measures at most this many steps per epoch


def _cmd_project(args):
    """`bench --project`: the cost model alone, from --step-ms or one short ours-1 run."""
    from keras_multigpu import bench
    from keras_multigpu.bench import harness

    if args.setups:
        raise UsageError("--project runs no setups; leave out --setups")
    batch = args.batch_per_device
    spec = bench.spec(
        model=args.model, width=args.width, samples=min(args.samples, PROJECT_MAX_STEPS * batch),
        epochs=1, batch_per_device=batch, precision=args.precision, fit_calls=0,
        placement=args.placement)
    results = harness.project_only(spec, step_ms=args.step_ms, parameters=args.params,
                                   hosts=args.hosts, gpus_per_host=args.gpus_per_host,
                                   output=args.output, timeout=args.timeout)
    print(harness.format_projection(results["projection"]))
    print(f"\nWrote {os.path.join(args.output, 'projection.json')}")
    return 0


def cmd_bench(args):
    _needs_experiment(args.command)
    from keras_multigpu import bench

    if args.project:
        return _cmd_project(args)
    if args.setups:
        setups = [bench.parse(name) for name in args.setups.split(",") if name.strip()]
    else:
        found = devices_lib.list_devices()
        count = args.devices or (len(found) if found[0].kind == "gpu" else 2)
        setups = bench.default_setups(count)
    spec = bench.spec(model=args.model, width=args.width, samples=args.samples,
                      epochs=args.epochs, batch_per_device=args.batch_per_device,
                      precision=args.precision, fit_calls=args.fit_calls,
                      fit_epochs=args.fit_epochs, placement=args.placement)
    results = bench.run(setups, spec, rounds=args.rounds, output=args.output,
                        timeout=args.timeout, step_ms=args.step_ms, parameters=args.params,
                        hosts=args.hosts, gpus_per_host=args.gpus_per_host)
    print(bench.format_table(results))
    return 0


def _port(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number from 1 to 65535, got {text!r}")
    return value


def _default_processes():
    """One process per GPU; on a CPU-only machine, KERAS_MULTIGPU_CPU_DEVICES (else 1)."""
    return len(devices_lib.list_devices())


def cmd_launch(args):
    from keras_multigpu import launch

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


def _env_int(name, default):
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise UsageError(f"{name} must be an integer. Received: {name}={raw!r}.") from None


def build_parser():
    parser = argparse.ArgumentParser(
        prog="keras-multigpu",
        description="Train Keras 3 models on every device of this machine.",
        epilog="Exit status: 0 done; 1 a run ended below --target-acc; 2 a bad flag, data "
               "folder or --output; 130 stopped by Ctrl-C (train and compare keep the "
               "epochs done: they write their files after every epoch).",
        formatter_class=_Formatter,
    )
    parser.add_argument("-v", "--verbose", dest="log_info", action="store_true",
                        help="log at INFO level (default: warnings only); Keras's output "
                             "is set by --progress")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name, text):
        return sub.add_parser(name, help=text, description=text, formatter_class=_Formatter)

    devices = command("devices", "list the devices with NVML's memory, utilisation, "
                                 "temperature, power and links (starts no framework)")
    devices.add_argument("--json", action="store_true",
                         help="print JSON instead of a table (default: a table)")
    devices.set_defaults(func=cmd_devices)

    train = command("train", "the MiniGoogLeNet CIFAR-10 experiment")
    train.add_argument("--gpus", type=_gpus, default=None,
                       help="devices, as multi_gpu_model(gpus=...): a count (0 and 1 both "
                            "mean one device), a list of ids such as 0,2, or 'all' "
                            "(default: all; on a CPU-only machine, a count asks for that "
                            "many virtual CPU devices)")
    _add_training_flags(train)
    train.set_defaults(func=cmd_train)

    compare = command("compare", "the experiment at several device counts")
    compare.add_argument("--gpus", type=_gpu_list, default=[1, 2],
                         help="device counts to compare, e.g. 1,2,4; run N goes to "
                              "OUTPUT/gpus-N (default: 1,2)")
    _add_training_flags(compare)
    compare.set_defaults(func=cmd_compare)

    bench = command("bench", "throughput of ours, plain Keras and the peers")
    bench.add_argument("--setups", default=None,
                       help="e.g. plain-1,ours-1,ours-2,dataparallel-2,mirrored-2 "
                            "(default: all at 1..--devices)")
    bench.add_argument("--devices", type=_positive_int, default=None,
                       help="largest device count (default: all GPUs, or 2 virtual CPUs)")
    bench.add_argument("--model", choices=["minigooglenet", "dense"], default="minigooglenet",
                       help="the model timed")
    bench.add_argument("--width", type=_positive_float, default=0.25,
                       help="MiniGoogLeNet width multiplier")
    bench.add_argument("--samples", type=_positive_int, default=2048,
                       help="training images per epoch")
    bench.add_argument("--epochs", type=_positive_int, default=3, help="timed epochs per run")
    bench.add_argument("--batch-per-device", type=_positive_int, default=64,
                       help="images per device per step")
    bench.add_argument("--fit-calls", type=_count, default=3,
                       help="whole fit calls timed after the warm-up fit (0: none)")
    bench.add_argument("--fit-epochs", type=_positive_int, default=1,
                       help="epochs per timed fit call")
    bench.add_argument("--placement", choices=["auto", "resident", "host"], default="auto",
                       help="where our setups keep array data: within the budget (auto), on "
                            "every device, or on the host with prefetch")
    bench.add_argument("--rounds", type=_positive_int, default=3,
                       help="rounds over all setups")
    bench.add_argument("--precision", default="float32",
                       choices=["float32", "mixed_bfloat16", "mixed_float16"],
                       help="Keras dtype policy")
    bench.add_argument("--step-ms", type=_positive_float, default=None,
                       help="project scaling from this one-device step time instead "
                            "(default: measure)")
    bench.add_argument("--project", action="store_true",
                       help="print the scaling projection only (modelled: one host, several "
                            "hosts, Horovod's published figures) and write projection.json; "
                            "runs no setups: the step is --step-ms, else ours-1's compiled "
                            f"step measured once (1 epoch of at most {PROJECT_MAX_STEPS} "
                            "steps, then 10 steps; default: off, the full benchmark)")
    bench.add_argument("--hosts", type=_host_counts, default=[1, 2, 4, 16, 64],
                       help="host counts projected (default: 1,2,4,16,64)")
    bench.add_argument("--gpus-per-host", type=_positive_int, default=8,
                       help="GPUs per host in the several-hosts projection")
    bench.add_argument("--params", type=_parameter_count, default=None,
                       help="parameters whose fp32 gradients the projection all-reduces, "
                            "e.g. 44.5e6 (default: the --model's)")
    bench.add_argument("--timeout", type=_positive_float, default=900,
                       help="seconds per worker")
    bench.add_argument("--output", default="runs/bench", help="folder for the results")
    bench.set_defaults(func=cmd_bench)

    launch = command("launch", "run a script as one process per device (as torchrun does)")
    launch.add_argument("-n", "--nproc-per-node", "--nproc", dest="nproc", type=_positive_int,
                        default=None,
                        help="processes to start (default: one per GPU; on a CPU-only machine "
                             "KERAS_MULTIGPU_CPU_DEVICES, else 1)")
    launch.add_argument("--nnodes", type=_positive_int, default=None,
                        help="machines taking part, one launcher on each (default: SLURM's "
                             "SLURM_NNODES, else NNODES, else 1)")
    launch.add_argument("--node-rank", type=_count, default=None,
                        help="this machine's index, 0 .. nnodes-1 (default: SLURM_NODEID, "
                             "else NODE_RANK, else 0)")
    launch.add_argument("--master-addr", default=None,
                        help="address of node 0, where the processes meet (default: the "
                             "first SLURM node, else MASTER_ADDR, else 127.0.0.1)")
    launch.add_argument("--master-port", type=_port, default=None,
                        help="port they meet at (default: MASTER_PORT; else a free one on "
                             "one machine, 29500 across several)")
    launch.add_argument("--hosts", default=None,
                        help="every node's address, comma-separated in node-rank order, for "
                             "TensorFlow's workers (default: SLURM's node list, else the "
                             "master's address on every node when it is 127.0.0.1)")
    launch.add_argument("--max-restarts", type=_count, default=0,
                        help="start the processes again after a failure, up to this many "
                             "times (a script with keras_multigpu.callbacks.Checkpoint "
                             "resumes from its last checkpoint)")
    launch.add_argument("--quiet-ranks", action="store_true",
                        help="show rank 0's output only (default: every rank's, prefixed)")
    launch.add_argument("--timeout", type=_positive_float, default=None,
                        help="seconds a collective waits for the other processes before it "
                             "fails (default: KERAS_MULTIGPU_TIMEOUT, else 300)")
    launch.add_argument("-m", "--module", action="store_true",
                        help="run SCRIPT as a module, as python -m does (default: a file)")
    launch.add_argument("script", help="the Python script (or module, with -m)")
    launch.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    launch.set_defaults(func=cmd_launch)
    return parser


def _report(command, what, error):
    notes = [what, *getattr(error, "__notes__", ())]
    print(f"keras-multigpu {command}: " + "; ".join(notes), file=sys.stderr)


def main(argv=None):
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.log_info else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except KeyboardInterrupt as error:
        _report(args.command, "interrupted", error)
        return EXIT_INTERRUPTED
    except (UsageError, OSError, ValueError, TypeError) as error:
        _report(args.command, f"error: {error}", error)
        return EXIT_USAGE
    except ImportError as error:  # a missing extra or backend: the message names it
        _report(args.command, f"error: {error}", error)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
