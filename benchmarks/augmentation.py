"""What on-device augmentation costs: training with it vs without, and the layer alone.

Runs `keras-multigpu train` with and without `--no-augment`, each in its own
process, interleaved over rounds, and compares the steady-state epoch time
(the first epoch, which compiles, is excluded). Then times `RandomShiftFlip`
alone, compiled, on one batch shape.

    python benchmarks/augmentation.py --rounds 2 --epochs 6 --width 0.25
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time


def train_once(args, augment, output):
    command = [sys.executable, "-m", "keras_multigpu.cli", "train", "--gpus", str(args.gpus),
               "--epochs", str(args.epochs), "--width", str(args.width),
               "--output", output, "--seed", "1"]
    if args.data_dir:
        command += ["--data-dir", args.data_dir]
    if not augment:
        command.append("--no-augment")
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, "KERAS_BACKEND": "jax"})
    with open(os.path.join(output, "history.json")) as f:
        return json.load(f)["mean_epoch_seconds"]


def layer_alone(batch, repeats=50):
    """RandomShiftFlip alone, jit-compiled, on data already on the device."""
    import jax
    import numpy as np

    from keras_multigpu.data import RandomShiftFlip

    layer = RandomShiftFlip(0.1, seed=0)
    images = np.random.default_rng(0).uniform(0, 255, (batch, 32, 32, 3)).astype("float32")
    images = jax.device_put(images, jax.devices()[0])
    step = jax.jit(lambda x: layer(x, training=True))
    step(images).block_until_ready()
    start = time.perf_counter()
    for _ in range(repeats):
        out = step(images)
    out.block_until_ready()
    return batch * repeats / (time.perf_counter() - start)


def host_pipeline(batch, batches=100):
    """The usual host pipeline alone: tf.data mapping Keras's RandomTranslation and
    RandomFlip over batches, in parallel, on the CPU. None without TensorFlow."""
    try:
        import tensorflow as tf
    except ImportError:
        return None
    import keras
    import numpy as np

    translate = keras.layers.RandomTranslation(0.1, 0.1, seed=0)
    flip = keras.layers.RandomFlip("horizontal", seed=0)

    def augment(x):  # each layer called alone: Keras runs it with TensorFlow in tf.data
        return flip(translate(x, training=True), training=True)

    images = np.random.default_rng(0).uniform(0, 255, (batch * 10, 32, 32, 3)).astype("float32")
    data = (tf.data.Dataset.from_tensor_slices(images).repeat().batch(batch)
            .map(augment, num_parallel_calls=tf.data.AUTOTUNE)
            .prefetch(tf.data.AUTOTUNE))
    iterator = iter(data)
    next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return batch * batches / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--width", type=float, default=0.25)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--output", default="benchmarks/results/cpu-2core/augmentation.json")
    args = parser.parse_args()
    seconds = {"with": [], "without": []}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for mode in ("with", "without"):
                value = train_once(args, mode == "with", os.path.join(tmp, f"{mode}{round_}"))
                seconds[mode].append(value)
                print(f"round {round_ + 1} {mode:>7} augmentation: {value:.2f} s/epoch", flush=True)
    ratio = statistics.median(seconds["with"]) / statistics.median(seconds["without"])
    os.environ.setdefault("KERAS_BACKEND", "jax")
    alone = layer_alone(64 * args.gpus)
    host = host_pipeline(64 * args.gpus)
    import jax

    device = jax.devices()[0]
    print(f"epoch time with / without augmentation: {ratio:.3f} (target <= 1.05)")
    print(f"on the device ({device.platform}): RandomShiftFlip alone, jit-compiled, "
          f"batch {64 * args.gpus}: {alone:.0f} images/s")
    if host is None:
        print("on the host: skipped, tensorflow is not installed")
    else:
        print(f"on the host (CPU): tf.data + RandomTranslation + RandomFlip, "
              f"batch {64 * args.gpus}: {host:.0f} images/s")
    from keras_multigpu._io import write_json

    write_json(args.output, {
        "command": " ".join(sys.argv), "seconds_per_epoch": seconds, "ratio": ratio,
        "device_augmentation_images_per_second": {"device": str(device),
                                                  "images_per_second": alone},
        "host_pipeline_images_per_second": host,
        "machine": {"platform": platform.platform(), "cores": os.cpu_count()}})


if __name__ == "__main__":
    main()
