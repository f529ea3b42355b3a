"""The step path: every library function one `fit` call runs, with its lines and files.

Issue 23's target: the step path of each engine (every function a training step passes
through, from `fit` to the engine and back) is at most 700 lines in at most 6 files. This
measures it rather than estimating it: Python's profiler hook records each function of the
`keras_multigpu` package that runs during one `fit` call (two epochs of a small model with
BatchNormalization and dropout, a batch that divides neither the device count nor the data,
sample weights, a metric and validation), after the model is wrapped and compiled. A file's
lines are the distinct source lines of its functions that ran (`inspect.getsourcelines` for a
function; for a comprehension, generator expression or lambda, the lines its code spans), each
line counted once however often it runs and however many functions nest it; a traced step
(JAX, TensorFlow) runs its Python once, while it is traced.

    KERAS_BACKEND=jax python benchmarks/step_path.py          # 2 virtual devices
    KERAS_BACKEND=tensorflow python benchmarks/step_path.py
    KERAS_BACKEND=torch keras-multigpu launch -n 2 benchmarks/step_path.py

Process 0 prints one table: each file's functions and lines, then the totals.
"""

import collections
import inspect
import os
import sys

if os.environ.get("KERAS_BACKEND") != "torch":
    os.environ.setdefault("KERAS_MULTIGPU_CPU_DEVICES", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_multigpu as kmg  # noqa: E402
from keras_multigpu import processes  # noqa: E402

PACKAGE = os.path.dirname(kmg.__file__)


def model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(8),
        keras.layers.BatchNormalization(),
        keras.layers.Dropout(0.2),
        keras.layers.Dense(3, activation="softmax"),
    ])


def main():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(45, 6)).astype("float32")
    y = keras.utils.to_categorical(rng.integers(0, 3, 45), 3)
    weights = rng.uniform(0.5, 1.5, 45).astype("float32")
    parallel = kmg.multi_gpu_model(model(), gpus=2)
    parallel.compile(optimizer="adam", loss="categorical_crossentropy", metrics=["accuracy"])
    seen = set()

    def record(frame, event, _):
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            seen.add(frame.f_code)

    sys.setprofile(record)
    threading_profile(record)
    try:
        parallel.fit(x, y, sample_weight=weights, batch_size=7, epochs=2,
                     validation_split=0.2, verbose=0)
    finally:
        sys.setprofile(None)
        threading_profile(None)
    functions = collections.Counter()
    lines = collections.defaultdict(set)
    for code in seen:
        if code.co_name == "<module>":
            continue
        try:
            span = source_lines(code)
        except (OSError, TypeError):
            continue
        name = os.path.relpath(code.co_filename, PACKAGE)
        functions[name] += 1
        lines[name].update(span)
    files = {name: (functions[name], len(lines[name])) for name in functions}
    if processes.rank() != 0:
        return
    print(f"The step path on {keras.backend.backend()} ({parallel.num_replicas} devices): "
          "library functions one fit call runs")
    print(f"{'file':40} {'functions':>9} {'lines':>6}")
    for name, (functions, lines) in sorted(files.items(), key=lambda item: -item[1][1]):
        print(f"{name:40} {functions:9d} {lines:6d}")
    print(f"{'total: ' + str(len(files)) + ' files':40} "
          f"{sum(f for f, _ in files.values()):9d} {sum(n for _, n in files.values()):6d}")


def source_lines(code):
    """The line numbers of a function's source, or of the lines a nested expression spans.

    A generator expression, comprehension or lambda has no block of its own:
    `inspect.getsourcelines` would read on from its first line to the end of whatever block
    holds it, so it is measured by its own code's line table instead. Its lines lie inside
    the function that made it, so the union counts them once.
    """
    if code.co_name.startswith("<"):
        numbers = [line for _, _, line in code.co_lines() if line]
        return range(min(numbers + [code.co_firstlineno]), max(numbers) + 1)
    source, start = inspect.getsourcelines(code)
    return range(start, start + len(source))


def threading_profile(function):
    """The same hook in threads started from now on (Keras's data workers, TF's)."""
    import threading

    threading.setprofile(function)


if __name__ == "__main__":
    main()
