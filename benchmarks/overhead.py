"""Training-throughput overhead of `multi_gpu_model` against plain Keras.

Measures the steady-state training throughput (images/s) of a small convnet
in four configurations, each in a fresh subprocess (JAX fixes the device
count per process), interleaved over `--rounds` rounds (A, B, C, D, A, ...):

    plain-1         plain `model.fit` on one device (no virtual devices)
    ours-1          `multi_gpu_model(model, gpus=1)`, KERAS_MULTIGPU_CPU_DEVICES=1
    dataparallel-2  `keras.distribution.DataParallel` on 2 devices; the model
                    is built, compiled and fit inside `distribution.scope()`
    ours-2          `multi_gpu_model(model, gpus=2)`, KERAS_MULTIGPU_CPU_DEVICES=2

Each worker trains on synthetic data (fixed seed) with a global batch of
`--batch-per-device` x devices, runs one warm-up epoch (its wall time minus a
steady epoch is reported as compile time), then times `--epochs` epochs with a
callback (which also counts the XLA compilations inside each epoch: a
non-zero count means the warm-up did not reach the steady state); throughput =
samples / median epoch time, so prefer `--epochs 3` or more. The sample count is
rounded down to a multiple of every global batch, so no batch is partial and
every configuration does identical work. Without a GPU, devices are virtual
CPU devices sharing the host's cores.

Run from the repository root:
    python benchmarks/overhead.py --model minigooglenet --width 0.25 --rounds 3 --epochs 3

It prints a table and the ratios ours-1/plain-1, ours-2/dataparallel-2 and
ours-2/ours-1, and writes every raw figure to `--output` as JSON.
"""

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time

CONFIGS = (("plain-1", 1), ("ours-1", 1), ("dataparallel-2", 2), ("ours-2", 2))
RATIOS = (
    ("ours-1", "plain-1", 0.97), ("ours-2", "dataparallel-2", 0.95), ("ours-2", "ours-1", None)
)
XLA_DEVICE_FLAG = "--xla_force_host_platform_device_count"
DEFAULT_OUTPUT = os.path.join(os.path.dirname(__file__), "results", "cpu-2core", "overhead.json")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", choices=("small", "minigooglenet"), default="small")
    p.add_argument("--width", type=float, default=0.25, help="mini_googlenet width")
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--epochs", type=int, default=2, help="timed epochs per run")
    p.add_argument("--batch-per-device", type=int, default=64)
    p.add_argument("--timeout", type=float, default=600, help="seconds per worker")
    p.add_argument("--output", default=DEFAULT_OUTPUT)
    p.add_argument("--worker", choices=[name for name, _ in CONFIGS], help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- worker (one configuration, in its own process) -------------------------


def run_worker(args):
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import jax
    import keras
    import numpy as np

    import keras_multigpu as kmg
    from keras_multigpu.models import minigooglenet

    devices = dict(CONFIGS)[args.worker]
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(args.samples, 32, 32, 3)).astype("float32")
    y = keras.utils.to_categorical(rng.integers(0, 10, size=args.samples), 10).astype("float32")
    batch = args.batch_per_device * devices
    compiles = []  # seconds of every XLA compilation in this process

    def on_event(event, seconds, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(on_event)

    class EpochTimer(keras.callbacks.Callback):
        """Wall time per epoch, and the XLA compilations that fell inside it."""

        def __init__(self):
            super().__init__()
            self.times, self.compiles, self.compile_s = [], [], []

        def on_epoch_begin(self, epoch, logs=None):
            self._seen = len(compiles)
            self._start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.times.append(time.perf_counter() - self._start)
            self.compiles.append(len(compiles) - self._seen)
            self.compile_s.append(sum(compiles[self._seen :]))

    scope = contextlib.nullcontext()
    if args.worker == "dataparallel-2":  # Keras's docs: create the model inside the scope
        scope = keras.distribution.DataParallel(devices=jax.devices()[:devices]).scope()
    with scope:
        if args.model == "small":
            model = minigooglenet.small_convnet()
        else:
            model = minigooglenet.mini_googlenet(width=args.width)
        if args.worker.startswith("ours"):
            model = kmg.multi_gpu_model(model, gpus=devices)
        model.compile(
            optimizer=keras.optimizers.SGD(learning_rate=0.01, momentum=0.9),
            loss="categorical_crossentropy",
        )
        warm, timer = EpochTimer(), EpochTimer()
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0, callbacks=[warm])
        model.fit(x, y, batch_size=batch, epochs=args.epochs, verbose=0, callbacks=[timer])

    epoch_s = statistics.median(timer.times)
    result = {
        "config": args.worker, "devices": devices, "visible_devices": len(jax.devices()),
        "device_platform": jax.devices()[0].platform, "global_batch": batch,
        "samples": args.samples, "epoch_times_s": timer.times,
        "xla_compiles_per_epoch": timer.compiles, "xla_compile_s_per_epoch": timer.compile_s,
        "warmup_epoch_s": warm.times[0], "warmup_xla_compiles": warm.compiles[0],
        "compile_s": warm.times[0] - epoch_s,  # warm-up epoch minus a steady one
        "images_per_s": args.samples / epoch_s,
    }
    print(json.dumps(result), flush=True)


# -- parent -----------------------------------------------------------------


def worker_env(name, devices):
    env = dict(os.environ, KERAS_BACKEND="jax")
    env.pop("KERAS_MULTIGPU_CPU_DEVICES", None)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(XLA_DEVICE_FLAG)]
    if name.startswith("ours"):
        env["KERAS_MULTIGPU_CPU_DEVICES"] = str(devices)
    elif devices > 1:
        flags.append(f"{XLA_DEVICE_FLAG}={devices}")
    env["XLA_FLAGS"] = " ".join(flags)
    return env


def run_config(name, devices, args):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", name]
    for flag in ("model", "width", "samples", "epochs", "batch_per_device"):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    env = worker_env(name, devices)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    for line in reversed(proc.stdout.splitlines()):
        try:
            result = json.loads(line) if line.startswith("{") else None
        except json.JSONDecodeError:
            continue
        if result and result.get("config") == name:
            if result["visible_devices"] < devices:
                raise RuntimeError(f"{name}: only {result['visible_devices']} device(s)")
            return result
    raise RuntimeError(f"{name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def machine():
    names = []
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
    versions = {}
    for dist in ("keras", "jax", "jaxlib", "numpy"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    return {
        "platform": platform.platform(), "cpu_model": names[0] if names else platform.processor(),
        "cpu_count": os.cpu_count(), "python": platform.python_version(), **versions,
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
    }


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return run_worker(args)
    step = args.batch_per_device * max(d for _, d in CONFIGS)
    args.samples = args.samples // step * step
    if args.samples == 0:
        sys.exit(f"--samples must be at least {step} (the largest global batch)")
    runs = {name: [] for name, _ in CONFIGS}
    for r in range(args.rounds):
        for name, devices in CONFIGS:
            load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
            result = dict(run_config(name, devices, args), load_avg_1min_before=load)
            runs[name].append(result)
            print(f"round {r + 1}/{args.rounds} {name:15s} {result['images_per_s']:9.1f} img/s"
                  f"  compile {result['compile_s']:5.1f} s  epochs "
                  + " ".join(f"{t:.2f}" for t in result["epoch_times_s"]) + " s  XLA compiles"
                  f" in timed epochs {result['xla_compiles_per_epoch']}", flush=True)
    summary = {}
    for name, devices in CONFIGS:
        ips = [run["images_per_s"] for run in runs[name]]
        summary[name] = {
            "devices": devices, "median_images_per_s": statistics.median(ips),
            "min_images_per_s": min(ips), "max_images_per_s": max(ips),
            "median_compile_s": statistics.median(run["compile_s"] for run in runs[name]),
        }
    ratios = {}
    for num, den, target in RATIOS:
        value = summary[num]["median_images_per_s"] / summary[den]["median_images_per_s"]
        per_round = [a["images_per_s"] / b["images_per_s"] for a, b in zip(runs[num], runs[den])]
        met = None if target is None else value >= target
        ratios[f"{num} / {den}"] = dict(median_ratio=value, per_round=per_round,
                                        target=target, meets_target=met)

    print(f"\n{'config':15s} {'devices':>7s} {'median img/s':>12s} {'min':>9s} {'max':>9s} "
          f"{'compile s':>9s}")
    for name, s in summary.items():
        print(f"{name:15s} {s['devices']:7d} {s['median_images_per_s']:12.1f} "
              f"{s['min_images_per_s']:9.1f} {s['max_images_per_s']:9.1f} "
              f"{s['median_compile_s']:9.1f}")
    print()
    for label, r in ratios.items():
        goal = "" if r["target"] is None else (
            f"  (target >= {r['target']}: {'met' if r['meets_target'] else 'NOT met'})")
        rounds = ", ".join(f"{v:.3f}" for v in r["per_round"])
        print(f"{label:24s} {r['median_ratio']:.3f}{goal}  per round: {rounds}")

    report = {
        "command": [os.path.basename(sys.executable), *sys.argv],
        "settings": {k: v for k, v in vars(args).items() if k != "worker"},
        "machine": machine(),
        "device_platforms": sorted({run["device_platform"] for r in runs.values() for run in r}),
        "runs": runs, "summary": summary, "ratios": ratios,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
