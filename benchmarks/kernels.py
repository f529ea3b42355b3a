"""MiniGoogLeNet's convolutions alone: XLA (JAX) against TensorFlow's kernels, same machine.

Explains a figure of the bench: on a CPU, plain TensorFlow on one device can
outrun every JAX engine, because its convolutions (oneDNN) and XLA:CPU's are
different code. Each framework runs in its own process, one device, and times
every Conv2D of the model (shapes read from the Keras model) forward, and
forward plus both gradients, compiled, on the model's batch.

    python benchmarks/kernels.py --width 1.0 --batch 64
"""

import argparse
import json
import os
import subprocess
import sys
import time


def conv_shapes(width, batch):
    import keras

    from keras_multigpu import models

    model = models.mini_googlenet(width=width)
    return [{"name": layer.name, "input": [batch, *layer.input.shape[1:]],
             "kernel": list(layer.kernel.shape), "strides": list(layer.strides),
             "padding": layer.padding.upper()}
            for layer in model._flatten_layers() if isinstance(layer, keras.layers.Conv2D)]


def _time(function, args, block, repeats):
    block(function(*args))  # compiles
    start = time.perf_counter()
    for _ in range(repeats):
        out = function(*args)
    block(out)
    return 1000 * (time.perf_counter() - start) / repeats


def time_jax(shape, repeats):
    import jax
    import numpy as np

    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, shape["strides"], shape["padding"],
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))

    rng = np.random.default_rng(0)
    x = jax.numpy.asarray(rng.random(shape["input"], dtype="float32"))
    w = jax.numpy.asarray(rng.random(shape["kernel"], dtype="float32"))
    forward = jax.jit(conv)
    both = jax.jit(jax.grad(lambda x, w: conv(x, w).sum(), argnums=(0, 1)))
    return (_time(forward, (x, w), jax.block_until_ready, repeats),
            _time(both, (x, w), jax.block_until_ready, repeats))


def time_tensorflow(shape, repeats):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = tf.constant(rng.random(shape["input"], dtype="float32"))
    w = tf.constant(rng.random(shape["kernel"], dtype="float32"))

    @tf.function
    def forward(x, w):
        return tf.nn.conv2d(x, w, shape["strides"], shape["padding"])

    @tf.function
    def both(x, w):
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            y = tf.reduce_sum(tf.nn.conv2d(x, w, shape["strides"], shape["padding"]))
        return tape.gradient(y, [x, w])

    def block(out):
        tf.nest.map_structure(lambda t: t.numpy(), out)

    return _time(forward, (x, w), block, repeats), _time(both, (x, w), block, repeats)


def worker(framework, shapes, repeats):
    timer = time_jax if framework == "jax" else time_tensorflow
    return [dict(zip(("forward_ms", "forward_backward_ms"), timer(s, repeats))) for s in shapes]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=float, default=1.0)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--output", default="benchmarks/results/cpu-2core/kernels.json")
    parser.add_argument("--worker", choices=["jax", "tensorflow"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        shapes = json.loads(sys.stdin.read())
        print(json.dumps(worker(args.worker, shapes, args.repeats)))
        return
    os.environ.setdefault("KERAS_BACKEND", "jax")
    shapes = conv_shapes(args.width, args.batch)
    times = {}
    for framework in ("jax", "tensorflow"):
        env = {**os.environ, "KERAS_BACKEND": framework,
               "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
        out = subprocess.run([sys.executable, __file__, "--worker", framework,
                              "--repeats", str(args.repeats)], input=json.dumps(shapes),
                             capture_output=True, text=True, env=env, check=True).stdout
        times[framework] = json.loads(out.strip().splitlines()[-1])
    total = {f: {k: sum(t[k] for t in times[f]) for k in times[f][0]} for f in times}
    print(f"{'layer':28}{'input':>20}{'XLA fwd':>9}{'TF fwd':>8}{'XLA f+b':>9}{'TF f+b':>8}")
    for i, shape in enumerate(shapes):
        j, t = times["jax"][i], times["tensorflow"][i]
        print(f"{shape['name']:28}{str(shape['input'][1:]):>20}{j['forward_ms']:>9.1f}"
              f"{t['forward_ms']:>8.1f}{j['forward_backward_ms']:>9.1f}"
              f"{t['forward_backward_ms']:>8.1f}")
    ratio = total["jax"]["forward_backward_ms"] / total["tensorflow"]["forward_backward_ms"]
    print(f"all {len(shapes)} convolutions, forward + backward: XLA "
          f"{total['jax']['forward_backward_ms']:.0f} ms, TensorFlow "
          f"{total['tensorflow']['forward_backward_ms']:.0f} ms per batch of {args.batch} "
          f"(XLA / TF = {ratio:.2f})")
    from keras_multigpu._io import write_json
    from keras_multigpu.bench.harness import machine

    write_json(args.output, {"command": " ".join(sys.argv), "width": args.width,
                             "batch": args.batch, "layers": shapes, "times": times,
                             "total_ms": total, "xla_over_tensorflow": ratio,
                             "machine": machine()})


if __name__ == "__main__":
    main()
