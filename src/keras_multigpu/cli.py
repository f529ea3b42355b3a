"""The `keras-multigpu` command: `devices`, `train` and `compare`."""

import argparse
import dataclasses
import json
import logging
import os
import sys

from keras_multigpu import backends
from keras_multigpu import devices as devices_lib
from keras_multigpu._io import write_json


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


def _gpu_list(text):
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected counts like 1,2,4; got {text!r}")
    return counts


def _prepare_devices(count):
    """On a machine without GPUs, asks for `count` virtual CPU devices.

    Runs before the framework starts; NVML is the only thing consulted.
    """
    if count and all(d.kind == "cpu" for d in devices_lib.list_devices()):
        if devices_lib.cpu_device_count() is None:
            backends.current().configure_cpu_devices(count)
            devices_lib.list_devices.cache_clear()


def _add_training_flags(parser):
    from keras_multigpu.experiment import Config

    defaults = Config()
    parser.add_argument("--output", default=defaults.output, help="directory for the results")
    parser.add_argument("--epochs", type=_positive_int, default=defaults.epochs)
    parser.add_argument("--data-dir", default=None,
                        help="CIFAR-10 (cifar-10-batches-py or its parent); "
                             "else $KERAS_MULTIGPU_DATA, then Keras's cache")
    parser.add_argument("--limit", type=_positive_int, default=None,
                        help="use at most this many training and test images")
    parser.add_argument("--width", type=float, default=defaults.width,
                        help="MiniGoogLeNet width multiplier (1.0 = the paper's)")
    parser.add_argument("--batch-per-device", type=_positive_int,
                        default=defaults.batch_per_device)
    parser.add_argument("--lr", type=float, default=defaults.lr, help="initial learning rate")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--no-augment", dest="augment", action="store_false")
    parser.add_argument("--precision", default=defaults.precision,
                        choices=["float32", "mixed_bfloat16", "mixed_float16"])
    parser.add_argument("--target-acc", type=float, default=None,
                        help="exit with status 1 if the final validation accuracy is lower")


def _config(args, gpus, output):
    from keras_multigpu.experiment import Config

    fields = {f.name for f in dataclasses.fields(Config)}
    values = {k: v for k, v in vars(args).items() if k in fields}
    return Config(**{**values, "gpus": gpus, "output": output})


def cmd_devices(args):
    found = devices_lib.list_devices()
    if args.json:
        print(json.dumps([dataclasses.asdict(d) for d in found], indent=2))
        return 0
    for d in found:
        memory = f"{d.memory_bytes / 2**30:.1f} GiB" if d.memory_bytes else "-"
        print(f"{str(d):8} {d.name:32} {memory}")
    return 0


def _check_target(accuracy, target):
    if target is not None and (accuracy is None or accuracy < target):
        print(f"FAILED: final validation accuracy {accuracy} is below --target-acc {target}",
              file=sys.stderr)
        return 1
    return 0


def cmd_train(args):
    _prepare_devices(args.gpus)
    from keras_multigpu import experiment

    summary = experiment.run(_config(args, args.gpus, args.output))
    print(experiment.summary_line(summary))
    return _check_target(summary["final_val_accuracy"], args.target_acc)


def cmd_compare(args):
    _prepare_devices(max(args.gpus))
    from keras_multigpu import experiment, plots

    runs = []
    for count in args.gpus:
        output = os.path.join(args.output, f"gpus-{count}")
        summary = experiment.run(_config(args, count, output))
        print(experiment.summary_line(summary))
        with open(os.path.join(output, "history.json")) as f:
            runs.append((summary, json.load(f)["epochs"]))
    base = runs[0][0]["mean_epoch_seconds"]
    print(f"\n{'devices':>7} {'s/epoch':>9} {'img/s':>9} {'speed-up':>9} {'val_acc':>8}")
    for summary, _ in runs:
        print(f"{len(summary['devices']):>7} {summary['mean_epoch_seconds']:>9.2f} "
              f"{summary['images_per_second']:>9.0f} "
              f"{base / summary['mean_epoch_seconds']:>9.2f} "
              f"{summary['final_val_accuracy']:>8.4f}")
    plots.comparison(runs, os.path.join(args.output, "compare.png"))
    write_json(os.path.join(args.output, "compare.json"),
                                 [summary for summary, _ in runs])
    return max(_check_target(s["final_val_accuracy"], args.target_acc) for s, _ in runs)


def cmd_bench(args):
    from keras_multigpu import bench

    if args.setups:
        setups = [bench.parse(name) for name in args.setups.split(",") if name.strip()]
    else:
        found = devices_lib.list_devices()
        count = args.devices or (len(found) if found[0].kind == "gpu" else 2)
        setups = bench.default_setups(count)
    spec = bench.spec(model=args.model, width=args.width, samples=args.samples,
                      epochs=args.epochs, batch_per_device=args.batch_per_device,
                      precision=args.precision, fit_calls=args.fit_calls,
                      fit_epochs=args.fit_epochs)
    results = bench.run(setups, spec, rounds=args.rounds, output=args.output,
                        timeout=args.timeout, step_ms=args.step_ms)
    print(bench.format_table(results))
    return 0


def build_parser():
    parser = argparse.ArgumentParser(
        prog="keras-multigpu",
        description="Train Keras 3 models on every device of this machine.",
    )
    parser.add_argument("-v", "--verbose", dest="log_info", action="store_true",
                        help="log more (the progress bar is always shown)")
    sub = parser.add_subparsers(dest="command", required=True)

    devices = sub.add_parser("devices", help="list the devices (starts no framework)")
    devices.add_argument("--json", action="store_true")
    devices.set_defaults(func=cmd_devices)

    train = sub.add_parser("train", help="the MiniGoogLeNet CIFAR-10 experiment")
    train.add_argument("--gpus", type=_positive_int, default=None,
                       help="devices to use (default: all; on a CPU-only machine, "
                            "this many virtual CPU devices)")
    _add_training_flags(train)
    train.set_defaults(func=cmd_train)

    compare = sub.add_parser("compare", help="the experiment at several device counts")
    compare.add_argument("--gpus", type=_gpu_list, default=[1, 2], help="e.g. 1,2,4")
    _add_training_flags(compare)
    compare.set_defaults(func=cmd_compare)

    bench = sub.add_parser("bench", help="throughput of ours, plain Keras and the peers")
    bench.add_argument("--setups", default=None,
                       help="e.g. plain-1,ours-1,ours-2,dataparallel-2,mirrored-2 "
                            "(default: all at 1..--devices)")
    bench.add_argument("--devices", type=_positive_int, default=None,
                       help="largest device count (default: all GPUs, or 2 virtual CPUs)")
    bench.add_argument("--model", choices=["minigooglenet", "dense"], default="minigooglenet")
    bench.add_argument("--width", type=float, default=0.25)
    bench.add_argument("--samples", type=_positive_int, default=2048)
    bench.add_argument("--epochs", type=_positive_int, default=3, help="timed epochs per run")
    bench.add_argument("--batch-per-device", type=_positive_int, default=64)
    bench.add_argument("--fit-calls", type=_count, default=3,
                       help="whole fit calls timed after the warm-up fit (0: none)")
    bench.add_argument("--fit-epochs", type=_positive_int, default=1,
                       help="epochs per timed fit call")
    bench.add_argument("--rounds", type=_positive_int, default=3)
    bench.add_argument("--precision", default="float32",
                       choices=["float32", "mixed_bfloat16", "mixed_float16"])
    bench.add_argument("--step-ms", type=float, default=None,
                       help="project scaling from this one-device step time instead")
    bench.add_argument("--timeout", type=float, default=900, help="seconds per worker")
    bench.add_argument("--output", default="runs/bench")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.log_info else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError, TypeError) as error:
        print(f"keras-multigpu {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
