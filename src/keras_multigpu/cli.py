"""The `keras-multigpu` command: `devices`, `train`, `compare`, `bench` and `launch`.

Exit status: 0 on success; 1 when a run ends below `--target-acc` (or `bench` measured
no setup); 2 for a
user's mistake (a bad flag, data folder or `--output`), reported in one line
without a traceback; 130 after a Ctrl-C, which `train` and `compare` report
with what was saved (the experiment writes its files after every epoch).
"""

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import sys

from keras_multigpu import backends
from keras_multigpu import devices as devices_lib
from keras_multigpu._cli_args import (
    UsageError,
    _count,
    _Formatter,
    _fraction,
    _gpu_list,
    _gpus,
    _host_counts,
    _needs_experiment,
    _parameter_count,
    _Parser,
    _port,
    _positive_float,
    _positive_int,
    _seed,
)
from keras_multigpu._cli_launch import cmd_launch
from keras_multigpu._cli_measure import PROJECT_MAX_STEPS, cmd_bench, cmd_devices
from keras_multigpu._cli_output import (
    _check_output,
    _claimed,
    _no_empty_folders,
)
from keras_multigpu._io import write_json

EXIT_TARGET_MISSED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def _prepare_devices(gpus, processes=False):
    """Checks `gpus` against the devices; on a machine without GPUs, asks for enough
    virtual CPU devices for it: on an engine of one process per device (torch), only
    where `processes` (one run of `gpus` processes, which the run starts by relaunching
    itself: `train --gpus N`).

    Runs before the framework starts; NVML is the only thing consulted.
    """
    if gpus is not None and all(d.kind == "cpu" for d in devices_lib.list_devices()):
        backend = backends.current()
        virtual = backends.has(backend, "cpu_devices")
        if devices_lib.cpu_device_count() is None and (virtual or processes):
            needed = max(gpus) + 1 if isinstance(gpus, list) else max(gpus, 1)
            if needed > devices_lib.MAX_CPU_DEVICES:
                given = ",".join(map(str, gpus)) if isinstance(gpus, list) else gpus
                raise UsageError(f"--gpus: this machine has no GPU, and at most "
                                 f"{devices_lib.MAX_CPU_DEVICES} virtual CPU devices can stand "
                                 f"in for them. Received: --gpus {given}.")
            # As if given: the device list reads it, and torch starts that many processes.
            os.environ[devices_lib.CPU_DEVICES_ENV] = str(needed)
            if virtual:
                backend.configure_cpu_devices(needed)
            devices_lib.list_devices.cache_clear()
    try:
        devices_lib.select(gpus, devices_lib.list_devices())
    except ValueError as error:
        text = str(error).replace("Pass gpus=None", "Pass --gpus all")
        raise UsageError(f"--gpus: {text}") from None


# Held by the run that writes into an --output folder (see `_claimed`).
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
    parser.add_argument("--seed", type=_seed, default=defaults.seed, help="random seed")
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


def cmd_train(args):
    _needs_experiment(args.command)
    config = _config(args, args.gpus, args.output)
    _check_output(args.output, args.overwrite)
    _prepare_devices(args.gpus, processes=isinstance(args.gpus, int))
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


def build_parser():
    parser = _Parser(
        prog="keras-multigpu",
        description="Train Keras 3 models on every device of this machine.",
        epilog="Exit status: 0 done; 1 a run ended below --target-acc, or bench measured no "
               "setup; 2 a bad flag, data "
               "folder or --output; 130 stopped by Ctrl-C, 143 by SIGTERM (train and compare "
               "keep the epochs done: they write their files after every epoch); launch "
               "exits with the status of the process that failed.",
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
    bench.add_argument("--model", choices=["minigooglenet", "minigooglenet_nobn", "dense"],
                       default="minigooglenet",
                       help="the model timed (minigooglenet_nobn: without BatchNormalization)")
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
    # Optional for argparse, required by cmd_launch: argparse would name the optional `args`
    # as required too ("the following arguments are required: script, args").
    launch.add_argument("script", nargs="?", help="the Python script (or module, with -m)")
    launch.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    launch.set_defaults(func=cmd_launch)
    return parser


def _report(command, what, error):
    notes = [what, *getattr(error, "__notes__", ())]
    print(f"keras-multigpu {command}: " + "; ".join(notes), file=sys.stderr)


def main(argv=None):
    try:
        devices_lib.cpu_device_count()
    except ValueError as error:  # a bad KERAS_MULTIGPU_CPU_DEVICES, as a bad flag
        print(f"keras-multigpu: {error}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.log_info else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except KeyboardInterrupt as error:
        _report(args.command, "interrupted", error)
        signum = getattr(error, "signum", None)  # 143 after SIGTERM, as a shell reports it
        return EXIT_INTERRUPTED if signum is None else 128 + signum
    except (UsageError, OSError, ValueError, TypeError) as error:
        _report(args.command, f"error: {error}", error)
        return EXIT_USAGE
    except ImportError as error:  # a missing extra or backend: the message names it
        _report(args.command, f"error: {error}", error)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
