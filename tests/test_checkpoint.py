"""`keras_multigpu.callbacks.Checkpoint`: exact resume, on every engine, and bad checkpoints.

The resume tests run real processes, as a user's would: a run killed in the
middle of its second epoch (or stopped there by a real Ctrl-C) is started
again with the same program and must end with the weights, and the logs, of
a run that was never interrupted.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import warnings
import zipfile

import keras
import numpy as np
import pytest

import keras_multigpu as kmg
from conftest import child_env, engine_gpus
from keras_multigpu.callbacks import Checkpoint, CheckpointError

pytestmark = pytest.mark.slow  # several processes or whole runs: not in the fast loop

# argv: checkpoint folder, output file, then "die" (os._exit in the middle of epoch 2),
# "ctrl-c" (a SIGINT there), "sigterm" (a SIGTERM there) or nothing. Dropout, BatchNorm,
# shuffling, a decaying learning rate and Adam: every piece of state a resume must restore.
PROGRAM = """
import json, os, signal, sys
import keras, numpy as np
import keras_multigpu as kmg
from keras_multigpu.callbacks import Checkpoint

folder, out = sys.argv[1], sys.argv[2]
fault = sys.argv[3] if len(sys.argv) > 3 else ""
keras.utils.set_random_seed(7)
rng = np.random.RandomState(0)
x = rng.rand(99, 6).astype("float32")
y = (x.sum(1, keepdims=True) > 3).astype("float32")
model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.BatchNormalization(), keras.layers.Dropout(0.3),
                          keras.layers.Dense(1, activation="sigmoid")])
parallel = kmg.multi_gpu_model(model, gpus=int(os.environ.get("GPUS", "2")))
schedule = keras.optimizers.schedules.ExponentialDecay(0.05, 5, 0.7)
parallel.compile(optimizer=keras.optimizers.Adam(schedule), loss="binary_crossentropy",
                 metrics=["accuracy"])


class Fault(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1 and fault == "die-at-epoch-end" and os.environ.get("RANK", "0") == "0":
            os._exit(17)  # after the epoch's checkpoint

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == 1 and batch == 2 and os.environ.get("RANK", "0") == "0":
            if fault == "die":
                os._exit(17)
            if fault in ("ctrl-c", "sigterm"):
                os.kill(os.getpid(), signal.SIGINT if fault == "ctrl-c" else signal.SIGTERM)


every = None if fault == "die-at-epoch-end" else 2  # (Keras's default: epoch ends only)
callbacks = [Checkpoint(folder, save_freq=every or "epoch", keep=2), Fault()]
history = parallel.fit(x, y, batch_size=25, epochs=4, callbacks=callbacks, verbose=0)
if os.environ.get("RANK", "0") == "0":
    np.savez(out, *model.get_weights())
    with open(out + ".json", "w") as f:
        json.dump({k: [float(v) for v in vs] for k, vs in history.history.items()}, f)
"""

ENGINES = {
    # backend: (launcher prefix, environment)
    "jax": ([], {"KERAS_MULTIGPU_CPU_DEVICES": "2"}),
    "tensorflow": ([], {"KERAS_MULTIGPU_CPU_DEVICES": "2"}),
    "torch": (["-m", "keras_multigpu.cli", "launch", "-n", "2", "--quiet-ranks"], {}),
}


def _env(backend, extra):
    drop = ("KERAS_MULTIGPU_CPU_DEVICES", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
            "MASTER_PORT", *(() if backend == "jax" else ("XLA_FLAGS",)))  # JAX's flags
    return child_env(drop, **extra, KERAS_BACKEND=backend)


def _run(tmp_path, backend, folder, out, fault=""):
    prefix, extra = ENGINES[backend]
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    args = [sys.executable, *prefix, str(script), str(folder), str(out)] + (
        [fault] if fault else [])
    # SIGINT at its default: a test run started in the background ignores it.
    return subprocess.run(args, cwd=tmp_path, env=_env(backend, extra), capture_output=True,
                          text=True, timeout=400, check=False, preexec_fn=_sigint_default)


def _sigint_default():
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _weights(path):
    with np.load(path) as loaded:
        return [loaded[k] for k in loaded.files]


_WHOLE = {}


def _whole(tmp_path_factory, backend):
    """The uninterrupted run on `backend` (once per session): the weights and logs to equal."""
    if backend not in _WHOLE:
        folder = tmp_path_factory.mktemp(f"whole-{backend}")
        whole = _run(folder, backend, folder / "ckpt", folder / "whole.npz")
        assert whole.returncode == 0, whole.stderr[-3000:]
        _WHOLE[backend] = folder / "whole.npz"
    return _WHOLE[backend]


def _stopped_and_resumed(tmp_path, backend, fault):
    """The stopped run and its resumption."""
    if backend == "torch":
        pytest.importorskip("torch")

    stopped = _run(tmp_path, backend, tmp_path / "ckpt", tmp_path / "stopped.npz", fault)
    if fault == "die":
        assert stopped.returncode != 0, stopped.stderr[-3000:]
        # every 2 steps of 4 per epoch, the last before step 3 of epoch 2: global step 6
        assert sorted(os.listdir(tmp_path / "ckpt")) == ["ckpt-000000004", "ckpt-000000006"]
    elif fault == "die-at-epoch-end":
        assert stopped.returncode != 0, stopped.stderr[-3000:]
        assert sorted(os.listdir(tmp_path / "ckpt")) == ["ckpt-000000004", "ckpt-000000008"]
    else:
        assert stopped.returncode != 0
        name = {"ctrl-c": "Ctrl-C", "sigterm": "SIGTERM"}[fault]
        assert f"Stopped by {name} at a step boundary" in stopped.stderr, stopped.stderr[-3000:]
        # the signal's checkpoint, at the step boundary after it (epoch 2, 3 steps done)
        assert sorted(os.listdir(tmp_path / "ckpt"))[-1] == "ckpt-000000007"
    assert not (tmp_path / "stopped.npz").exists()

    resumed = _run(tmp_path, backend, tmp_path / "ckpt", tmp_path / "resumed.npz")
    return resumed


@pytest.mark.parametrize("backend", ["jax", "tensorflow", "torch"])
def test_a_run_killed_mid_epoch_resumes_to_the_uninterrupted_weights(
        tmp_path, tmp_path_factory, backend):
    resumed = _stopped_and_resumed(tmp_path, backend, "die")
    _check_resumed(tmp_path, _whole(tmp_path_factory, backend), resumed)


# (Not torch: its launched processes resume through the same Checkpoint as after the
# mid-epoch kill above, and the epoch's order is Keras's on every engine; the test's two
# launches there cost CI 34-49 s.)
@pytest.mark.parametrize("backend", ["jax", "tensorflow"])
def test_a_run_killed_after_an_epoch_resumes_to_the_uninterrupted_weights(
        tmp_path, tmp_path_factory, backend):
    """Checkpoints at epoch ends only (the default): the next epoch draws the order the
    uninterrupted run draws, not the finished epoch's again."""
    resumed = _stopped_and_resumed(tmp_path, backend, "die-at-epoch-end")
    _check_resumed(tmp_path, _whole(tmp_path_factory, backend), resumed, done=2)


@pytest.mark.parametrize("fault", ["ctrl-c", "sigterm"])
def test_a_ctrl_c_or_a_sigterm_checkpoints_at_the_step_boundary_and_resumes_exactly(
        tmp_path, tmp_path_factory, fault):
    """A real SIGINT, or the SIGTERM of a scheduler taking the machine back, through the
    interrupt handler (the engine-independent path: JAX)."""
    resumed = _stopped_and_resumed(tmp_path, "jax", fault)
    _check_resumed(tmp_path, _whole(tmp_path_factory, "jax"), resumed)


def _check_resumed(tmp_path, whole, resumed, done=1):
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Checkpoint: resuming from" in resumed.stdout + resumed.stderr
    for a, b in zip(_weights(whole), _weights(tmp_path / "resumed.npz")):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
    whole_logs = json.loads(whole.with_name("whole.npz.json").read_text())
    resumed_logs = json.loads((tmp_path / "resumed.npz.json").read_text())
    # The resumed fit logs the epochs it ran: the interrupted one (its metrics before the
    # checkpoint restored, gathered from every process on torch) and those after it.
    for key, values in whole_logs.items():
        np.testing.assert_allclose(resumed_logs[key], values[done:], rtol=1e-6, err_msg=key)


# -- in this process (JAX or whichever backend runs the suite) -------------------------


def _model():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1)])
    parallel = kmg.multi_gpu_model(model, gpus=1)
    parallel.compile(optimizer="adam", loss="mse")
    return model, parallel


DATA = (np.random.RandomState(0).rand(40, 4).astype("float32"),
        np.random.RandomState(1).rand(40, 1).astype("float32"))


def test_keeps_the_newest_and_writes_each_whole(tmp_path):
    _, parallel = _model()
    parallel.fit(*DATA, batch_size=8, epochs=3, verbose=0,
                 callbacks=[Checkpoint(tmp_path, save_freq=2, keep=3)])
    names = sorted(os.listdir(tmp_path))
    assert names == ["ckpt-000000012", "ckpt-000000014", "ckpt-000000015"]
    for name in names:
        assert sorted(os.listdir(tmp_path / name)) == ["arrays.npz", "model.keras",
                                                       "state.json"]
        state, _ = Checkpoint.read(str(tmp_path / name))
        assert state["global_step"] == int(name[len("ckpt-"):])
    state, _ = Checkpoint.read(str(tmp_path / "ckpt-000000014"))
    assert (state["epoch"], state["step"], state["num_batches"]) == (2, 4, 5)
    # a plain Keras file: the model and its optimizer, loadable without this library
    loaded = keras.saving.load_model(tmp_path / "ckpt-000000015" / "model.keras")
    assert int(loaded.optimizer.iterations.numpy()) == 15


def test_a_damaged_checkpoint_is_named_and_the_one_before_is_used(tmp_path):
    model, parallel = _model()
    parallel.fit(*DATA, batch_size=8, epochs=2, verbose=0,
                 callbacks=[Checkpoint(tmp_path, keep=5)])
    newest = tmp_path / "ckpt-000000010" / "model.keras"
    newest.write_bytes(newest.read_bytes()[:300])  # truncated, as by a full disk
    with pytest.warns(UserWarning, match="ckpt-000000010 cannot be read") as caught:
        assert Checkpoint(tmp_path).resume_point() == (0, 5)  # asked directly: this line
    assert caught[0].filename == __file__
    checkpoint = Checkpoint(tmp_path, keep=5)
    with pytest.warns(UserWarning, match="ckpt-000000010 cannot be read") as caught:
        parallel.fit(*DATA, batch_size=8, epochs=2, verbose=0, callbacks=[checkpoint])
    assert checkpoint.resumed_from == str(tmp_path / "ckpt-000000005")
    warning, = [w for w in caught if "cannot be read" in str(w.message)]
    assert str(warning.message).endswith("Using the checkpoint before it.")
    assert warning.filename == __file__  # shown at the `fit` call, not in the library


def test_damaged_weights_inside_a_whole_archive_are_named_and_the_one_before_is_used(
        tmp_path):
    """model.keras rewritten whole (its checksums pass) around a damaged weights file: the
    resume stopped with "does not fit this model", where the checkpoint before was whole."""
    import zipfile

    _, parallel = _model()
    parallel.fit(*DATA, batch_size=8, epochs=2, verbose=0,
                 callbacks=[Checkpoint(tmp_path, keep=5)])
    newest = tmp_path / "ckpt-000000010" / "model.keras"
    with zipfile.ZipFile(newest) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    members["model.weights.h5"] = np.random.RandomState(0).bytes(
        len(members["model.weights.h5"]))
    with zipfile.ZipFile(newest, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    checkpoint = Checkpoint(tmp_path, keep=5)
    with pytest.warns(UserWarning, match="ckpt-000000010 cannot be read: .*damaged"):
        parallel.fit(*DATA, batch_size=8, epochs=2, verbose=0, callbacks=[checkpoint])
    assert checkpoint.resumed_from == str(tmp_path / "ckpt-000000005")


def test_a_checkpoint_of_another_backend_warns_that_the_resume_is_not_exact(tmp_path):
    """Each backend draws its own dropout masks: a checkpoint written on another resumed
    without a word, and ended elsewhere (a probe: 0.0045 from its uninterrupted run)."""
    import json

    _, parallel = _model()
    parallel.fit(*DATA, batch_size=8, epochs=1, verbose=0, callbacks=[Checkpoint(tmp_path)])
    state_file = tmp_path / "ckpt-000000005" / "state.json"
    state = json.loads(state_file.read_text())
    assert state["backend"] == keras.backend.backend()
    other = next(b for b in ("jax", "tensorflow") if b != keras.backend.backend())
    state_file.write_text(json.dumps({**state, "backend": other}))
    with pytest.warns(UserWarning, match=f"written on Keras's {other} backend; this run is on "
                      f"{keras.backend.backend()}.*not exact") as caught:
        parallel.fit(*DATA, batch_size=8, epochs=2, verbose=0,
                     callbacks=[Checkpoint(tmp_path)])
    warning, = [w for w in caught if "backend" in str(w.message)]
    assert warning.filename == __file__  # shown at the `fit` call, not in the library


def test_sparse_inputs_save_and_resume(tmp_path):
    """A SciPy sparse `x` has no len(): the row count a checkpoint keeps failed every save."""
    sparse = pytest.importorskip("scipy.sparse")
    x = sparse.csr_matrix(np.where(DATA[0] > 0.5, DATA[0], 0))
    _, parallel = _model()
    parallel.fit(x, DATA[1], batch_size=8, epochs=1, verbose=0,
                 callbacks=[Checkpoint(tmp_path, save_freq=2)])
    state, _ = Checkpoint.read(str(tmp_path / "ckpt-000000005"))
    assert state["rows"] == 40
    checkpoint = Checkpoint(tmp_path)
    parallel.fit(x, DATA[1], batch_size=8, epochs=2, verbose=0, callbacks=[checkpoint])
    assert checkpoint.resumed_from == str(tmp_path / "ckpt-000000005")


def test_steps_per_execution_that_does_not_divide_the_epoch_saves_whole_checkpoints(
        tmp_path):
    """Keras names a multi-step loop's last, short run's step as a whole run's (10 batches
    in runs of 4: hooks at steps 3, 7 and 11): a checkpoint was written at step 12 of 10,
    then skipped as damaged, and the epoch's end was not saved."""
    _, parallel = _model()
    parallel.compile(optimizer="adam", loss="mse", steps_per_execution=4)
    try:
        parallel.fit(*DATA, batch_size=4, epochs=2, verbose=0,
                     callbacks=[Checkpoint(tmp_path, save_freq=4, keep=10)])
    except ValueError as refused:  # Keras 3.15's torch trainer refuses it
        assert keras.backend.backend() == "torch", refused
        assert "steps_per_execution` must be 1" in str(refused), refused
        return
    states = {name: Checkpoint.read(str(tmp_path / name))[0]
              for name in sorted(os.listdir(tmp_path))}
    assert {(s["epoch"], s["step"], s["global_step"]) for s in states.values()} >= {
        (0, 4, 4), (0, 8, 8), (0, 10, 10), (1, 10, 20)}, states.keys()


def test_a_generator_with_steps_per_epoch_saves_at_epoch_ends(tmp_path):
    """A generator's epoch has no known length: each batch's end failed with a TypeError
    (None + int)."""
    _, parallel = _model()

    def batches():
        while True:
            for i in range(0, 40, 8):
                yield DATA[0][i:i + 8], DATA[1][i:i + 8]

    parallel.fit(batches(), steps_per_epoch=3, epochs=2, verbose=0,
                 callbacks=[Checkpoint(tmp_path)])
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000000003", "ckpt-000000006"]
    checkpoint = Checkpoint(tmp_path)  # and resumes at the epoch end
    history = parallel.fit(batches(), steps_per_epoch=3, epochs=3, verbose=0,
                           callbacks=[checkpoint])
    assert checkpoint.resumed_from == str(tmp_path / "ckpt-000000006")
    assert history.epoch == [2] and "ckpt-000000009" in os.listdir(tmp_path)


def _edited_state(folder, **changes):
    state = json.loads((folder / "state.json").read_text())
    state.update(changes)
    (folder / "state.json").write_text(json.dumps({k: v for k, v in state.items()
                                                   if v is not _DROP}))


_DROP = object()
DAMAGES = {  # whole files that hold the wrong things (a hand edit, a copy gone wrong)
    "state of a list": lambda c: (c / "state.json").write_text("[]"),
    "an epoch of text": lambda c: _edited_state(c, epoch="one"),
    "no step": lambda c: _edited_state(c, step=_DROP),
    "a model without weights": lambda c: zipfile.ZipFile(c / "model.keras", "w").close(),
    "no arrays": lambda c: np.savez(c / "arrays.npz"),
    "optimizers' weights of text": lambda c: _edited_state(c, optimizer_weights="g"),
    # (A negative step count named the next checkpoints below this one's.)
    "a negative global step": lambda c: _edited_state(c, global_step=-5),
    "a step past its epoch": lambda c: _edited_state(c, step=99),
    "a batch size of text": lambda c: _edited_state(c, batch_size="8"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_checkpoint_whose_files_hold_the_wrong_things_is_named_and_passed_over(
        tmp_path, damage):
    """Read as damaged, named in a warning, and the checkpoint before it used: fit failed
    with an AttributeError (a list), a TypeError (text), a bare KeyError (no step, and
    zipfile's for no weights), and arrays.npz emptied of the data's order and the metrics
    resumed the epoch with other logs and no warning (state.json lists what it holds)."""
    _, parallel = _model()
    parallel.fit(*DATA, batch_size=8, epochs=1, verbose=0,
                 callbacks=[Checkpoint(tmp_path, save_freq=2, keep=5)])
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000000002", "ckpt-000000004",
                                            "ckpt-000000005"]
    shutil.rmtree(tmp_path / "ckpt-000000005")
    DAMAGES[damage](tmp_path / "ckpt-000000004")  # mid-epoch: it has the data's order
    checkpoint = Checkpoint(tmp_path, save_freq=2, keep=5)
    with pytest.warns(UserWarning, match="ckpt-000000004 cannot be read"):
        parallel.fit(*DATA, batch_size=8, epochs=1, verbose=0, callbacks=[checkpoint])
    assert checkpoint.resumed_from == str(tmp_path / "ckpt-000000002")


def test_a_file_in_a_checkpoints_place_is_removed_when_retired(tmp_path):
    """A file named as a checkpoint is passed over, then retired as the oldest: removed,
    where the folders' removal left it under a hidden name for good."""
    (tmp_path / "ckpt-000000001").write_text("not a checkpoint")
    _, parallel = _model()
    with pytest.warns(UserWarning, match="ckpt-000000001 cannot be read"), pytest.raises(
            CheckpointError, match="No checkpoint in .* can be read"):
        parallel.fit(*DATA, batch_size=8, epochs=1, verbose=0,
                     callbacks=[Checkpoint(tmp_path, keep=1)])
    parallel.fit(*DATA, batch_size=8, epochs=1, verbose=0,
                 callbacks=[Checkpoint(tmp_path, keep=1, resume=False)])
    assert os.listdir(tmp_path) == ["ckpt-000000005"]


def test_a_checkpoint_that_cannot_be_deleted_is_named(tmp_path, monkeypatch):
    """A folder without write permission (run as another user) was left hidden, with no
    word, each retired checkpoint adding its space. (As root, permissions remove nothing:
    the removal itself fails here.)"""
    _, parallel = _model()
    monkeypatch.setattr(shutil, "rmtree", lambda path, ignore_errors=False: None)
    with pytest.warns(UserWarning, match=r"could not delete .*\.ckpt-000000005\.old-\d+ "
                      r"\(no permission\?\): its space stays taken"):
        parallel.fit(*DATA, batch_size=8, epochs=2, verbose=0,
                     callbacks=[Checkpoint(tmp_path, keep=1)])
    assert "ckpt-000000010" in os.listdir(tmp_path)


def test_only_damaged_checkpoints_stop_fit_with_their_names(tmp_path):
    _, parallel = _model()
    parallel.fit(*DATA, batch_size=8, epochs=1, verbose=0, callbacks=[Checkpoint(tmp_path)])
    (tmp_path / "ckpt-000000005" / "state.json").write_text("{not json")
    # The oldest is not said to be passed over for one before it (there is none).
    with pytest.warns(UserWarning, match="ckpt-000000005 cannot be read.*It is the oldest "
                      "there"), pytest.raises(CheckpointError,
                                              match="No checkpoint in .* can be read"):
        parallel.fit(*DATA, batch_size=8, epochs=2, verbose=0, callbacks=[Checkpoint(tmp_path)])


def test_a_half_written_checkpoint_is_never_read_and_is_cleaned_up(tmp_path):
    _, parallel = _model()
    parallel.fit(*DATA, batch_size=8, epochs=1, verbose=0, callbacks=[Checkpoint(tmp_path)])
    # What a SIGKILL in the middle of a save leaves: a hidden folder of a dead process.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    leftover = tmp_path / f".ckpt-000000007.tmp-{dead}"
    leftover.mkdir()
    (leftover / "model.keras").write_bytes(b"PK\x03\x04 half")
    checkpoint = Checkpoint(tmp_path)
    parallel.fit(*DATA, batch_size=8, epochs=2, verbose=0, callbacks=[checkpoint])
    assert checkpoint.resumed_from == str(tmp_path / "ckpt-000000005")
    assert not leftover.exists()


PRUNED = """
import os, shutil, sys
os.environ.setdefault("KERAS_BACKEND", "jax")  # the test's own
import keras, numpy as np
import keras_multigpu as kmg
from keras_multigpu import callbacks, checkpoint

real_rmtree = shutil.rmtree

def killed_midway(path, ignore_errors=False):
    # Pruning an old checkpoint deletes one file of it, then the process is killed (SIGKILL).
    name = os.path.basename(path)
    if not (name.startswith("ckpt-") or ".old-" in name):  # not a checkpoint being pruned
        return real_rmtree(path, ignore_errors=ignore_errors)
    os.remove(os.path.join(path, "model.keras"))
    os._exit(9)

keras.utils.set_random_seed(1)  # the model of _model() below
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                          keras.layers.Dense(1)])
parallel = kmg.multi_gpu_model(model, gpus=1)
parallel.compile(optimizer="adam", loss="mse")
x, y = np.ones((16, 4), "float32"), np.ones((16, 1), "float32")
parallel.fit(x, y, batch_size=8, epochs=2, verbose=0,
             callbacks=[callbacks.Checkpoint(sys.argv[1], keep=2)])
checkpoint.shutil.rmtree = killed_midway  # the 3rd checkpoint retires the 1st
parallel.fit(x, y, batch_size=8, epochs=3, verbose=0,
             callbacks=[callbacks.Checkpoint(sys.argv[1], keep=2)])
"""


def test_a_kill_while_pruning_leaves_no_damaged_checkpoint(tmp_path):
    env = child_env(("KERAS_MULTIGPU_CPU_DEVICES",))
    result = subprocess.run([sys.executable, "-c", PRUNED, str(tmp_path)], env=env,
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 9, result.stderr[-3000:]
    # The half-removed folder is not under a checkpoint's name: every checkpoint reads.
    found = Checkpoint(tmp_path).checkpoints()
    assert [os.path.basename(p) for p in found] == ["ckpt-000000004", "ckpt-000000006"]
    for path in found:
        Checkpoint.read(path)
    _, parallel = _model()
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*cannot be read")
        checkpoint = Checkpoint(tmp_path, keep=2)
        parallel.fit(np.ones((16, 4), "float32"), np.ones((16, 1), "float32"), batch_size=8,
                     epochs=4, verbose=0, callbacks=[checkpoint])
    assert checkpoint.resumed_from == str(tmp_path / "ckpt-000000006")
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000000006", "ckpt-000000008"]  # cleaned up


def test_a_full_disk_names_the_checkpoint_and_keeps_the_earlier_ones(tmp_path, monkeypatch):
    import errno

    from keras.src.saving import saving_api

    _, parallel = _model()
    parallel.fit(*DATA, batch_size=8, epochs=1, verbose=0, callbacks=[Checkpoint(tmp_path)])
    real = saving_api.save_model

    def full(model, filepath, *args, **kwargs):
        with open(filepath, "wb") as f:
            f.write(b"PK\x03\x04 part of a file")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(saving_api, "save_model", full)
    with pytest.raises(OSError, match=r"Checkpoint could not write .*ckpt-000000010 \(epoch 2, "
                       r"step 5\): No space left on device\. The disk is full"):
        parallel.fit(*DATA, batch_size=8, epochs=2, verbose=0, callbacks=[Checkpoint(tmp_path)])
    monkeypatch.setattr(saving_api, "save_model", real)
    assert os.listdir(tmp_path) == ["ckpt-000000005"]  # nothing half-written left
    Checkpoint.read(str(tmp_path / "ckpt-000000005"))


def test_a_checkpoint_of_other_data_is_refused(tmp_path):
    _, parallel = _model()
    parallel.fit(*DATA, batch_size=8, epochs=1, verbose=0, callbacks=[Checkpoint(tmp_path)])
    with pytest.raises(CheckpointError, match=r"5 steps per epoch \(batch_size=8, 40 rows\); "
                                              r"this fit has 3 \(batch_size=16, 40 rows\)"):
        parallel.fit(*DATA, batch_size=16, epochs=2, verbose=0,
                     callbacks=[Checkpoint(tmp_path)])
    # Another batch size of as many steps (40 rows in 5 batches of 9): resumed before.
    with pytest.raises(CheckpointError, match=r"5 steps per epoch \(batch_size=8, 40 rows\); "
                                              r"this fit has 5 \(batch_size=9, 40 rows\)"):
        parallel.fit(*DATA, batch_size=9, epochs=2, verbose=0,
                     callbacks=[Checkpoint(tmp_path)])
    # Other data of as many steps of as many rows (39 rows in 5 batches of 8): resumed before,
    # with a warning that blamed the seed.
    with pytest.raises(CheckpointError, match=r"5 steps per epoch \(batch_size=8, 40 rows\); "
                                              r"this fit has 5 \(batch_size=8, 39 rows\)"):
        parallel.fit(*(a[:39] for a in DATA), batch_size=8, epochs=2, verbose=0,
                     callbacks=[Checkpoint(tmp_path)])


def test_a_checkpoint_of_another_model_names_the_variable_not_its_values(tmp_path):
    _, parallel = _model()
    parallel.fit(*DATA, batch_size=8, epochs=1, verbose=0, callbacks=[Checkpoint(tmp_path)])
    wider = kmg.multi_gpu_model(keras.Sequential([
        keras.Input((4,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]),
        gpus=1)
    wider.compile(optimizer="adam", loss="mse")
    with pytest.raises(CheckpointError, match=r"does not fit this model") as info:
        wider.fit(*DATA, batch_size=8, epochs=2, verbose=0, callbacks=[Checkpoint(tmp_path)])
    said = str(info.value)
    assert "shape=(4, 16)" in said and "value=" not in said and len(said) < 1500, said


def test_a_checkpoint_of_every_epoch_asked_says_it_trains_nothing(tmp_path):
    _, parallel = _model()
    parallel.fit(*DATA, batch_size=8, epochs=2, verbose=0, callbacks=[Checkpoint(tmp_path)])
    with pytest.warns(UserWarning, match=r"has 2 epoch\(s\) done, and this fit asks for "
                                         r"epochs=2: it trains nothing"):
        history = parallel.fit(*DATA, batch_size=8, epochs=2, verbose=0,
                               callbacks=[Checkpoint(tmp_path)])
    assert history.history == {}


@pytest.mark.parametrize("where, said", [
    ("", "it is a Checkpoint's directory, not one of its checkpoints. Pass a checkpoint's "
         "folder, such as .*ckpt-000000005"),
    ("nothing", "it is not there"),
    ("ckpt-000000005/state.json", "it is a file, not a checkpoint's folder")])
def test_reading_what_is_not_a_checkpoint_says_so(tmp_path, where, said):
    _, parallel = _model()
    parallel.fit(*DATA, batch_size=8, epochs=1, verbose=0, callbacks=[Checkpoint(tmp_path)])
    with pytest.raises(CheckpointError, match=said):
        Checkpoint.read(str(tmp_path / where))


@pytest.mark.parametrize("stamped", [True, False])
def test_a_checkpoint_of_another_optimizer_is_refused(tmp_path, stamped):
    """Keras loads what fits of another optimizer's state and warns of the rest (here none
    of Adam's moments, nor its step count): a resume from it is not exact. A checkpoint
    names its optimizer; one written before it did is refused by Keras's warning."""
    _, parallel = _model()
    parallel.fit(*DATA, batch_size=8, epochs=1, verbose=0, callbacks=[Checkpoint(tmp_path)])
    if not stamped:
        (written,) = [tmp_path / name for name in os.listdir(tmp_path)]
        state = json.loads((written / "state.json").read_text())
        del state["optimizers"]
        (written / "state.json").write_text(json.dumps(state))
    model, _ = _model()
    parallel = kmg.multi_gpu_model(model, gpus=1)
    parallel.compile(optimizer="sgd", loss="mse")
    match = r"the optimizers \['Adam'\]; this model has \['SGD'\]" if stamped else (
        "Skipping variable")
    with pytest.raises(CheckpointError, match=match):
        parallel.fit(*DATA, batch_size=8, epochs=2, verbose=0,
                     callbacks=[Checkpoint(tmp_path)])
    assert int(parallel.optimizer.iterations.value) == 0


class TwoNetworks(keras.Model):
    """A CycleGAN's shape: two networks, each trained by its own Adam (whose moments and
    step count a resume must restore), which the model's own `compile` takes."""

    def __init__(self):
        super().__init__()
        self.g = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, activation="tanh")])
        self.f = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, activation="tanh")])
        self.trackers = [keras.metrics.Mean(name="g_loss"), keras.metrics.Mean(name="f_loss")]

    def call(self, x):
        return self.f(self.g(x))

    def compile(self, g_optimizer, f_optimizer):
        super().compile()
        self.g_optimizer, self.f_optimizer = g_optimizer, f_optimizer

    @property
    def metrics(self):
        return self.trackers

    def _loss(self, index, x, y):
        ops = keras.ops
        fake = self.g(x, training=True)
        cycle = ops.mean(ops.abs(x - self.f(fake, training=True)))
        if index == 0:
            return ops.mean(ops.square(fake - y)) + cycle
        return ops.mean(ops.square(self.f(y, training=True) - x)) + cycle

    def train_step(self, data):
        x, y = data
        for index, (network, optimizer) in enumerate(((self.g, self.g_optimizer),
                                                      (self.f, self.f_optimizer))):
            variables = network.trainable_weights
            if keras.backend.backend() == "torch":
                self.zero_grad()
                loss = self._loss(index, x, y)
                loss.backward()
                grads = [v.value.grad for v in variables]
            else:
                import tensorflow as tf

                with tf.GradientTape() as tape:
                    loss = self._loss(index, x, y)
                grads = tape.gradient(loss, variables)
            optimizer.apply(grads, variables)
            self.trackers[index].update_state(loss)
        return {m.name: m.result() for m in self.trackers}


@pytest.mark.skipif(keras.backend.backend() == "jax", reason="a step with optimizers of its "
                    "own is written per framework (tape, backward); JAX's stateless step "
                    "carries the compiled optimizer's state alone")
@pytest.mark.parametrize("gpus", [2])
def test_a_models_own_optimizers_resume_their_state(tmp_path, gpus):
    """A GAN's optimizers, given to its own `compile`, are built by their first step, after a
    checkpoint loads: their state did not load (a warning said so), and the resume was not
    exact (weights 0.05 from the uninterrupted run's on TensorFlow). The checkpoint names
    the weights each was built on, and the resume builds each so before loading it."""
    x = DATA[0]
    y = np.tanh(x @ np.random.RandomState(2).randn(4, 4)).astype("float32")

    def run(*callbacks):
        keras.utils.set_random_seed(1)
        model = TwoNetworks()
        parallel = kmg.multi_gpu_model(model, gpus=engine_gpus(gpus))
        parallel.compile(keras.optimizers.Adam(0.02), keras.optimizers.Adam(0.03))
        parallel.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=list(callbacks))
        return model

    class Stop(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.g_optimizer.iterations.numpy()) == 7:
                raise RuntimeError("stop here")

    expected = run().get_weights()
    with pytest.raises(RuntimeError, match="stop here"):
        run(Checkpoint(tmp_path, save_freq=1), Stop())
    checkpoint = Checkpoint(tmp_path, save_freq=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # "... is not restored"
        resumed = run(checkpoint)
    assert checkpoint.resumed_from == str(tmp_path / "ckpt-000000007")
    for a, b in zip(expected, resumed.get_weights()):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)


def test_bad_arguments_and_inputs_are_refused_clearly(tmp_path):
    with pytest.raises(ValueError, match="save_freq must be 'epoch' .* Received: save_freq=0"):
        Checkpoint(tmp_path, save_freq=0)
    with pytest.raises(ValueError, match="Received: save_freq='batch'"):
        Checkpoint(tmp_path, save_freq="batch")
    with pytest.raises(ValueError, match="not both"):
        Checkpoint(tmp_path, save_freq=2, every_steps=3)
    assert Checkpoint(tmp_path, every_steps=3).save_freq == 3  # the earlier name
    with pytest.raises(ValueError, match="every_steps must be an int >= 1 .* every_steps=-1"):
        Checkpoint(tmp_path, every_steps=-1)
    assert Checkpoint(tmp_path).every_steps is None
    with pytest.raises(ValueError, match="keep must be an int >= 1"):
        Checkpoint(tmp_path, keep="3")
    with pytest.raises(TypeError, match="resume must be True or False. Received: resume='no'"):
        Checkpoint(tmp_path, resume="no")  # a string is true: it would resume
    model, parallel = _model()
    with pytest.raises(TypeError, match="Checkpoint needs a ParallelModel"):
        model.fit(*DATA, epochs=1, verbose=0, callbacks=[Checkpoint(tmp_path)])

    def batches():
        while True:
            yield DATA[0][:8], DATA[1][:8]

    with pytest.raises(ValueError, match="cannot resume there"):
        parallel.fit(batches(), steps_per_epoch=2, epochs=1, verbose=0,
                     callbacks=[Checkpoint(tmp_path, save_freq=1)])


def test_a_folder_that_cannot_be_written_fails_at_the_start(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("a file where the folder should go")
    _, parallel = _model()
    for folder in (blocked / "ckpt", blocked):  # (the second said "File exists")
        with pytest.raises(OSError, match=f"Checkpoint cannot write to {folder}: .*a-file is "
                                          "a file, not a folder"):
            parallel.fit(*DATA, batch_size=8, epochs=1, verbose=0,
                         callbacks=[Checkpoint(folder)])
    assert int(parallel.optimizer.iterations.numpy()) == 0  # refused before any step


@pytest.mark.ranks(2)
def test_a_folder_that_cannot_be_written_stops_every_process(tmp_path):
    """Process 0 checks the folder, and every process raises: none goes on to wait in the
    first step for a process 0 that caught the error (torch's two processes here)."""
    blocked = tmp_path / "a-file"
    if os.environ.get("RANK", "0") == "0":
        blocked.write_text("a file where the folder should go")
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    parallel = kmg.multi_gpu_model(model, gpus=engine_gpus(2))
    parallel.compile(optimizer="sgd", loss="mse")
    with pytest.raises(OSError, match="Checkpoint cannot write to .*a-file/ckpt"):
        parallel.fit(*DATA, batch_size=8, epochs=1, verbose=0,
                     callbacks=[Checkpoint(blocked / "ckpt")])
    assert int(parallel.optimizer.iterations.numpy()) == 0
    # The program caught it and goes on, every process alike.
    parallel.fit(*DATA, batch_size=8, epochs=1, verbose=0)
    assert int(parallel.optimizer.iterations.numpy()) == 5


def test_resume_false_starts_afresh(tmp_path):
    _, parallel = _model()
    parallel.fit(*DATA, batch_size=8, epochs=1, verbose=0, callbacks=[Checkpoint(tmp_path)])
    checkpoint = Checkpoint(tmp_path, resume=False)
    history = parallel.fit(*DATA, batch_size=8, epochs=1, verbose=0, callbacks=[checkpoint])
    assert checkpoint.resumed_from is None and len(history.history["loss"]) == 1


def test_a_pydataset_resumes_mid_epoch(tmp_path):
    """A PyDataset's batch order is drawn from Python's generator: restored too."""

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 5

        def __getitem__(self, index):
            return DATA[0][index * 8:(index + 1) * 8], DATA[1][index * 8:(index + 1) * 8]

    class Stop(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.model.optimizer.iterations.numpy() == 7:
                raise RuntimeError("stop here")

    _, whole = _model()
    whole.fit(Batches(), epochs=3, verbose=0, shuffle=True)
    expected = whole.get_weights()

    _, stopped = _model()
    with pytest.raises(RuntimeError, match="stop here"):
        stopped.fit(Batches(), epochs=3, verbose=0, shuffle=True,
                    callbacks=[Checkpoint(tmp_path, save_freq=1), Stop()])
    _, resumed = _model()
    checkpoint = Checkpoint(tmp_path, save_freq=1)
    resumed.fit(Batches(), epochs=3, verbose=0, shuffle=True, callbacks=[checkpoint])
    assert checkpoint.resumed_from == str(tmp_path / "ckpt-000000007")
    for a, b in zip(expected, resumed.get_weights()):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)


def test_a_finished_epoch_resumes_at_the_next(tmp_path):
    _, parallel = _model()
    parallel.fit(*DATA, batch_size=8, epochs=2, verbose=0, callbacks=[Checkpoint(tmp_path)])
    again = Checkpoint(tmp_path)
    history = parallel.fit(*DATA, batch_size=8, epochs=3, verbose=0, callbacks=[again])
    assert again.resumed_from == str(tmp_path / "ckpt-000000010")
    assert len(history.history["loss"]) == 1  # only the third epoch was left
    assert int(parallel.optimizer.iterations.numpy()) == 15


def _reshuffling_dataset():
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices(DATA).shuffle(40, seed=3).batch(8)


def _shuffling_loader():
    torch = pytest.importorskip("torch")
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
        *(torch.from_numpy(a) for a in DATA)), batch_size=8, shuffle=True)


@pytest.mark.parametrize("make, named", [
    (_reshuffling_dataset, "a tf.data.Dataset"),
    (_shuffling_loader, "a torch DataLoader"),
])
def test_an_input_that_keeps_its_own_order_is_named_when_a_later_epoch_resumes(
        tmp_path, make, named):
    """A tf.data dataset that reshuffles each pass draws its orders from its own pass count,
    which no checkpoint holds: the resumed epochs are read from the dataset's start, and
    the user is told so (measured: weights 4.9e-3 from an uninterrupted run's). A shuffling
    DataLoader draws from torch's generator, which the torch engine's checkpoint keeps (its
    resume is exact there); on the other engines, it is the loader's own."""
    import warnings

    _, parallel = _model()
    parallel.fit(make(), epochs=2, verbose=0, callbacks=[Checkpoint(tmp_path)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parallel.fit(make(), epochs=3, verbose=0, callbacks=[Checkpoint(tmp_path)])
    said = [str(w.message) for w in caught if str(w.message).startswith("Checkpoint")]
    if named == "a torch DataLoader" and keras.backend.backend() == "torch":
        assert said == []
    else:
        assert len(said) == 1 and f"input is {named}," in said[0], said
        assert "The resumed epochs (3 on)" in said[0]


def test_arrays_resume_a_later_epoch_without_a_warning(tmp_path):
    import warnings

    _, parallel = _model()
    parallel.fit(*DATA, batch_size=8, epochs=2, verbose=0, callbacks=[Checkpoint(tmp_path)])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Checkpoint")
        parallel.fit(*DATA, batch_size=8, epochs=3, verbose=0, callbacks=[Checkpoint(tmp_path)])
