"""Where a TensorFlow `fit` call's time goes outside its steps: ours against MirroredStrategy.

Each fit call (2 epochs of MiniGoogLeNet, batch 128 over 2 logical CPU devices) is split,
from callback times, into its steps (`on_train_batch_begin` to `_end`), the wait before an
epoch's first step (`on_epoch_begin` to the first `on_train_batch_begin`: Keras makes the
epoch's iterator there and drops the last one) and the wait after the last epoch
(`on_train_end` to `fit` returning: the last iterator is dropped). Each setup runs in its
own process, 3 calls after the first (which traces).

    KERAS_BACKEND=tensorflow python benchmarks/tf_epoch_gaps.py [--width 0.25] [--out FILE]
"""

import argparse
import json
import os
import sys
import time

import _children

KINDS = ("ours", "mirrored")


def child(kind, width, samples, calls):
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_multigpu as kmg
    from keras_multigpu import models

    rng = np.random.default_rng(0)
    x = rng.uniform(0, 255, (samples, 32, 32, 3)).astype("float32")
    y = np.eye(10, dtype="float32")[rng.integers(0, 10, samples)]
    if kind == "ours":
        model = kmg.multi_gpu_model(models.mini_googlenet(width=width), gpus=2)
    else:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        with strategy.scope():
            model = models.mini_googlenet(width=width)
    with model.distribute_strategy.scope():
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                      loss="categorical_crossentropy", metrics=["accuracy"])
    times = []

    class Times(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            times.append(("epoch", time.perf_counter()))

        def on_train_batch_begin(self, batch, logs=None):
            times.append(("begin", time.perf_counter()))

        def on_train_batch_end(self, batch, logs=None):
            times.append(("end", time.perf_counter()))

        def on_train_end(self, logs=None):
            times.append(("train_end", time.perf_counter()))

    rows = []
    for call in range(calls + 1):
        times.clear()
        start = time.perf_counter()
        model.fit(x, y, batch_size=128, epochs=2, verbose=0, callbacks=[Times()])
        stop = time.perf_counter()
        steps = sum(t - times[i - 1][1] for i, (name, t) in enumerate(times)
                    if name == "end")
        epoch_waits = [times[i + 1][1] - t for i, (name, t) in enumerate(times)
                       if name == "epoch"]
        if call:  # the first call traces the step
            rows.append({"call_s": stop - start, "steps_s": steps,
                         "epoch_begin_waits_s": epoch_waits,
                         "after_train_end_s": stop - times[-1][1]})
    return {"kind": kind, "width": width, "samples": samples, "calls": rows}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=float, default=0.25)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    parser.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _children.report(child(args.child, args.width, args.samples, args.calls))
        return 0
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2",
               KERAS_MULTIGPU_CPU_DEVICES="2")
    results = _children.run(__file__, KINDS, ["--width", args.width, "--samples",
                                              args.samples, "--calls", args.calls], env)
    print(f"{'setup':9} {'call s':>7} {'steps s':>8} {'epoch-begin waits s':>20} "
          f"{'after end s':>12}")
    for result in results:
        for row in result["calls"]:
            waits = " ".join(f"{w:.2f}" for w in row["epoch_begin_waits_s"])
            print(f"{result['kind']:9} {row['call_s']:7.2f} {row['steps_s']:8.2f} "
                  f"{waits:>20} {row['after_train_end_s']:12.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
