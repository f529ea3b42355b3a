"""Test set-up: the JAX backend with 8 virtual CPU devices.

Both variables must be set before Keras picks its backend and before JAX
starts, hence here, at the top of conftest. Tests take the first k devices
with `gpus=k`, so one process covers every device count from 1 to 8.

The torch engine runs one process per device instead. Under
KERAS_BACKEND=torch, a test whose `gpus` parameter (or `ranks` mark) is k > 1
runs whole in k forked processes joined by gloo, as `keras-multigpu launch
-n k` would run it (see `pytest_pyfunc_call`): every process makes the
test's own comparisons, and the test fails when any of them fails.
"""

import atexit
import functools
import os
import shutil
import tempfile

# XLA_FLAGS as the suite started (scripts/test.sh's speed flags for its JAX runs), before the
# library adds this process's device count and collective timeouts: `child_env` passes these on.
SUITE_XLA_FLAGS = os.environ.get("XLA_FLAGS", "")

os.environ.setdefault("KERAS_BACKEND", "jax")
if os.environ["KERAS_BACKEND"] != "torch":
    os.environ.setdefault("KERAS_MULTIGPU_CPU_DEVICES", "8")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import keras_multigpu as kmg  # noqa: E402

if keras.backend.backend() == "tensorflow" and os.environ.get(
        "KERAS_MULTIGPU_TEST_NO_GRAPPLER") == "1" and os.environ.get(
        "KERAS_MULTIGPU_TEST_FULL") != "1":
    # scripts/test.sh's engine contract on TensorFlow: TensorFlow's graph optimizer
    # (grappler) off, for time alone. Rewriting each small step's graph is much of a
    # TensorFlow test's time on the CPU, and an in-process comparison runs both sides under
    # the same options. The behaviour suite, and every run under FULL, keep it on.
    import tensorflow as tf

    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})

CIFAR_BATCH_FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


def synthetic_cifar(root, rows=16):
    """A CIFAR-10 folder in the dataset's own format (pickled batches of uint8 rows), with
    `rows` random images per batch file, for tests that need the format, not the images."""
    import pickle

    folder = os.path.join(str(root), "cifar-10-batches-py")
    os.makedirs(folder, exist_ok=True)
    for seed, name in enumerate(CIFAR_BATCH_FILES):
        rng = np.random.default_rng(seed)
        batch = {b"batch_label": name.encode(),
                 b"labels": [int(v) for v in rng.integers(0, 10, rows)],
                 b"data": rng.integers(0, 256, (rows, 3072), dtype=np.uint8)}
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump(batch, f, protocol=2)
    return folder


def child_env(drop=(), **extra):
    """os.environ for a child process that sets its own devices up: `drop`'s variables left
    out, and XLA_FLAGS as the suite started, without this process's device count and
    timeouts (the child adds its own), so that the suite's speed flags reach it too (unless
    `drop` names XLA_FLAGS)."""
    env = {k: v for k, v in os.environ.items() if k not in drop and k != "XLA_FLAGS"}
    if SUITE_XLA_FLAGS and "XLA_FLAGS" not in drop:
        env["XLA_FLAGS"] = SUITE_XLA_FLAGS
    env.update(extra)
    return env


@functools.cache
def cifar_dir():
    """A synthetic CIFAR-10 folder (`synthetic_cifar`, 40 images per batch file) made once per
    process and removed at exit: the tests of `train` and `compare` need the format, not the
    images, and never skip for want of the real dataset."""
    root = tempfile.mkdtemp(prefix="kmg-cifar-")
    atexit.register(shutil.rmtree, root, True)
    synthetic_cifar(root, rows=40)
    return root


@pytest.fixture
def dense_model():
    """A small model with no batch statistics: every result must be exact."""

    def build(seed=0, inputs=6, classes=3):
        keras.utils.set_random_seed(seed)
        return keras.Sequential(
            [
                keras.Input((inputs,)),
                keras.layers.Dense(8, activation="tanh"),
                keras.layers.Dense(classes, activation="softmax"),
            ]
        )

    return build


@pytest.fixture
def conv_bn_model():
    def build(seed=0):
        keras.utils.set_random_seed(seed)
        return keras.Sequential(
            [
                keras.Input((8, 8, 3)),
                keras.layers.Conv2D(4, 3, padding="same"),
                keras.layers.BatchNormalization(),
                keras.layers.ReLU(),
                keras.layers.GlobalAveragePooling2D(),
                keras.layers.Dense(3, activation="softmax"),
            ]
        )

    return build


def classification_data(n, features=6, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    shape = (n, features) if isinstance(features, int) else (n, *features)
    x = rng.normal(size=shape).astype("float32")
    y = keras.utils.to_categorical(rng.integers(0, classes, n), classes)
    return x, y


@functools.cache
def output_losses_follow_tracing():
    """Whether this Keras's own `<output>_loss` logs, on one device, weigh each batch by how
    its step was traced rather than by the data.

    Keras's per-output loss `Mean` weighs a batch by its static row count, None (weight 1)
    where the trace does not know it. The next Keras's TensorFlow trainer traces its first
    step on a concrete batch and retraces a partial one with the rows unknown: full batches
    then weigh their size and the partial one 1 (measured on 85 rows in batches of 25: 2.5368,
    against the per-batch mean 2.3016 that Keras 3.15.1 logs). That figure depends on the
    tracing, not on the data, and no split of the batch has it: those keys are not compared
    where this holds. Measured here, once, rather than assumed from a version.
    """
    if keras.backend.backend() != "tensorflow":
        return False
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(5)(inputs)
    model = keras.Model(inputs, {"a": keras.layers.Dense(1, name="a")(hidden),
                                 "b": keras.layers.Dense(1, name="b")(hidden)})
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss={"a": "mse", "b": "mse"})
    rng = np.random.default_rng(0)
    x, a, b = (rng.normal(size=(85, n)).astype("float32") for n in (4, 1, 1))
    logged = model.fit(x, {"a": a, "b": b}, batch_size=25, shuffle=False,
                       verbose=0).history["a_loss"][0]
    predicted = model.predict(x, batch_size=25, verbose=0)["a"]
    batch_means = [np.mean((predicted[s:s + 25] - a[s:s + 25]) ** 2) for s in range(0, 85, 25)]
    sample_mean = np.mean((predicted - a) ** 2)
    # Neither the per-batch mean (3.15.1) nor the data's own mean: a Keras that logs the
    # latter would be compared, and ours held to it.
    return not any(np.isclose(logged, value, rtol=1e-5)
                   for value in (np.mean(batch_means), sample_mean))


@pytest.fixture(scope="session", autouse=True)
def _output_losses_measured():
    """`output_losses_follow_tracing` measured before any test, so that its seed and fit
    happen in no test's middle."""
    output_losses_follow_tracing()


def comparable_keys(logs, model):
    """The keys of `logs` (one device's, of `model`) that ours must equal: all of them,
    less the `<output>_loss` keys of a model with several outputs where this Keras's own
    figure follows tracing (see `output_losses_follow_tracing`)."""
    names = getattr(model, "output_names", None) or []
    if len(names) < 2 or not output_losses_follow_tracing():
        return set(logs)
    return set(logs) - {f"{name}_loss" for name in names}


def stateful_model():
    """A stateful LSTM: its state keeps one row per sample of a fixed batch of 6."""
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((5, 3), batch_size=6),
                             keras.layers.LSTM(4, stateful=True, name="stateful_lstm"),
                             keras.layers.Dense(1)])


def assert_weights_close(a, b, atol=1e-5):
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        np.testing.assert_allclose(u, v, atol=atol, rtol=1e-5, err_msg=f"weight {i}")


TORCH_WORLD = 2  # the processes a torch test of the behaviour suite runs in


class PerProcess:
    """A fixture's value that each process of a torch test makes for itself (a wrapped
    model joins the processes, which exist only once the test forks them): `make()` runs on
    the first `get()` in a process, and `finish(value)`, if given, after the test there."""

    def __init__(self, make, finish=None):
        self._make, self.finish, self._made = make, finish, {}

    def get(self):
        if os.getpid() not in self._made:
            self._made[os.getpid()] = self._make()
        return self._made[os.getpid()]


def per_process(make, finish=None):
    """A fixture's value, made now, or by each process of a torch test (`PerProcess`)."""
    value = PerProcess(make, finish)
    return value if keras.backend.backend() == "torch" else value.get()


def _call(function, arguments):
    """Calls a test with its arguments, each `PerProcess` one made in this process."""
    made = {name: value.get() if isinstance(value, PerProcess) else value
            for name, value in arguments.items()}
    function(**made)
    for value in arguments.values():
        if isinstance(value, PerProcess) and value.finish is not None:
            value.finish(value.get())


ENGINES = ("jax", "tensorflow", "torch")  # the order the rotations count engines in
# The whole of every sweep that CI runs a rotation of (test_programs, `rotated`).
FULL = os.environ.get("KERAS_MULTIGPU_TEST_FULL") == "1"


def rotated(counts, cases, per_case=2):
    """(count, *case) parameters: each case at `per_case` of the device `counts`, rotated by
    case and engine, so that each engine meets every count and every case, and each case
    more counts across the engines. Every pair under KERAS_MULTIGPU_TEST_FULL=1 (the whole
    product: more time than CI spends)."""
    if FULL or per_case >= len(counts):
        return [(count, *case) for case in cases for count in counts]
    engine = ENGINES.index(keras.backend.backend())
    stride = len(counts) // per_case
    return [(counts[(i + engine + j * stride) % len(counts)], *case)
            for i, case in enumerate(cases) for j in range(per_case)]


def engine_gpus(gpus):
    """The devices a behaviour test wraps a model on: `gpus` on JAX and TensorFlow, which
    take any count of their virtual devices in one process; on torch, one process per
    device, the processes the test runs in (TORCH_WORLD, its module's `ranks` mark; one
    where a test is marked `ranks(1)`), unless it asks for one device."""
    if keras.backend.backend() == "torch" and gpus != 1:
        return int(os.environ.get("WORLD_SIZE", "1"))
    return gpus


def _world(item):
    """A test's processes: one for a `gpus` parameter of 1 (engine_gpus keeps it one
    device), else its `ranks` mark, else its `gpus` parameter, else one."""
    gpus = getattr(item, "funcargs", {}).get("gpus")
    if gpus == 1:
        return 1
    marker = item.get_closest_marker("ranks")
    if marker is not None:
        return marker.args[0]
    return gpus if isinstance(gpus, int) else 1


# The next Keras's run (scripts/test.sh): a case written for several device counts runs at its
# largest alone (the most uneven split, with a replica of one row or none); this Keras runs
# every count. KERAS_MULTIGPU_TEST_FULL=1 runs every count here too.
ONE_COUNT = os.environ.get("KERAS_MULTIGPU_TEST_ONE_COUNT") == "1" and not FULL


def pytest_collection_modifyitems(config, items):
    """Under ONE_COUNT, deselects each case's runs at all but its largest `gpus`."""
    if not ONE_COUNT:
        return

    def case(item):
        params = getattr(getattr(item, "callspec", None), "params", {})
        if not isinstance(params.get("gpus"), int):
            return None, None
        rest = tuple(sorted((name, repr(value)) for name, value in params.items()
                            if name != "gpus"))
        return (item.nodeid.split("[")[0], rest), params["gpus"]

    largest = {}
    for item in items:
        key, gpus = case(item)
        if key is not None:
            largest[key] = max(largest.get(key, gpus), gpus)
    kept, dropped = [], []
    for item in items:
        key, gpus = case(item)
        (dropped if key is not None and gpus < largest[key] else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "ranks(n): under the torch backend, run the test in n processes")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Under torch, runs a multi-device test in that many forked, gloo-joined processes."""
    if keras.backend.backend() != "torch":
        return None
    import _ranks

    arguments = {name: pyfuncitem.funcargs[name]
                 for name in pyfuncitem._fixtureinfo.argnames}
    world = _world(pyfuncitem)
    if world <= 1:
        _call(pyfuncitem.obj, arguments)
    else:
        _ranks.run(world, lambda: _call(pyfuncitem.obj, arguments))
    return True


__all__ = ["kmg", "classification_data", "assert_weights_close", "cifar_dir", "synthetic_cifar",
           "engine_gpus", "per_process", "PerProcess", "TORCH_WORLD", "rotated", "FULL", "ENGINES"]
