"""Several machines, as `keras-multigpu launch` joins them, and the faults they bring.

Every "machine" here is one launcher on this one, all meeting on 127.0.0.1
(the only network there is): `--nnodes 2 --node-rank 0|1`, each starting its
own processes, exactly as two machines would. The torch engine trains over
gloo; the JAX and TensorFlow engines have their own files
(test_multihost_jax.py, test_multihost_tf.py).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # several processes or whole runs: not in the fast loop

pytest.importorskip("torch")

LAUNCH = [sys.executable, "-m", "keras_multigpu.cli", "launch"]

# argv: output folder, then "kill" to SIGKILL rank 1 in the middle of epoch 2 (on the first
# start only: a restarted group goes through), or "slow" to print each step and pause.
# Uneven batches (99 rows, 25 a batch, over 4 processes), BatchNorm, Dropout, a decaying
# learning rate, checkpoints every 2 steps.
TRAIN = """
import json, os, signal, sys, time
os.environ["KERAS_BACKEND"] = "torch"
import keras, numpy as np
import keras_multigpu as kmg
from keras_multigpu.callbacks import Checkpoint

out = sys.argv[1]
fault = sys.argv[2] if len(sys.argv) > 2 else ""
keras.utils.set_random_seed(3)
rng = np.random.RandomState(0)
x, y = rng.randn(99, 6).astype("float32"), rng.randint(0, 3, 99)
model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.BatchNormalization(), keras.layers.Dropout(0.2),
                          keras.layers.Dense(3, activation="softmax")])
parallel = kmg.multi_gpu_model(model)
schedule = keras.optimizers.schedules.ExponentialDecay(0.02, 4, 0.8)
parallel.compile(optimizer=keras.optimizers.Adam(schedule),
                 loss="sparse_categorical_crossentropy", metrics=["accuracy"])


class Fault(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if fault == "slow":  # time for a Ctrl-C to land in the middle of a step
            print("at", self.epoch, batch, flush=True)
            time.sleep(0.3)
        if (fault == "kill" and self.epoch == 1 and batch == 1
                and os.environ.get("RANK") == "1"
                and os.environ.get("KERAS_MULTIGPU_RESTART_COUNT") == "0"):
            os.kill(os.getpid(), signal.SIGKILL)


history = parallel.fit(x, y, batch_size=25, epochs=3, verbose=0,
                       callbacks=[Checkpoint(os.path.join(out, "ckpt"), every_steps=2),
                                  Fault()])
rank = os.environ.get("RANK", "single")
np.savez(os.path.join(out, f"weights-{rank}.npz"), *model.get_weights())
with open(os.path.join(out, f"history-{rank}.json"), "w") as f:
    json.dump({"replicas": parallel.num_replicas, "history": history.history}, f)
"""

REPORT = """
import json, os
names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
         "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG")
print(json.dumps({name: os.environ.get(name) for name in names}))
"""


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "KERAS_MULTIGPU_CPU_DEVICES", "RANK", "WORLD_SIZE",
                        "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK")
           and not k.startswith("SLURM_")}
    env.update(extra)
    return env


def _script(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nodes(tmp_path, args_for, env=None, timeout=300):
    """Starts one launcher per node (`args_for(node)`), waits for all: their results."""
    launchers = [subprocess.Popen(args_for(node), cwd=tmp_path, env=_env(**(env or {})),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for node in (0, 1)]
    results = []
    for launcher in launchers:
        out, err = launcher.communicate(timeout=timeout)
        results.append((launcher.returncode, out, err))
    return results


def _weights(path):
    with np.load(path) as loaded:
        return [loaded[k] for k in loaded.files]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The program on one device, in one process."""
    folder = tmp_path_factory.mktemp("one-device")
    script = _script(folder, "train.py", TRAIN)
    result = subprocess.run([sys.executable, script, str(folder)], cwd=folder, env=_env(),
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return folder


def _assert_equal_runs(folder, rank, reference):
    for a, b in zip(_weights(reference / "weights-single.npz"),
                    _weights(folder / f"weights-{rank}.npz")):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_two_machines_of_two_processes_equal_one_device(tmp_path, reference):
    """Weights, BatchNorm's moving statistics (in the weights) and logs, on every rank."""
    script = _script(tmp_path, "train.py", TRAIN)
    port = _port()
    results = _nodes(tmp_path, lambda node: [
        *LAUNCH, "--nnodes", "2", "--node-rank", str(node), "--master-addr", "127.0.0.1",
        "--master-port", str(port), "-n", "2", script, str(tmp_path)])
    for code, _, err in results:
        assert code == 0, err[-3000:]
    expected = json.loads((reference / "history-single.json").read_text())["history"]
    for rank in range(4):
        _assert_equal_runs(tmp_path, rank, reference)
        run = json.loads((tmp_path / f"history-{rank}.json").read_text())
        assert run["replicas"] == 4
        for key, values in expected.items():
            np.testing.assert_allclose(run["history"][key], values, rtol=1e-5, err_msg=key)
    # the checkpoints were written once, by rank 0
    assert sorted(os.listdir(tmp_path / "ckpt")) == [
        "ckpt-000000008", "ckpt-000000010", "ckpt-000000012"]


def test_a_killed_process_restarts_the_group_which_resumes_exactly(tmp_path, reference):
    script = _script(tmp_path, "train.py", TRAIN)
    result = subprocess.run([*LAUNCH, "-n", "2", "--max-restarts", "1", script, str(tmp_path),
                             "kill"], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 1 of 2 was killed by SIGKILL" in result.stderr
    assert "restarting the 2 process(es) of node 0 (restart 1 of 1)" in result.stderr
    assert "Checkpoint: resuming from" in result.stdout
    for rank in range(2):
        _assert_equal_runs(tmp_path, rank, reference)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_checkpoints_every_rank_at_one_step_and_the_next_start_resumes(
        tmp_path, reference, signum):
    """Ctrl-C, or a scheduler's SIGTERM, to the launcher, which forwards it to every rank."""
    script = _script(tmp_path, "train.py", TRAIN)
    launcher = subprocess.Popen([*LAUNCH, "-n", "2", script, str(tmp_path), "slow"],
                                cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    for line in launcher.stdout:
        if line.startswith("[rank 0] at 1 1"):  # epoch 2, its second step done
            launcher.send_signal(signum)
            break
    out, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 128 + signum, err[-3000:]  # as a shell reports the signal
    name = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
    assert f"Stopped by {name} at a step boundary" in err, err[-3000:]
    assert f"stopped by {signum.name}" in err
    saved = sorted(os.listdir(tmp_path / "ckpt"))
    state = json.loads((tmp_path / "ckpt" / saved[-1] / "state.json").read_text())
    assert state["epoch"] == 1 and state["step"] >= 2  # the boundary after the Ctrl-C
    assert not list(tmp_path.glob("weights-*.npz"))

    resumed = subprocess.run([*LAUNCH, "-n", "2", script, str(tmp_path)], cwd=tmp_path,
                             env=_env(), capture_output=True, text=True, timeout=300,
                             check=False)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {tmp_path / 'ckpt' / saved[-1]}" in resumed.stdout
    for rank in range(2):
        _assert_equal_runs(tmp_path, rank, reference)


def test_a_machine_losing_a_process_stops_both_within_the_timeout(tmp_path):
    """Node 1's rank dies: its launcher stops its group at once; node 0's processes wait in
    a collective until the timeout, and say so."""
    script = _script(tmp_path, "train.py", TRAIN)
    port = _port()
    (code0, _, err0), (code1, _, err1) = _nodes(tmp_path, lambda node: [
        *LAUNCH, "--nnodes", "2", "--node-rank", str(node), "--master-addr", "127.0.0.1",
        "--master-port", str(port), "--timeout", "10", "-n", "1", script, str(tmp_path),
        "kill"])
    assert code1 == 128 + 9 and "rank 1 of 2 was killed by SIGKILL" in err1
    assert code0 != 0 and "rank 0 of 2 exited with status" in err0
    # named by the collective it waited in, or by the step boundary's stop agreement
    assert ("KERAS_MULTIGPU_TIMEOUT=10" in err0 or "waited 10 s (KERAS_MULTIGPU_TIMEOUT) for "
            "process 1" in err0 or "Connection" in err0), err0[-2000:]
    assert not list(tmp_path.glob("weights-*.npz"))


def test_a_machine_that_never_joins_is_a_clear_timeout(tmp_path):
    script = _script(tmp_path, "train.py", TRAIN)
    result = subprocess.run([*LAUNCH, "--nnodes", "2", "--node-rank", "0", "--master-port",
                             str(_port()), "--timeout", "5", "-n", "1", script, str(tmp_path)],
                            cwd=tmp_path, env=_env(), capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 1
    assert "Rank 0 of 2 could not join the others at 127.0.0.1" in result.stderr
    assert "1/2 clients joined" in result.stderr


def test_slurm_variables_place_every_process(tmp_path):
    """`srun --ntasks-per-node=1 keras-multigpu launch -n 2 script.py` on two nodes."""
    script = _script(tmp_path, "report.py", REPORT)
    port = _port()
    results = []
    for node in (0, 1):
        slurm = {"SLURM_JOB_ID": "42", "SLURM_NNODES": "2", "SLURM_NTASKS": "2",
                 "SLURM_NODEID": str(node), "SLURM_PROCID": str(node),
                 "SLURM_JOB_NODELIST": "127.0.0.1", "MASTER_PORT": str(port)}
        # each node's launcher reports its environment; no training, so run them one by one
        result = subprocess.run([*LAUNCH, "-n", "2", script], cwd=tmp_path, env=_env(**slurm),
                                capture_output=True, text=True, timeout=120, check=False)
        assert result.returncode == 0, result.stderr[-2000:]
        results += [json.loads(line.split("] ", 1)[1]) for line in result.stdout.splitlines()]
    assert sorted((r["RANK"], r["LOCAL_RANK"], r["GROUP_RANK"]) for r in results) == [
        ("0", "0", "0"), ("1", "1", "0"), ("2", "0", "1"), ("3", "1", "1")]
    assert {(r["WORLD_SIZE"], r["GROUP_WORLD_SIZE"], r["MASTER_ADDR"], r["MASTER_PORT"])
            for r in results} == {("4", "2", "127.0.0.1", str(port))}


def test_slurm_with_a_task_per_gpu_is_refused_with_the_fix(tmp_path):
    script = _script(tmp_path, "report.py", REPORT)
    slurm = {"SLURM_JOB_ID": "42", "SLURM_NNODES": "2", "SLURM_NTASKS": "16",
             "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "gpu[01-02]"}
    result = subprocess.run([*LAUNCH, script], cwd=tmp_path, env=_env(**slurm),
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2
    assert "srun --ntasks-per-node=1 keras-multigpu launch" in result.stderr


def test_tensorflow_workers_get_their_tf_config(tmp_path):
    script = _script(tmp_path, "report.py", REPORT)
    result = subprocess.run([*LAUNCH, "-n", "2", "--master-port", str(_port()), script],
                            cwd=tmp_path, env=_env(KERAS_BACKEND="tensorflow"),
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    reports = [json.loads(line.split("] ", 1)[1]) for line in result.stdout.splitlines()]
    configs = sorted((json.loads(r["TF_CONFIG"]) for r in reports),
                     key=lambda c: c["task"]["index"])
    assert [c["task"] for c in configs] == [{"type": "worker", "index": 0},
                                            {"type": "worker", "index": 1}]
    workers = configs[0]["cluster"]["worker"]
    assert len(workers) == 2 and all(w.startswith("127.0.0.1:") for w in workers)
    assert configs[1]["cluster"]["worker"] == workers


@pytest.mark.parametrize("flags, message", [
    (["--nnodes", "2", "--node-rank", "2"], "--node-rank must be in 0..1"),
    (["--nnodes", "2", "--node-rank", "1"], "needs --master-addr"),
    (["--nnodes", "0"], "--nnodes"),
    (["--max-restarts", "-1"], "--max-restarts"),
])
def test_bad_node_flags_are_one_line_errors(tmp_path, flags, message):
    script = _script(tmp_path, "report.py", REPORT)
    result = subprocess.run([*LAUNCH, *flags, script], cwd=tmp_path, env=_env(),
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_backup_and_restore_saves_and_resumes_with_every_process(tmp_path):
    """Keras's BackupAndRestore: rank 0 writes each backup and the others join its save
    (a save ends at a barrier); after a failure every rank resumes from it."""
    script = _script(tmp_path, "backup.py", """
        import os, sys
        os.environ["KERAS_BACKEND"] = "torch"
        import keras, numpy as np
        import keras_multigpu as kmg

        class Fail(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                if epoch == 1 and sys.argv[2] == "fail":
                    raise RuntimeError("failing after epoch 2, as a crash would")

        keras.utils.set_random_seed(0)
        x = np.random.rand(40, 4).astype("float32")
        y = np.random.rand(40, 1).astype("float32")
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        parallel = kmg.multi_gpu_model(model)
        parallel.compile(optimizer="sgd", loss="mse")
        history = parallel.fit(x, y, batch_size=8, epochs=4, verbose=0, callbacks=[
            keras.callbacks.BackupAndRestore(sys.argv[1], save_freq=3), Fail()])
        print("epochs run", len(history.history["loss"]))
    """)
    backup = str(tmp_path / "backup")
    failed = subprocess.run([*LAUNCH, "-n", "2", "--timeout", "30", script, backup, "fail"],
                            cwd=tmp_path, env=_env(), capture_output=True, text=True,
                            timeout=200, check=False)
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert "failing after epoch 2" in failed.stderr
    assert os.listdir(backup)  # kept for the next start
    resumed = subprocess.run([*LAUNCH, "-n", "2", "--timeout", "30", script, backup, "go"],
                             cwd=tmp_path, env=_env(), capture_output=True, text=True,
                             timeout=200, check=False)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # Its last backup (every 3 of 5 steps) was in epoch 2, which Keras runs again from its
    # first batch: epochs 2, 3 and 4.
    assert "[rank 0] epochs run 3" in resumed.stdout and "[rank 1] epochs run 3" in (
        resumed.stdout)
    assert not os.path.exists(backup)  # deleted once training finished
