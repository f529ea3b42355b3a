"""`keras-multigpu launch` and the torch engine's processes, as a user starts them.

Every test runs real processes: the launcher, and scripts that either only
report what they were given, or train a Keras model on the torch backend
with gloo (each under its own KERAS_BACKEND, so this file runs in any pytest
process). Failure modes are checked for a clear message, a non-zero exit and
no process left behind.
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

from conftest import child_env

pytestmark = pytest.mark.slow  # several processes or whole runs: not in the fast loop

LAUNCH = [sys.executable, "-m", "keras_multigpu.cli", "launch"]

pytest.importorskip("torch")


def _env(**extra):
    return child_env(("KERAS_MULTIGPU_CPU_DEVICES", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                      "MASTER_ADDR", "MASTER_PORT"), **extra)


def _script(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def _run(args, tmp_path, timeout=300, **env):
    return subprocess.run(args, cwd=tmp_path, env=_env(**env), capture_output=True, text=True,
                          timeout=timeout, check=False)


def _gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as stat:  # a zombie no one reaps is gone too
        return stat.read().split(")")[-1].split()[0] == "Z"


REPORT = """
import json, os, sys
names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
print(json.dumps({name: os.environ.get(name) for name in names} | {"argv": sys.argv[1:]}))
"""


def test_each_process_gets_torchruns_variables_and_a_prefix(tmp_path):
    script = _script(tmp_path, "report.py", REPORT)
    result = _run([*LAUNCH, "-n", "3", script, "--flag", "x"], tmp_path)
    assert result.returncode == 0, result.stderr
    seen = {}
    for line in result.stdout.splitlines():
        prefix, _, text = line.partition("] ")
        seen[int(prefix.removeprefix("[rank "))] = json.loads(text)
    assert sorted(seen) == [0, 1, 2]
    ports = {v["MASTER_PORT"] for v in seen.values()}
    assert len(ports) == 1 and int(ports.pop()) > 0
    for rank, values in seen.items():
        assert values["RANK"] == values["LOCAL_RANK"] == str(rank)
        assert values["WORLD_SIZE"] == values["LOCAL_WORLD_SIZE"] == "3"
        assert values["argv"] == ["--flag", "x"]


def test_quiet_ranks_shows_rank_zero_only(tmp_path):
    script = _script(tmp_path, "report.py", REPORT)
    result = _run([*LAUNCH, "-n", "2", "--quiet-ranks", script], tmp_path)
    assert result.returncode == 0, result.stderr
    assert [line[:8] for line in result.stdout.splitlines()] == ["[rank 0]"]


@pytest.mark.parametrize("count", ["0", "-2", "two"])
def test_a_wrong_process_count_is_refused(tmp_path, count):
    script = _script(tmp_path, "report.py", REPORT)
    result = _run([*LAUNCH, "-n", count, script], tmp_path)
    assert result.returncode == 2
    assert f"expected a positive integer, got {count!r}" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("script, said", [("no_such_script.py", "No such script"),
                                           ("a_folder", "Not a script, a folder")])
def test_a_missing_script_is_named(tmp_path, script, said):
    (tmp_path / "a_folder").mkdir()
    result = _run([*LAUNCH, "-n", "2", script], tmp_path)
    assert result.returncode == 2
    assert f"{said}: {script!r}" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_port_in_use_is_named(tmp_path):
    script = _script(tmp_path, "report.py", REPORT)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = _run([*LAUNCH, "-n", "2", "--master-port", str(port), script], tmp_path)
    assert result.returncode == 2
    assert f"--master-port {port} on 127.0.0.1 cannot be used" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_master_address_that_does_not_resolve_is_named_before_any_process_starts(tmp_path):
    """A node's processes waited three times `--timeout` to join, and said the socket timed
    out, not that the name does not resolve (`.invalid` never resolves: RFC 2606)."""
    script = _script(tmp_path, "report.py", REPORT)
    result = _run([*LAUNCH, "-n", "1", "--nnodes", "2", "--node-rank", "1", "--master-addr",
                   "no-such-host.invalid", "--timeout", "20", script], tmp_path)
    assert result.returncode == 2
    assert "--master-addr 'no-such-host.invalid' does not resolve" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_rank_that_dies_at_start_stops_the_others(tmp_path):
    script = _script(tmp_path, "die.py", f"""
        import os, sys, time
        open(os.path.join({str(tmp_path)!r}, "pid" + os.environ["RANK"]), "w").write(
            str(os.getpid()))
        if os.environ["RANK"] == "1":
            print("rank one cannot start: no data", file=sys.stderr)
            sys.exit(3)
        time.sleep(600)
    """)
    result = _run([*LAUNCH, "-n", "3", script], tmp_path, timeout=120)
    assert result.returncode == 3
    assert "rank 1 of 3 exited with status 3" in result.stderr
    assert "rank one cannot start: no data" in result.stderr
    assert "stopped rank(s) [0, 2]" in result.stderr
    for rank in range(3):
        assert _gone(int((tmp_path / f"pid{rank}").read_text()))


# A model trained on the torch backend; argv: output folder, then "kill", "hang" or "leave"
# to make rank 1 die, stall or exit with status 0 as its second epoch begins.
TRAIN = """
import json, os, signal, sys, time
os.environ["KERAS_BACKEND"] = "torch"
import keras, numpy as np
import keras_multigpu as kmg

out, fault = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
rank = os.environ.get("RANK", "single")
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.BatchNormalization(), keras.layers.Dropout(0.2),
                          keras.layers.Dense(3, activation="softmax")])
rng = np.random.RandomState(0)
x, y = rng.randn(101, 6).astype("float32"), rng.randint(0, 3, 101)


class Fault(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1 and rank == "1" and fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if epoch == 1 and rank == "1" and fault == "hang":
            time.sleep(600)
        if epoch == 1 and rank == "1" and fault == "leave":
            sys.exit(0)


parallel = kmg.multi_gpu_model(model)
parallel.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                 metrics=["accuracy"])
history = parallel.fit(
    x, y, batch_size=20, epochs=40, verbose=0, validation_split=0.2,
    callbacks=[Fault(),
               keras.callbacks.EarlyStopping(monitor="val_loss", patience=1,
                                             min_delta=0.02),
               keras.callbacks.ModelCheckpoint(os.path.join(out, "best.keras"),
                                               monitor="val_loss", save_best_only=True),
               keras.callbacks.CSVLogger(os.path.join(out, "log.csv"))])
parallel.save(os.path.join(out, "last.keras"))
model.save(os.path.join(out, "template.keras"))
again = keras.saving.load_model(os.path.join(out, "last.keras"))  # every rank reads it
result = {"replicas": parallel.num_replicas, "history": history.history,
          "predict": parallel.predict(x, verbose=0).tolist(),
          "reloaded": again.predict(x, verbose=0).tolist()}
with open(os.path.join(out, f"result-{rank}.json"), "w") as f:
    json.dump(result, f)
"""


def _results(folder):
    return {p.name[len("result-"):-len(".json")]: json.loads(p.read_text())
            for p in folder.glob("result-*.json")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The script on one device, in one process (no launcher)."""
    folder = tmp_path_factory.mktemp("single")
    script = _script(folder, "train.py", TRAIN)
    result = _run([sys.executable, script, str(folder)], folder)
    assert result.returncode == 0, result.stderr[-3000:]
    return _results(folder)["single"]


def _assert_one_device(run, reference):
    assert run["history"].keys() == reference["history"].keys()
    for key, values in reference["history"].items():
        np.testing.assert_allclose(run["history"][key], values, rtol=1e-4, atol=1e-6,
                                   err_msg=key)
    np.testing.assert_allclose(run["predict"], reference["predict"], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(run["reloaded"], run["predict"], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("ranks", [2, 3])
def test_launched_ranks_equal_one_device_and_write_one_file(tmp_path, reference, ranks):
    """Uneven batches (101 rows, batch 20, 80/21 split), BatchNorm, Dropout, validation,
    EarlyStopping deciding alike on every rank; checkpoints, CSV log and saves written once,
    and read back by every rank."""
    script = _script(tmp_path, "train.py", TRAIN)
    result = _run([*LAUNCH, "-n", str(ranks), script, str(tmp_path)], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = _results(tmp_path)
    assert sorted(runs) == [str(r) for r in range(ranks)]
    assert len(reference["history"]["loss"]) < 40  # EarlyStopping stopped it
    for run in runs.values():
        assert run["replicas"] == ranks
        _assert_one_device(run, reference)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["train.py", "best.keras", "last.keras", "template.keras", "log.csv",
         *(f"result-{r}.json" for r in range(ranks))])
    rows = (tmp_path / "log.csv").read_text().splitlines()
    assert len(rows) == 1 + len(reference["history"]["loss"])


def test_python_script_relaunches_itself(tmp_path, reference):
    script = _script(tmp_path, "train.py", TRAIN)
    result = _run([sys.executable, script, str(tmp_path)], tmp_path,
                  KERAS_MULTIGPU_CPU_DEVICES="2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("keras_multigpu: relaunching as `keras-multigpu launch -n 2") == 1
    runs = _results(tmp_path)
    assert sorted(runs) == ["0", "1"]
    _assert_one_device(runs["1"], reference)


def test_relaunch_opt_out_trains_on_one_device(tmp_path, reference):
    script = _script(tmp_path, "train.py", TRAIN)
    result = _run([sys.executable, script, str(tmp_path)], tmp_path,
                  KERAS_MULTIGPU_CPU_DEVICES="2", KERAS_MULTIGPU_RELAUNCH="0")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "relaunching" not in result.stderr
    assert "KERAS_MULTIGPU_RELAUNCH=0: training on one of this machine's 2 devices" in (
        result.stderr)
    run = _results(tmp_path)["single"]
    assert run["replicas"] == 1
    _assert_one_device(run, reference)


def test_a_rank_killed_mid_training_is_named(tmp_path):
    script = _script(tmp_path, "train.py", TRAIN)
    result = _run([*LAUNCH, "-n", "2", "--timeout", "60", script, str(tmp_path), "kill"],
                  tmp_path)
    assert result.returncode == 128 + signal.SIGKILL
    assert "rank 1 of 2 was killed by SIGKILL" in result.stderr
    assert not list(tmp_path.glob("result-*.json"))


def test_a_rank_that_leaves_early_with_status_0_is_named(tmp_path):
    """Rank 0 fails waiting for it (a CollectiveError, for a peer): rank 1 was blamed."""
    script = _script(tmp_path, "train.py", TRAIN)
    result = _run([*LAUNCH, "-n", "2", "--timeout", "30", script, str(tmp_path), "leave"],
                  tmp_path, timeout=200)
    assert result.returncode == 1
    assert ("rank 1 of 2 exited with status 0 while the others still ran, and rank 0 then "
            "failed waiting for it") in result.stderr, result.stderr[-3000:]
    assert "stopped rank(s)" not in result.stderr  # both had ended (it said [0])


def test_a_rank_that_hangs_is_caught_by_the_timeout(tmp_path):
    script = _script(tmp_path, "train.py", TRAIN)
    result = _run([*LAUNCH, "-n", "2", "--timeout", "5", script, str(tmp_path), "hang"],
                  tmp_path, timeout=200)
    assert result.returncode == 1
    # rank 0 failed waiting for it, and was named: rank 1 still ran
    assert ("rank 1 of 2 was still running when rank 0 failed waiting for it"
            in result.stderr), result.stderr[-3000:]
    # rank 0 waits for it at the next step boundary's stop agreement, and names it
    assert ("Process 0 of 2 waited 5 s (KERAS_MULTIGPU_TIMEOUT) for process 1 at the step "
            "boundary where every process checks for Ctrl-C" in result.stderr), result.stderr


def test_ctrl_c_reaches_every_rank(tmp_path):
    script = _script(tmp_path, "wait.py", """
        import os, sys, time
        try:
            # Inside the try: a Ctrl-C that lands just after the line is still caught.
            print("ready", flush=True)
            time.sleep(600)
        except KeyboardInterrupt:
            print("rank", os.environ["RANK"], "got Ctrl-C", flush=True)
            sys.exit(130)
    """)
    # A test run started in the background (`cmd &`) ignores SIGINT, and the launcher
    # inherits that: it must not depend on it (it installs its own handler, and resets its
    # processes' to the default).
    launcher = subprocess.Popen([*LAUNCH, "-n", "2", script], cwd=tmp_path, env=_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready = 0
    while ready < 2:
        line = launcher.stdout.readline()
        assert line, launcher.stderr.read()
        ready += line.strip().endswith("ready")
    launcher.send_signal(signal.SIGINT)
    out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 130
    assert "[rank 0] rank 0 got Ctrl-C" in out and "[rank 1] rank 1 got Ctrl-C" in out
    assert "stopped by SIGINT" in err


@pytest.mark.parametrize(("engine", "differs"), [
    ("jax", "model"), ("tensorflow", "model"), ("torch", "model"), ("torch", "data")])
def test_processes_with_different_models_or_data_are_told_so(tmp_path, engine, differs):
    """A process whose model differs from process 0's (a hyperparameter search drawing its
    own trial on each process), or whose data does (a shard per rank, as in a Horovod
    program), is named by every process, before a collective pairs unlike buffers: gloo
    aborted the torch processes (SIGABRT), TensorFlow failed deep in a collective op."""
    script = _script(tmp_path, "differ.py", """
        import os, sys
        import keras, numpy as np
        import keras_multigpu as kmg
        rank, differs = int(os.environ["RANK"]), sys.argv[1]
        units = 8 if rank == 1 and differs == "model" else 4
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(units, name="hidden"),
                                  keras.layers.Dense(1)])
        parallel = kmg.multi_gpu_model(model)
        parallel.compile(optimizer="adam", loss="mse")
        x = np.arange(66.0).reshape(11, 6)
        x = x[rank::2] if differs == "data" else x  # 6 rows on process 0, 5 on process 1
        parallel.fit(x, x[:, :1], batch_size=4, verbose=0)
    """)
    # The launcher reads the engine from KERAS_BACKEND (TensorFlow's workers get TF_CONFIG).
    result = _run([*LAUNCH, "-n", "2", "--timeout", "60", script, differs], tmp_path,
                  KERAS_BACKEND=engine)
    assert result.returncode == 1, result.stderr[-3000:]
    said = {"model": "ValueError: The 2 processes hold different models: variable 0 "
                     "(sequential/hidden/kernel) is float32 of shape (6, 8) on process 1 and "
                     "float32 of shape (6, 4) on process 0.",
            "data": "ValueError: The 2 processes were given different data: 5 rows on "
                    "process 1 and 6 rows on process 0."}[differs]
    # Every process raises it; the launcher reports the first to exit, with its last lines
    # (on JAX, the other may be ended first by jax.distributed, as process 0 leaves).
    report = result.stderr.split("keras-multigpu launch: rank ")[-1]
    assert "of 2 exited with status 1. Its last lines:" in report, result.stderr[-3000:]
    assert said in report, result.stderr[-3000:]


def test_the_jax_engine_trains_across_several_processes(tmp_path):
    """Each process joins the others (jax.distributed) and trains one model on every
    process's devices: the same weights everywhere (see test_multihost_jax.py)."""
    script = _script(tmp_path, "jax_two.py", """
        import os
        os.environ["KERAS_BACKEND"] = "jax"
        import keras, numpy as np
        import keras_multigpu as kmg
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        parallel = kmg.multi_gpu_model(model)
        parallel.compile(optimizer="sgd", loss="mse")
        parallel.fit(np.arange(28.0).reshape(7, 4) / 28, np.ones((7, 2)), batch_size=3,
                     epochs=2, verbose=0)
        total = sum(float(np.sum(w)) for w in model.get_weights())
        print("trained on", parallel.num_replicas, "devices of",
              kmg.backends.current().process_count(), "processes:", round(total, 5))
    """)
    result = _run([*LAUNCH, "-n", "2", script], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if "trained on 2 devices of 2" in line]
    assert sorted(line.split("]")[0] for line in lines) == ["[rank 0", "[rank 1"], result.stdout
    assert lines[0].split(":")[-1] == lines[1].split(":")[-1]


def test_the_jax_engine_runs_unchanged_under_launch_n_1(tmp_path):
    script = _script(tmp_path, "jax_train.py", """
        import os
        os.environ["KERAS_BACKEND"] = "jax"
        import keras, numpy as np
        import keras_multigpu as kmg
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        parallel = kmg.multi_gpu_model(model, gpus=1)
        parallel.compile(optimizer="sgd", loss="mse")
        parallel.fit(np.ones((8, 4)), np.ones((8, 2)), epochs=1, verbose=0)
        print("trained on", keras.backend.backend(), parallel.num_replicas)
    """)
    result = _run([*LAUNCH, "-n", "1", script], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[rank 0] trained on jax 1" in result.stdout
