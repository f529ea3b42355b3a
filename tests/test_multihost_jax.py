"""The JAX engine across several processes (hosts), joined by `jax.distributed`.

Each process is started as a launcher starts one per host (WORLD_SIZE, RANK,
MASTER_ADDR, MASTER_PORT, LOCAL_RANK=0, LOCAL_WORLD_SIZE=1), with 2 virtual
CPU devices of its own; XLA's CPU collectives between processes are gloo's.
Two such processes must train exactly as one process with all 4 devices,
and as one device (`multihost_script.py` records what each run gives). The
processes run as subprocesses with KERAS_BACKEND=jax, so this file runs
under any pytest backend; every one has a timeout, so nothing hangs.
"""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from conftest import child_env

pytestmark = pytest.mark.slow  # several processes or whole runs: not in the fast loop

SCRIPT = pathlib.Path(__file__).with_name("multihost_script.py")
TIMEOUT_SECONDS = 240

_LAUNCH_VARIABLES = ("KERAS_MULTIGPU_CPU_DEVICES", "KERAS_MULTIGPU_TIMEOUT", "RANK",
                     "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra):
    return child_env(_LAUNCH_VARIABLES, KERAS_BACKEND="jax", PYTHONUNBUFFERED="1",
                     **{k: str(v) for k, v in extra.items()})


def _host(rank, world, port, devices, timeout=60):
    """The environment of process `rank` of `world`, one per host."""
    return _env(WORLD_SIZE=world, RANK=rank, MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                LOCAL_RANK=0, LOCAL_WORLD_SIZE=1, KERAS_MULTIGPU_CPU_DEVICES=devices,
                KERAS_MULTIGPU_TIMEOUT=timeout)


def _run_all(commands, timeout=TIMEOUT_SECONDS):
    """Runs `(args, env)` commands at once; returns their `(returncode, stdout + stderr)`.

    All are killed when one outlives `timeout`: a process left waiting for a
    peer must not outlive the test.
    """
    processes = [subprocess.Popen(args, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
                 for args, env in commands]
    results = []
    try:
        for process in processes:
            out, _ = process.communicate(timeout=timeout)
            results.append((process.returncode, out))
    except subprocess.TimeoutExpired:
        for process in processes:
            process.kill()
        outs = [process.communicate()[0] for process in processes]
        pytest.fail(f"processes still running after {timeout} s: killed.\n" + "\n---\n".join(
            out[-3000:] for out in outs))
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process with 4 devices (and 1), and 2 processes with 2 devices each, at once."""
    single, hosts = tmp_path_factory.mktemp("single"), tmp_path_factory.mktemp("hosts")
    port = _free_port()
    python = [sys.executable, str(SCRIPT)]
    results = _run_all([
        ([*python, str(single)], _env(KERAS_MULTIGPU_CPU_DEVICES=4)),
        ([*python, str(hosts)], _host(0, 2, port, 2)),
        ([*python, str(hosts)], _host(1, 2, port, 2)),
    ])
    for name, (code, out) in zip(("one process", "process 0", "process 1"), results):
        assert code == 0, f"{name} failed:\n{out[-5000:]}"
    return {
        "single": np.load(single / "rank0.npz"),
        "ranks": [np.load(hosts / f"rank{r}.npz") for r in range(2)],
        "dir": hosts,
    }


def _meta(result, name):
    return json.loads(str(result[f"{name}/meta"]))


def _assert_same_training(result, name, expected, expected_name):
    keys = [k[len(expected_name) + 1:] for k in expected.files
            if k.startswith(expected_name + "/") and not k.endswith("/meta")]
    assert keys
    for key in keys:
        np.testing.assert_allclose(result[f"{name}/{key}"], expected[f"{expected_name}/{key}"],
                                   rtol=1e-5, atol=1e-6, err_msg=key)
    got, want = _meta(result, name), _meta(expected, expected_name)
    assert got["history"].keys() == want["history"].keys()
    for key, values in want["history"].items():
        np.testing.assert_allclose(got["history"][key], values, rtol=1e-5, err_msg=key)
    for key, value in want["evaluation"].items():
        np.testing.assert_allclose(got["evaluation"][key], value, rtol=1e-5, err_msg=key)


def test_every_process_trains_on_every_device(runs):
    for rank, result in enumerate(runs["ranks"]):
        meta = _meta(result, "all")
        assert (meta["replicas"], meta["processes"], meta["rank"]) == (4, 2, rank)
        assert "val_loss" in meta["history"] and len(meta["history"]["loss"]) == 2


@pytest.mark.parametrize("name", ["all", "one"], ids=["4 devices", "1 device"])
def test_two_processes_train_as_one_process(runs, name):
    """Weights (BatchNormalization's moving statistics among them), the history, evaluate and
    every predicted row in order: as one process with 4 devices, and with one."""
    for result in runs["ranks"]:
        _assert_same_training(result, "all", runs["single"], name)


def test_processes_start_from_process_zeros_random_state(runs):
    first, second = (result["draws"] for result in runs["ranks"])
    np.testing.assert_array_equal(first, second)


def test_only_process_zero_writes_and_every_process_reads(runs):
    # `parallel.save` and a direct `keras.saving.save_model`: both by process 0 alone
    assert [int(result["writes"]) for result in runs["ranks"]] == [2, 0]
    assert os.path.isfile(runs["dir"] / "all" / "model.keras")
    assert sorted(p.name for p in (runs["dir"] / "all").iterdir()) == [  # no leftovers
        "direct.keras", "model.keras"]
    for result in runs["ranks"]:  # each loaded the file process 0 wrote: the trained weights
        count = sum(1 for k in result.files if k.startswith("all/weight"))
        for i in range(count):
            np.testing.assert_array_equal(result[f"all/loaded{i}"], result[f"all/weight{i}"])


def test_every_process_figures_reach_process_zero_which_alone_writes_them(runs):
    for result in runs["ranks"]:  # DeviceMonitor's gather: on every process
        ranks = _meta(result, "all")["monitor"]
        assert [r["rank"] for r in ranks] == [0, 1]
        assert all(r["steps"] == 7 and r["measured"] == "dataset" for r in ranks)
    assert _meta(runs["single"], "all")["monitor"] is None  # one process: nothing to gather
    assert (runs["dir"] / "all-monitor" / "ranks.csv").is_file()


def test_a_choice_of_devices_that_leaves_a_process_idle_is_refused(runs):
    for result in runs["ranks"]:
        message = str(result["idle"])
        assert "none of which belongs to process(es) [1] of the 2" in message, message
        assert "gpus=None" in message


def test_a_missing_peer_or_coordinator_is_named_within_the_timeout():
    """Process 0 alone waits for process 1; process 1 alone, for process 0: both fail
    after KERAS_MULTIGPU_TIMEOUT seconds, naming what they waited for."""
    command = [sys.executable, "-c", "import keras_multigpu"]
    (code0, out0), (code1, out1) = _run_all([
        (command, _host(0, 2, _free_port(), 1, timeout=3)),
        (command, _host(1, 2, _free_port(), 1, timeout=3)),
    ], timeout=120)
    assert code0 == 1 and code1 == 1, out0[-3000:] + out1[-3000:]
    assert ("RuntimeError: Process 0 of 2 (the coordinator, on port " in out0
            and "waited 3 s (KERAS_MULTIGPU_TIMEOUT) for process(es) [1] to join" in out0), out0
    assert ("RuntimeError: Process 1 of 2 could not join process 0 (the coordinator) at "
            "127.0.0.1:" in out1 and "within 3 s (KERAS_MULTIGPU_TIMEOUT)" in out1), out1


def test_jax_started_before_the_processes_joined_is_a_clear_error():
    script = textwrap.dedent("""
        import jax
        jax.devices()  # JAX starts: too late for jax.distributed
        import keras, keras_multigpu as kmg
        kmg.multi_gpu_model(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]))
    """)
    [(code, out)] = _run_all([([sys.executable, "-c", script], _host(0, 2, _free_port(), 1))],
                             timeout=120)
    assert code == 1
    assert "runs as 2 processes (WORLD_SIZE=2), but JAX started before keras_multigpu" in out, (
        out[-3000:])


def test_ctrl_c_on_one_process_stops_every_process_at_the_same_step(tmp_path):
    """Ctrl-C reaches process 1 only: both stop at the same step boundary (a process that
    stopped alone would leave the other waiting in the next step's collectives)."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import os, signal
        import keras, numpy as np
        import keras_multigpu as kmg
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        parallel = kmg.multi_gpu_model(model)
        parallel.compile(optimizer="sgd", loss="mse")

        class Ready(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                if epoch == 1:
                    print("ready", flush=True)

        try:
            parallel.fit(np.ones((40, 4)), np.ones((40, 2)), batch_size=5, epochs=10000,
                         verbose=0, callbacks=[Ready()])
        except KeyboardInterrupt:
            print("stopped after", int(parallel.optimizer.iterations), "steps", flush=True)
    """))
    port = _free_port()
    # SIGINT at its default in them: a test run started in the background ignores it.
    processes = [subprocess.Popen([sys.executable, str(script)], env=_host(rank, 2, port, 1),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  preexec_fn=lambda: signal.signal(signal.SIGINT,
                                                                   signal.SIG_DFL))
                 for rank in range(2)]
    # Nothing may hang: a process that never gets ready is killed (its output then ends).
    watchdog = threading.Timer(120, lambda: [process.kill() for process in processes])
    watchdog.start()
    try:
        for line in processes[1].stdout:
            if line.strip() == "ready":
                processes[1].send_signal(signal.SIGINT)
                break
        outs = [process.communicate(timeout=120)[0] for process in processes]
    finally:
        watchdog.cancel()
        for process in processes:
            process.kill()
    stops = [[line for line in out.splitlines() if line.startswith("stopped after")]
             for out in outs]
    assert all(len(s) == 1 for s in stops), "\n---\n".join(out[-3000:] for out in outs)
    assert stops[0] == stops[1]
    assert [process.returncode for process in processes] == [0, 0]


def test_a_process_that_hangs_is_named_within_the_timeout(tmp_path):
    """Process 1 hangs in a callback: process 0 waits for it at the next step boundary for
    KERAS_MULTIGPU_TIMEOUT seconds, then fails naming the wait (it waited for ever before)."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import os, time
        import keras, numpy as np
        import keras_multigpu as kmg
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        parallel = kmg.multi_gpu_model(model)
        parallel.compile(optimizer="sgd", loss="mse")

        class Hang(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                if epoch == 1 and os.environ["RANK"] == "1":
                    time.sleep(600)

        parallel.fit(np.ones((40, 4)), np.ones((40, 2)), batch_size=5, epochs=3, verbose=0,
                     callbacks=[Hang()])
    """))
    port = _free_port()
    first = subprocess.Popen([sys.executable, str(script)], env=_host(0, 2, port, 1, timeout=5),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    hung = subprocess.Popen([sys.executable, str(script)], env=_host(1, 2, port, 1, timeout=5),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        out, _ = first.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        first.kill()
        pytest.fail("process 0 still waited for the hung process after 150 s")
    finally:
        hung.kill()
        hung.wait()
    assert first.returncode == 1, out[-3000:]
    assert ("Process 0 of 2 waited 5 s (KERAS_MULTIGPU_TIMEOUT) for process 1 at the step "
            "boundary where every process checks for Ctrl-C" in out), out[-3000:]


@pytest.mark.parametrize("unset, named", [
    (("RANK",), "RANK is not set"),
    (("MASTER_ADDR", "MASTER_PORT"), "MASTER_ADDR, MASTER_PORT are not set"),
])
def test_missing_launch_variables_are_named(monkeypatch, unset, named):
    jax_backend = pytest.importorskip("keras_multigpu.backends._jax_hosts")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    for name in unset:
        monkeypatch.delenv(name)
    with pytest.raises(ValueError, match=named):
        jax_backend._launch_variables(2)


@pytest.mark.parametrize("raw", ["0", "-3", "soon", "inf"])
def test_a_bad_timeout_is_refused(monkeypatch, raw):
    jax_backend = pytest.importorskip("keras_multigpu.backends._jax_hosts")
    monkeypatch.setenv("KERAS_MULTIGPU_TIMEOUT", raw)
    with pytest.raises(ValueError, match="KERAS_MULTIGPU_TIMEOUT must be a positive number"):
        jax_backend._timeout()
