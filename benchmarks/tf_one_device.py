"""What tf.distribute costs on one device: plain Keras `fit` on TensorFlow against the same
`fit` under OneDeviceStrategy and under MirroredStrategy over that one device (Keras's
guide's set-up), and against `multi_gpu_model(model, gpus=1)`, which runs a
MirroredStrategy. Each in its own process; MiniGoogLeNet, 3 timed epochs after a warm-up.

    KERAS_BACKEND=tensorflow python benchmarks/tf_one_device.py [--width 0.25] [--out FILE]
"""

import argparse
import contextlib
import json
import os
import sys
import time

import _children

KINDS = ("plain", "one_device_strategy", "mirrored_strategy", "ours")


def child(kind, width, samples, batch):
    import numpy as np
    import tensorflow as tf

    import keras_multigpu as kmg
    from keras_multigpu import models

    rng = np.random.default_rng(0)
    x = rng.uniform(0, 255, (samples, 32, 32, 3)).astype("float32")
    y = np.eye(10, dtype="float32")[rng.integers(0, 10, samples)]
    device = "/cpu:0" if not tf.config.list_physical_devices("GPU") else "/gpu:0"
    strategy = {"one_device_strategy": lambda: tf.distribute.OneDeviceStrategy(device),
                "mirrored_strategy": lambda: tf.distribute.MirroredStrategy([device])}.get(kind)
    scope = strategy().scope() if strategy else contextlib.nullcontext()
    with scope:
        model = models.mini_googlenet(width=width)
        if kind == "ours":
            model = kmg.multi_gpu_model(model, gpus=1)
        model.compile(optimizer="sgd", loss="categorical_crossentropy", metrics=["accuracy"])
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0)  # compiles
    start = time.perf_counter()
    model.fit(x, y, batch_size=batch, epochs=3, verbose=0)
    return {"kind": kind, "images_per_second": 3 * samples / (time.perf_counter() - start)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=float, default=0.25)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    parser.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _children.report(child(args.child, args.width, args.samples, args.batch))
        return 0
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2")
    rows = _children.run(__file__, KINDS, ["--width", args.width, "--samples", args.samples,
                                           "--batch", args.batch], env)
    plain = rows[0]["images_per_second"]
    print(f"{'fit on one device':22}{'images/s':>10}{'x plain':>9}")
    for row in rows:
        row["over_plain"] = row["images_per_second"] / plain
        print(f"{row['kind']:22}{row['images_per_second']:>10.1f}{row['over_plain']:>9.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"width": args.width, "samples": args.samples, "batch": args.batch,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
