"""Faults, each real: a SIGINT or SIGTERM sent to a training process, a CPU hog beside a
2-device fit."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import child_env

pytestmark = pytest.mark.slow  # several processes or whole runs: not in the fast loop

TRAIN = textwrap.dedent(
    r"""
    import os, sys, time
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ["KERAS_MULTIGPU_CPU_DEVICES"] = "2"
    import keras, numpy as np
    import keras_multigpu as kmg

    workdir = sys.argv[1]
    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
    y = (x[:, :1] > 0).astype("float32")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1, activation="sigmoid")])
    parallel = kmg.multi_gpu_model(model, gpus=2)
    parallel.compile(optimizer="sgd", loss="binary_crossentropy")

    class Slow(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            time.sleep(0.05)  # slow steps: the signal lands mid-epoch

        def on_epoch_end(self, epoch, logs=None):
            open(os.path.join(workdir, f"epoch-{epoch}"), "w").close()

    ended = []
    class Ends(keras.callbacks.Callback):
        def on_train_end(self, logs=None):
            ended.append(True)

    callbacks = [
        Slow(), Ends(),
        keras.callbacks.ModelCheckpoint(os.path.join(workdir, "last.keras")),
        keras.callbacks.BackupAndRestore(os.path.join(workdir, "backup")),
    ]
    try:
        parallel.fit(x, y, batch_size=5, epochs=1000, verbose=0, callbacks=callbacks)
    except KeyboardInterrupt as error:
        print("INTERRUPTED", type(error).__name__, "ended" if ended else "not-ended",
              flush=True)
        sys.exit(3)
    print("FINISHED", flush=True)
    """
)


def _sigint_default():
    """Ctrl-C as in a terminal: a test run started in the background (`cmd &`) ignores SIGINT,
    and its children would inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(tmp_path):
    env = child_env()
    return subprocess.Popen(
        [sys.executable, "-c", TRAIN, str(tmp_path)], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=env, preexec_fn=_sigint_default,
    )


def _wait_for(path, process, timeout=120):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if process.poll() is not None:
            pytest.fail(f"training exited early: {process.communicate()[1][-3000:]}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"{path} never appeared")
        time.sleep(0.1)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_first_ctrl_c_stops_at_a_step_boundary_and_keeps_the_files(tmp_path, signum):
    """Ctrl-C, or the SIGTERM a scheduler sends before it takes the machine back."""
    process = _start(tmp_path)
    _wait_for(tmp_path / "epoch-1", process)
    time.sleep(0.3)  # mid-epoch
    process.send_signal(signum)
    try:
        out, err = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"a {signum.name} did not stop fit within 60 s")
    assert process.returncode == 3, err[-3000:]
    assert "INTERRUPTED Interrupted ended" in out
    name = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
    assert f"{name}: stopping after the current step" in err, err[-3000:]
    # The checkpoint of the last completed epoch is whole, and the backup is kept so that the
    # next fit resumes (BackupAndRestore deletes it only when training finishes).
    check = subprocess.run(
        [sys.executable, "-c", "import sys, keras; keras.saving.load_model(sys.argv[1]); "
         "print('LOADED')", str(tmp_path / "last.keras")],
        capture_output=True, text=True, env={**os.environ, "KERAS_BACKEND": "jax"}, timeout=120,
    )
    assert "LOADED" in check.stdout, check.stderr[-2000:]
    assert os.listdir(tmp_path / "backup")
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".tmp-")]


def test_second_ctrl_c_exits_at_once(tmp_path):
    process = _start(tmp_path)
    _wait_for(tmp_path / "epoch-0", process)
    process.send_signal(signal.SIGINT)
    time.sleep(0.02)
    process.send_signal(signal.SIGINT)
    try:
        _, err = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail("a second Ctrl-C did not end the process")
    # Ended by SIGINT itself (or, if the first stop won the race, by the interruption).
    assert process.returncode in (-signal.SIGINT, 3), err[-3000:]


HOGGED = textwrap.dedent(
    r"""
    import json, os
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ["KERAS_MULTIGPU_CPU_DEVICES"] = "2"
    import keras, numpy as np
    import keras_multigpu as kmg
    x = np.random.default_rng(0).normal(size=(300, 16, 16, 3)).astype("float32")
    y = keras.utils.to_categorical(np.arange(300) % 10, 10)
    model = keras.Sequential([keras.Input((16, 16, 3)), keras.layers.Conv2D(16, 3),
                              keras.layers.BatchNormalization(), keras.layers.ReLU(),
                              keras.layers.GlobalAveragePooling2D(),
                              keras.layers.Dense(10, activation="softmax")])
    parallel = kmg.multi_gpu_model(model, gpus=2)
    parallel.compile(optimizer="sgd", loss="categorical_crossentropy")
    history = parallel.fit(x, y, batch_size=30, epochs=3, verbose=0)
    print(json.dumps({"flags": os.environ["XLA_FLAGS"], "epochs": len(history.history["loss"])}))
    """
)


def test_a_two_device_fit_survives_a_cpu_hog(tmp_path):
    """Every core busy with another process: the device threads are starved, and XLA's CPU
    collectives, whose timeout follows KERAS_MULTIGPU_TIMEOUT, wait for them instead of
    aborting the process."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(os.cpu_count() or 2)]
    try:
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env["KERAS_MULTIGPU_TIMEOUT"] = "300"
        result = subprocess.run([sys.executable, "-c", HOGGED], capture_output=True, text=True,
                                env=env, timeout=600)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert result.returncode == 0, result.stderr[-3000:]
    facts = json.loads(result.stdout.strip().splitlines()[-1])
    assert facts["epochs"] == 3
    from keras_multigpu import _xla

    if _xla.knows("--xla_cpu_collective_call_terminate_timeout_seconds"):
        assert "--xla_cpu_collective_call_terminate_timeout_seconds=360" in facts["flags"]


STUCK = textwrap.dedent(
    r"""
    import os, time
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ["KERAS_MULTIGPU_CPU_DEVICES"] = "2"
    os.environ["KERAS_MULTIGPU_TIMEOUT"] = "3"
    import jax, keras, numpy as np
    import keras_multigpu as kmg

    class Stuck(keras.layers.Layer):
        # A step that never finishes, as a deadlocked collective: a host callback that waits.
        def call(self, x):
            def wait(value):
                time.sleep(600)
                return value
            return jax.pure_callback(wait, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    model = keras.Sequential([keras.Input((4,)), Stuck(), keras.layers.Dense(2)])
    parallel = kmg.multi_gpu_model(model, gpus=2)
    parallel.compile(optimizer="sgd", loss="mse")
    parallel.fit(np.ones((8, 4), "float32"), np.ones((8, 2), "float32"), batch_size=4,
                 epochs=1, verbose=0)
    print("FINISHED")
    """
)


def test_a_step_that_never_finishes_ends_with_the_librarys_message():
    """A step whose collective never completes blocks inside XLA: after KERAS_MULTIGPU_TIMEOUT
    seconds the process says so and exits, instead of waiting in silence."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run([sys.executable, "-c", STUCK], capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "FINISHED" not in result.stdout
    assert ("keras_multigpu: a training step has waited 3 s (KERAS_MULTIGPU_TIMEOUT=3) without "
            "finishing" in result.stderr), result.stderr[-3000:]


POOLED = textwrap.dedent(
    r"""
    import os, sys
    os.environ["KERAS_BACKEND"] = sys.argv[1]
    os.environ["KERAS_MULTIGPU_CPU_DEVICES"] = "3"
    import keras, numpy as np
    import keras_multigpu as kmg

    class Rows(keras.utils.PyDataset):
        def __init__(self, x, y, **kwargs):
            super().__init__(**kwargs)
            self.x, self.y = x, y

        def __len__(self):
            return -(-len(self.x) // 5)

        def __getitem__(self, index):
            rows = slice(5 * index, 5 * index + 5)
            return self.x[rows], self.y[rows]

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(23, 6)).astype("float32"), rng.integers(0, 3, 23)
    weights = []
    for gpus in (None, 3):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(3, activation="softmax")])
        target = model if gpus is None else kmg.multi_gpu_model(model, gpus=gpus)
        target.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        pooled = dict(workers=2, use_multiprocessing=True)
        target.fit(Rows(x, y, **pooled), epochs=2, shuffle=True, verbose=0,
                   validation_data=Rows(x[:9], y[:9], **pooled))
        weights.append(model.get_weights())
    print("APART", max(float(np.abs(a - b).max()) for a, b in zip(*weights)), flush=True)
    """
)


@pytest.mark.parametrize("backend", ["jax", "tensorflow"])
def test_a_pydatasets_worker_processes_end_as_without_the_library(backend):
    """A PyDataset with `use_multiprocessing=True` feeds from worker processes forked during
    `fit`, and Keras ends them with SIGTERM. They took the library's deferring handler with
    the fork: each printed "SIGTERM: stopping after the current step" and lived on, and the
    script never exited (at exit, multiprocessing waited for them for ever, on TensorFlow).
    A forked process now gets the earlier handlers back."""
    try:
        result = subprocess.run([sys.executable, "-c", POOLED, backend], capture_output=True,
                                text=True, env=child_env(), timeout=180)
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"the script did not exit within 180 s: {expired.stderr}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "SIGTERM" not in result.stderr, result.stderr[-3000:]
    apart = float(result.stdout.split("APART")[1])
    assert apart < 1e-5
