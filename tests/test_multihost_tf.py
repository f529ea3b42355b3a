"""The TensorFlow engine on several workers (TF_CONFIG), one process per host.

Every test runs real processes on 127.0.0.1: two workers with two virtual
CPU devices each (or one device each) train the same program as one process
with four devices (two) and as one process with one device, and must agree
with both (the second worker even seeded otherwise: the workers take the
first's weights and random state). A worker whose peer never starts must
fail with a clear message, not hang.
"""

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import keras
import numpy as np
import pytest

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(keras.backend.backend() != "tensorflow",
                                 reason="runs in the TensorFlow stream")]

PROGRAM = """
import json, os, sys

import numpy as np

import keras_multigpu  # joins the other workers, when TF_CONFIG names several
import keras
from keras.src.saving import saving_lib

out, shared = sys.argv[1], sys.argv[2]  # this process's folder, and every worker's
writes = []
save_weights_only = saving_lib.save_weights_only
saving_lib.save_weights_only = lambda *a, **k: (writes.append(1), save_weights_only(*a, **k))
save_model = saving_lib.save_model
saving_lib.save_model = lambda *a, **k: (writes.append(1), save_model(*a, **k))

# A worker other than the first may start from another state: every worker takes the
# first's (the weights it builds, its shuffling), so all must train as the first alone.
keras.utils.set_random_seed(int(os.environ.get("SEED", "1")))
rng = np.random.RandomState(0)
x = rng.normal(size=(99, 8)).astype("float32")
y = (x[:, :1] * 0.5 - x[:, 1:2] + 0.1 * rng.normal(size=(99, 1))).astype("float32")
model = keras.Sequential([
    keras.Input((8,)),
    keras.layers.Dense(16),
    keras.layers.BatchNormalization(),
    keras.layers.Activation("relu"),
    keras.layers.Dense(1),
])
parallel = keras_multigpu.multi_gpu_model(model)
parallel.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
watch = keras_multigpu.callbacks.DeviceMonitor(os.path.join(shared, "monitor"))
history = parallel.fit(x, y, batch_size=25, epochs=2, verbose=0,  # 25 % 4 != 0; shuffled
                       callbacks=[watch])
evaluation = parallel.evaluate(x, y, batch_size=25, verbose=0)
prediction = parallel.predict(x[:11], batch_size=25, verbose=0)
index = parallel._backend.process_index()
parallel.save_weights(os.path.join(shared, "model.weights.h5"))  # worker 0 writes, once
keras.saving.save_model(model, os.path.join(shared, "direct.keras"))  # Keras's own, directly
np.savez(os.path.join(out, f"weights-{index}.npz"), *model.get_weights())
np.save(os.path.join(out, f"prediction-{index}.npy"), prediction)
with open(os.path.join(out, f"result-{index}.json"), "w") as f:
    json.dump({
        "history": history.history, "evaluation": evaluation,
        "replicas": parallel.num_replicas, "devices": len(parallel.devices),
        "index": index, "count": parallel._backend.process_count(), "writes": len(writes),
        "saved": all(os.path.exists(os.path.join(shared, name))
                     for name in ("model.weights.h5", "direct.keras")),
        "monitor": watch.ranks, "monitor_steps": watch.verdict["evidence"]["steps"],
    }, f)
"""


def _ports(count):
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _tf_config(ports, index):
    return json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                       "task": {"type": "worker", "index": index}})


def _env(devices, **extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "KERAS_MULTIGPU_CPU_DEVICES", "TF_CONFIG", "RANK",
                        "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2", **extra)
    if devices > 1:
        env["KERAS_MULTIGPU_CPU_DEVICES"] = str(devices)
    return env


def _start(script, out, devices, **env):
    out.mkdir()
    shared = out.parent / "shared" if "TF_CONFIG" in env else out
    shared.mkdir(exist_ok=True)
    return subprocess.Popen([sys.executable, str(script), str(out), str(shared)], cwd=out,
                            env=_env(devices, **env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish(processes, timeout):
    """Waits for every process; kills them all at the deadline."""
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        for process in processes:
            output, _ = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append(output)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()
    return outputs


def _result(out, index=0):
    with open(out / f"result-{index}.json") as f:
        result = json.load(f)
    weights = np.load(out / f"weights-{index}.npz")
    result["weights"] = [weights[f"arr_{i}"] for i in range(len(weights.files))]
    result["prediction"] = np.load(out / f"prediction-{index}.npy")
    return result


def _assert_same(a, b, rtol=1e-5, atol=1e-6):
    assert len(a["weights"]) == len(b["weights"])
    for i, (u, v) in enumerate(zip(a["weights"], b["weights"])):
        # Dense kernel and bias, BatchNormalization's gamma, beta, moving mean and
        # moving variance, Dense kernel and bias.
        np.testing.assert_allclose(u, v, rtol=rtol, atol=atol, err_msg=f"weight {i}")
    for name in ("loss", "mae"):
        np.testing.assert_allclose(a["history"][name], b["history"][name], rtol=rtol,
                                   err_msg=name)
    np.testing.assert_allclose(a["evaluation"], b["evaluation"], rtol=rtol)
    np.testing.assert_allclose(a["prediction"], b["prediction"], rtol=rtol, atol=atol)


def _train_on_workers(tmp_path, per_worker):
    """Two workers with `per_worker` devices each, against one process with one device and
    one with as many devices as the workers together: all must agree."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(PROGRAM))
    ports = _ports(2)
    processes = [
        _start(script, tmp_path / "one", 1),
        _start(script, tmp_path / "all", 2 * per_worker),
        *(_start(script, tmp_path / f"worker{i}", per_worker, TF_CONFIG=_tf_config(ports, i),
                 KERAS_MULTIGPU_TIMEOUT="90", SEED=str(1 + 7 * i))
          for i in range(2)),
    ]
    outputs = _finish(processes, timeout=150)
    for process, output in zip(processes, outputs):
        assert process.returncode == 0, output[-4000:]
    one, every = _result(tmp_path / "one"), _result(tmp_path / "all")
    workers = [_result(tmp_path / f"worker{i}", i) for i in range(2)]
    assert (one["replicas"], every["replicas"]) == (1, 2 * per_worker)
    for i, worker in enumerate(workers):
        assert (worker["index"], worker["count"]) == (i, 2)
        assert (worker["replicas"], worker["devices"]) == (2 * per_worker, per_worker)
        _assert_same(worker, every)
        _assert_same(worker, one)
    # Every worker ends with the same model, bit for bit.
    for u, v in zip(workers[0]["weights"], workers[1]["weights"]):
        np.testing.assert_array_equal(u, v)
    # Worker 0 alone wrote the weights file and the direct `keras.saving.save_model`;
    # worker 1's saves returned once they were there.
    assert [w["writes"] for w in workers] == [2, 0]
    assert [w["saved"] for w in workers] == [True, True]
    # DeviceMonitor: every worker's step figures reached every worker; worker 0 wrote them.
    for worker in workers:
        assert [r["rank"] for r in worker["monitor"]] == [0, 1]
        assert all(r["steps"] == worker["monitor_steps"] == 7 for r in worker["monitor"])
    with open(tmp_path / "shared" / "monitor" / "ranks.csv") as f:
        assert [line.split(",")[0] for line in f.read().split()] == ["rank", "0", "1"]
    saved = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
                              keras.layers.BatchNormalization(),
                              keras.layers.Activation("relu"), keras.layers.Dense(1)])
    saved.load_weights(tmp_path / "shared" / "model.weights.h5")
    for u, v in zip(saved.get_weights(), workers[0]["weights"]):
        np.testing.assert_array_equal(u, v)


def test_two_workers_train_as_one_process(tmp_path):
    _train_on_workers(tmp_path, per_worker=2)


def test_two_workers_with_one_device_each_train_as_one_process(tmp_path):
    # The launcher's case on a CPU machine (`keras-multigpu launch -n 2`): each worker has
    # one device, so each replica's values reach the all-reduce with no PerReplica to name
    # their device.
    _train_on_workers(tmp_path, per_worker=1)


STOP = """
import json, os, signal, sys

import numpy as np

import keras_multigpu
import keras

out = sys.argv[1]
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
parallel = keras_multigpu.multi_gpu_model(model)
parallel.compile(optimizer="sgd", loss="mse")
batches = []


class CtrlCOnWorkerOne(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        batches.append(batch)
        if index == 1 and len(batches) == 5:
            os.kill(os.getpid(), signal.SIGINT)


try:
    parallel.fit(np.ones((80, 4)), np.ones((80, 2)), batch_size=8, epochs=3, verbose=0,
                 callbacks=[CtrlCOnWorkerOne()])
    stopped = False
except KeyboardInterrupt:
    stopped = True
with open(os.path.join(out, f"stop-{index}.json"), "w") as f:
    json.dump({"stopped": stopped, "batches": len(batches)}, f)
"""


def test_a_ctrl_c_on_one_worker_stops_every_worker_at_the_same_step(tmp_path):
    """Worker 1 alone gets the Ctrl-C: both stop at the next step boundary (worker 0
    would otherwise wait in the next step's all-reduce for a worker that left)."""
    script = tmp_path / "stop.py"
    script.write_text(textwrap.dedent(STOP))
    ports = _ports(2)
    processes = [_start(script, tmp_path / f"worker{i}", 1, TF_CONFIG=_tf_config(ports, i),
                        KERAS_MULTIGPU_TIMEOUT="30")
                 for i in range(2)]
    outputs = _finish(processes, timeout=120)
    results = []
    for i, (process, output) in enumerate(zip(processes, outputs)):
        assert process.returncode == 0, output[-4000:]
        with open(tmp_path / f"worker{i}" / f"stop-{i}.json") as f:
            results.append(json.load(f))
    assert results == [{"stopped": True, "batches": 5}] * 2, results


FAULT = """
import json, os, signal, sys, time

import numpy as np
import tensorflow as tf

import keras_multigpu
import keras

index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
fault, victim = sys.argv[3], int(sys.argv[4])
keras.utils.set_random_seed(0)


def act():
    if fault.startswith("kill"):
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)  # hangs: its heartbeats go on


class Fault(keras.callbacks.Callback):  # between steps
    def on_train_batch_end(self, batch, logs=None):
        if index == victim and batch == 4 and not fault.endswith("step"):
            act()


steps = []


def in_step(x):  # inside the sixth step, before its all-reduce
    steps.append(1)
    if index == victim and len(steps) == 6 and fault.endswith("step"):
        act()
    return x


class InStep(keras.layers.Layer):
    def call(self, x):
        return tf.ensure_shape(tf.py_function(in_step, [x], x.dtype), x.shape)


model = keras.Sequential([keras.Input((4,)), InStep(), keras.layers.Dense(2)])
parallel = keras_multigpu.multi_gpu_model(model)
parallel.compile(optimizer="sgd", loss="mse")
try:
    parallel.fit(np.ones((400, 4)), np.ones((400, 2)), batch_size=8, epochs=1, verbose=0,
                 callbacks=[Fault()])
except keras_multigpu.CollectiveError:  # the public class, whatever raised it
    print("caught keras_multigpu.CollectiveError", flush=True)
    raise
"""


@pytest.mark.parametrize("fault, victim", [("hang", 1), ("kill", 1), ("kill", 0),
                                           ("hang in step", 1), ("kill in step", 1)])
def test_a_worker_that_hangs_or_dies_stops_the_other_with_its_name(tmp_path, fault, victim):
    """The other worker stops within KERAS_MULTIGPU_TIMEOUT with an error that says what
    happened, between steps (the stop agreement) or inside one: without the library's
    errors it waited for ever in the step's all-reduce for a worker that hangs (whose
    heartbeats go on), and a worker that died showed TensorFlow's own error from deep in
    the step ("Socket closed")."""
    script = tmp_path / "fault.py"
    script.write_text(textwrap.dedent(FAULT))
    ports = _ports(2)
    processes = [subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), str(tmp_path), fault, str(victim)],
        cwd=tmp_path, env=_env(1, TF_CONFIG=_tf_config(ports, i), KERAS_MULTIGPU_TIMEOUT="20"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    other = processes[1 - victim]
    start = time.monotonic()
    output, _ = other.communicate(timeout=150)
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.communicate()
    assert other.returncode != 0, output[-4000:]
    assert time.monotonic() - start < 120
    waited = ("CollectiveError: Process 0 of 2 waited 20 s (KERAS_MULTIGPU_TIMEOUT) for "
              "process 1 at the step boundary")
    lost = (f"CollectiveError: Process {1 - victim} of 2: the store the processes share "
            "(process 0 holds it) failed at the step boundary")
    # Where the dead worker's side of a step's all-reduce ended before the other's did,
    # or where it died inside the step.
    died = (f"CollectiveError: Process {1 - victim} of 2: a step's all-reduce across the "
            f"processes failed: process {victim} (worker {victim} in TF_CONFIG) has stopped")
    assert "caught keras_multigpu.CollectiveError" in output, output[-4000:]
    if fault == "hang in step":
        assert ("CollectiveError: Process 0 of 2 waited 20 s (KERAS_MULTIGPU_TIMEOUT) for the "
                "others in a step's all-reduce") in output, output[-4000:]
    elif fault == "kill in step":
        assert died in output, output[-4000:]
    elif victim == 0:  # worker 0 holds the coordination service
        assert lost in output or died in output, output[-4000:]
    elif fault == "hang":
        assert waited in output, output[-4000:]
    else:  # the coordination service may report the dead worker before the timeout
        assert waited in output or lost in output or died in output, output[-4000:]


def test_a_worker_that_never_joins_is_an_error(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(PROGRAM))
    ports = _ports(2)
    process = _start(script, tmp_path / "worker0", 2, TF_CONFIG=_tf_config(ports, 0),
                     KERAS_MULTIGPU_TIMEOUT="5")
    (output,) = _finish([process], timeout=90)
    assert process.returncode != 0
    assert "could not join the others within KERAS_MULTIGPU_TIMEOUT=5 s" in output, output[-4000:]
    assert f"worker 1 (127.0.0.1:{ports[1]})" in output


def test_tensorflow_started_before_the_import_is_an_error(tmp_path):
    # TensorFlow joins other workers only as its runtime starts: too late here.
    script = tmp_path / "late.py"
    script.write_text(textwrap.dedent("""
        import tensorflow as tf
        tf.constant(1.0) + 1.0
        import keras
        import keras_multigpu
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        keras_multigpu.multi_gpu_model(model)
    """))
    process = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                             text=True, timeout=90, check=False,
                             env=_env(1, TF_CONFIG=_tf_config(_ports(2), 1)))
    assert process.returncode != 0
    assert "TF_CONFIG names 2 workers, but TensorFlow had already started" in process.stderr, (
        process.stderr[-4000:])


@pytest.mark.parametrize("value, message", [
    ("{not json", "TF_CONFIG is not valid JSON"),
    (json.dumps({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
                 "task": {"type": "worker", "index": 2}}), "is not one of them"),
])
def test_a_bad_tf_config_is_refused(monkeypatch, value, message):
    from keras_multigpu.backends import _tf_workers

    monkeypatch.setenv("TF_CONFIG", value)
    with pytest.raises(ValueError, match=message):
        _tf_workers._cluster()


def test_one_worker_is_one_process(monkeypatch):
    from keras_multigpu.backends import _tf_workers
    from keras_multigpu.backends import tensorflow as engine

    monkeypatch.setenv("TF_CONFIG", _tf_config([1], 0))
    assert _tf_workers._cluster() is None
    assert (engine.process_index(), engine.process_count()) == (0, 1)
