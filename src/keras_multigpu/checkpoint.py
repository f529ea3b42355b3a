"""`Checkpoint`: saves what a run needs to resume exactly, mid-epoch included, and resumes
from it when `fit` starts. Each checkpoint is a folder written whole or not at all."""

import contextlib
import json
import math
import os
import shutil
import warnings
import zipfile

import h5py
import keras
import numpy as np

from keras_multigpu import _io, backends, processes
from keras_multigpu._checkpoint_state import (
    CheckpointError,
    CheckpointState,
    _checked_state,
    _epoch_batches,
    _metric_state,
)

_PREFIX = "ckpt-"


def _fsync_tree(directory):
    for name in os.listdir(directory):
        with open(os.path.join(directory, name), "rb") as f:
            os.fsync(f.fileno())
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _retire(path):
    """Removes checkpoint folder `path` without ever leaving a half-removed folder under a
    checkpoint's name: renamed to a hidden name first (atomic), then deleted (a kill in
    between leaves a hidden leftover that the next run's start removes)."""
    directory, name = os.path.split(path)
    old = os.path.join(directory, f".{name}.old-{os.getpid()}")
    os.replace(path, old)
    _remove(old)


def _remove(path):
    """Removes a folder, or a file in a checkpoint's place, as far as it can; what is left
    (a folder without write permission) is named in a warning, as it holds a checkpoint's
    space that each failed removal adds to."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.remove(path)
    if os.path.lexists(path):
        warnings.warn(f"Checkpoint could not delete {path} (no permission?): its space stays "
                      "taken. Delete it by hand.", stacklevel=2)


def _dead_leftover(name):
    """A `.ckpt-*.tmp-<pid>` or `.old-<pid>` folder whose writer is gone."""
    if not name.startswith("." + _PREFIX) or "-" not in name:
        return False
    owner = name.rsplit("-", 1)[-1]
    return owner.isdigit() and int(owner) != os.getpid() and not _io._alive(int(owner))


class Checkpoint(CheckpointState, keras.callbacks.Callback):
    """Saves what a run needs to resume exactly, and resumes from it when `fit` starts.

    Keras's `BackupAndRestore` resumes at the start of the epoch it was
    interrupted in, with the weights of the middle of it, and keeps no
    generator state or data position: the resumed run is another run. This
    callback keeps, in each checkpoint (a folder `ckpt-<step>` of
    `directory`):

    - `model.keras`: the model with its optimizer state (so the learning-rate
      schedule's position, the optimizer's iteration count), a plain Keras file;
    - `state.json`: the epoch, the step within it, the global step, the
      optimizers' classes and the weights each was built on (a GAN's own, which
      their first step builds, are built so before their state loads), the
      generators the data order is drawn from (as the
      epoch started) and Python's and NumPy's global generators; the batch
      size, the rows of arrays, the replica count and the Keras backend;
    - `arrays.npz`: the epoch's data order as read so far, the states of the
      model's `SeedGenerator`s (Dropout masks, noise) and of the metrics.

    Resuming (the next `fit` with this callback, after a crash, a kill or a
    Ctrl-C) loads the newest readable checkpoint, restores every state, and
    draws the interrupted epoch's order again, serving only its remaining
    batches: the run ends with the weights an uninterrupted run has, when
    the program sets the same seed (`keras.utils.set_random_seed`) and builds
    the same model. Keras shows the resumed epoch with its remaining steps.

    A checkpoint appears whole or not at all: it is written to a hidden folder
    and renamed. One that cannot be read (a truncated file, a damaged archive)
    is named in a warning and the one before it is used. With several
    processes, the first writes and every one reads.

    Needs a `ParallelModel` (`multi_gpu_model(model, gpus=1)` for one
    device), whose `fit` knows the data position. Other callbacks' own state
    (EarlyStopping's patience, ReduceLROnPlateau's) is not kept.

    Args:
        directory: the folder of checkpoints (created if missing).
        save_freq: `"epoch"` (the default) saves at each epoch's end; an
            int N saves every N training steps too, as Keras's
            `ModelCheckpoint(save_freq=N)` and `BackupAndRestore` count
            them. Mid-epoch saves need arrays or a `PyDataset` of known
            length as input. Other inputs resume at epoch ends, read from
            their start: a tf.data dataset or a generator keeps its own
            random state (a warning says so when a later epoch resumes).
        keep: how many checkpoints to keep, the newest (at least 1).
        resume: whether `fit` resumes from the newest checkpoint found.
        every_steps: the same as an int `save_freq` (its earlier name).
    """

    def __init__(self, directory, save_freq="epoch", keep=3, resume=True, every_steps=None):
        super().__init__()
        if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
            raise TypeError(f"directory must be a folder path. Received: {directory!r}.")
        name, choices = "save_freq", "'epoch' (a checkpoint at each epoch's end) or an int >= 1"
        if every_steps is not None:
            name, choices = "every_steps", "an int >= 1"
            if save_freq != "epoch":
                raise ValueError(
                    "Pass save_freq or every_steps (its earlier name), not both. Received: "
                    f"save_freq={save_freq!r}, every_steps={every_steps!r}.")
            save_freq = every_steps
        if save_freq != "epoch" and (isinstance(save_freq, bool) or not isinstance(
                save_freq, (int, np.integer)) or save_freq < 1):
            raise ValueError(
                f"{name} must be {choices} "
                f"(every that many steps, and at epoch ends). Received: {name}={save_freq!r}."
            )
        if isinstance(keep, bool) or not isinstance(keep, (int, np.integer)) or keep < 1:
            raise ValueError(f"keep must be an int >= 1. Received: keep={keep!r}.")
        if not isinstance(resume, (bool, np.bool_)):
            raise TypeError(f"resume must be True or False. Received: resume={resume!r}.")
        self.directory = os.fspath(directory)
        self.save_freq = save_freq
        self.every_steps = None if save_freq == "epoch" else int(save_freq)
        self.keep = int(keep)
        self.resume = bool(resume)
        self.resumed_from = None  # the checkpoint `fit` resumed from, if any
        self._found = None  # the checkpoint `resume_point` read, for `on_train_begin`
        self._reset_position()

    def _reset_position(self):
        self._epoch = 0
        self._in_epoch = 0
        self._offset = 0  # steps of the resumed epoch done before the resume
        self._resumed_epoch = None
        self._global = 0
        self._epoch_start_global = 0
        self._pending_metrics = None
        self._last_saved = None

    # -- where things are ------------------------------------------------

    def _parallel(self):
        model = self.model
        if not hasattr(model, "_fit_dataset"):
            raise TypeError(
                "Checkpoint needs a ParallelModel, whose fit knows the data position. "
                f"Received a {type(model).__name__}. Wrap it: "
                "keras_multigpu.multi_gpu_model(model, gpus=1) trains on one device."
            )
        return model

    def _writer(self):
        return self.model._backend.process_index() == 0

    def checkpoints(self):
        """The checkpoint folders in `directory`, oldest first."""
        if not os.path.isdir(self.directory):
            return []
        names = sorted(n for n in os.listdir(self.directory)
                       if n.startswith(_PREFIX) and n[len(_PREFIX):].isdigit())
        return [os.path.join(self.directory, n) for n in names]

    # -- reading ---------------------------------------------------------

    @staticmethod
    def read(path):
        """The state of checkpoint `path`: `(state, arrays)`; a `CheckpointError` if damaged."""
        try:
            inside = sorted(n for n in os.listdir(path)
                            if n.startswith(_PREFIX) and n[len(_PREFIX):].isdigit())
        except OSError:  # not a folder, or not one to list (then read below, and named)
            inside = []
        if not os.path.isdir(path) or inside and not os.path.exists(
                os.path.join(path, "state.json")):
            what = ("a Checkpoint's directory, not one of its checkpoints" if inside else
                    "a file, not a checkpoint's folder" if os.path.exists(path) else
                    "not there")
            raise CheckpointError(
                f"Checkpoint {path} cannot be read: it is {what}. Pass a checkpoint's folder"
                + (f", such as {os.path.join(path, inside[-1])}." if inside else
                   f" ({_PREFIX}<step>, in the directory given to Checkpoint)."))
        try:
            with open(os.path.join(path, "state.json")) as f:
                state = _checked_state(json.load(f))
            with np.load(os.path.join(path, "arrays.npz")) as loaded:
                arrays = {key: loaded[key] for key in loaded.files}
            missing = sorted(set(state.get("arrays", ())) - set(arrays))
            if missing:
                raise CheckpointError(f"arrays.npz lacks {missing}")
            with zipfile.ZipFile(os.path.join(path, "model.keras")) as archive:
                bad = archive.testzip()
                if bad is not None:
                    raise CheckpointError(f"model.keras: {bad} fails its checksum")
                if "model.weights.h5" not in archive.namelist():
                    raise CheckpointError("model.keras holds no model.weights.h5")
                with archive.open("model.weights.h5") as weights, h5py.File(weights) as h5:
                    h5.visit(lambda name: None)  # HDF5's own structure, read whole
        except (OSError, ValueError, KeyError, EOFError, RuntimeError,  # (h5py's unmapped)
                zipfile.BadZipFile) as error:
            raise CheckpointError(
                f"Checkpoint {path} cannot be read: {type(error).__name__}: {error}. It is "
                "truncated or damaged (a crash while it was copied, a full disk?)."
            ) from error
        return state, arrays

    def _newest_readable(self, stacklevel=3):
        found = self.checkpoints()
        for index in reversed(range(len(found))):
            try:
                return found[index], *self.read(found[index])
            except CheckpointError as error:
                then = "Using the checkpoint before it." if index else "It is the oldest there."
                warnings.warn(f"{error} {then}", stacklevel=stacklevel)
        if found:
            raise CheckpointError(
                f"No checkpoint in {self.directory} can be read ({len(found)} found, all "
                "damaged; see the warnings). Move the folder away to start afresh, or pass "
                "resume=False."
            )
        return None

    # -- writing ---------------------------------------------------------

    def _prepare_directory(self):
        _io.writable_folder(self.directory, f"Checkpoint cannot write to {self.directory}",
                            "Pass a folder this process can write to.")
        for name in os.listdir(self.directory):
            if _dead_leftover(name):
                _remove(os.path.join(self.directory, name))

    def _prepare_directory_everywhere(self):
        """`_prepare_directory` on process 0, whose outcome every process learns: where it
        fails, each raises, rather than going on to wait in the first step's collectives
        for a process 0 that stopped (or caught the error and went on elsewhere)."""
        problem = None
        if self._writer():
            try:
                self._prepare_directory()
            except OSError as error:
                problem = error
        said = processes.all_gather_object(
            None if problem is None else str(problem), "the Checkpoint's check of its folder")
        if problem is not None:
            raise problem
        if said[0] is not None:
            raise OSError(f"Process 0 could not prepare the Checkpoint's folder: {said[0]}")

    def save(self, epoch, step):
        """Writes a checkpoint of the position `(epoch, step)` (steps done in `epoch`).

        A checkpoint that cannot be written (a full disk) raises an `OSError` naming it;
        the checkpoints before it stay whole, and nothing half-written is left.
        """
        model = self._parallel()
        if self._last_saved == self._global:
            return
        sync = getattr(model, "jax_state_sync", None)
        if sync is not None:
            sync()  # JAX keeps the state out of the variables within an epoch
        name = f"{_PREFIX}{self._global:09d}"
        final = os.path.join(self.directory, name)
        tmp = os.path.join(self.directory, f".{name}.tmp-{os.getpid()}")
        writer = self._writer()
        try:
            if writer:
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp)
            # Every process calls save (the engines write on the first and wait for it).
            model.template.save(os.path.join(tmp, "model.keras"))
            self._last_saved = self._global
            # The epoch's metrics so far, for its logs after a resume: one device's state
            # (with several processes, each holds a part; every process joins in gathering).
            whole = self._whole()
            metrics = _metric_state(model) if whole is not None and 0 < step < whole else None
            if not writer:
                return
            state, arrays = self._state(epoch, step, model._fit_dataset, metrics)
            with open(os.path.join(tmp, "state.json"), "w") as f:
                json.dump(state, f)
            np.savez(os.path.join(tmp, "arrays.npz"), **arrays)
            _fsync_tree(tmp)
            if os.path.exists(final):  # the same step saved before (a resume): replace it
                _retire(final)
            os.replace(tmp, final)
        except OSError as error:
            if writer:
                shutil.rmtree(tmp, ignore_errors=True)
            self._last_saved = None
            raise OSError(
                error.errno,
                f"Checkpoint could not write {final} (epoch {epoch + 1}, step {step}): "
                f"{error.strerror or error}. {_io.hint(error)} The checkpoints before it in "
                f"{self.directory} are whole; a resumed run starts from the newest of them."
            ) from error
        for stale in self.checkpoints()[:-self.keep]:
            _retire(stale)

    # -- resuming --------------------------------------------------------

    def on_train_begin(self, logs=None):
        model = self._parallel()
        self._reset_position()
        self.resumed_from = None
        dataset = model._fit_dataset
        if self.every_steps and dataset is not None and not dataset.resumable:
            raise ValueError(
                f"Checkpoint(save_freq={self.every_steps}) saves in the middle of epochs, "
                f"and this fit's input ({type(dataset).__name__}) cannot resume there. Pass "
                "arrays or a keras.utils.PyDataset of known length, or save_freq='epoch' "
                "(a checkpoint at each epoch's end)."
            )
        self._prepare_directory_everywhere()
        found, self._found = self._found, None
        if self.resume and found is None:
            found = self._newest_readable()
        if self.resume and found is not None:
            self._restore(*found)

    def resume_point(self, *, _stacklevel=3):
        """`(epoch, step)` where `fit` will resume (`step` steps of `epoch` done), or None.

        `ParallelModel.fit` asks before it starts, to run a resumed epoch as
        Keras runs a whole one. The checkpoint read is kept for `on_train_begin`. A damaged
        checkpoint's warning is shown at the caller's line (`fit`'s: `_stacklevel=5`).
        """
        self._found = self._newest_readable(_stacklevel) if self.resume else None
        if self._found is None:
            return None
        state = self._found[1]
        return state["epoch"], state["step"]

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._in_epoch = self._offset if epoch == self._resumed_epoch else 0
        self._epoch_start_global = self._global - self._in_epoch
        if self._pending_metrics is not None and epoch == self._resumed_epoch:
            variables = self.model.metrics_variables
            values = [self._pending_metrics.get(i) for i in range(len(variables))]
            share = backends.has(self.model._backend, "metric_shares")
            if share:
                values = self.model._backend.local_metric_state(variables, values)
            for variable, value in zip(variables, values):
                if value is not None:
                    variable.assign(value)
            if not share:  # (an engine with shares must not make them equal again)
                self.model._replicate_state()
        self._pending_metrics = None

    def _whole(self):  # the epoch's batches; None where unknown (a generator)
        return _epoch_batches(self.model._fit_dataset)

    def on_train_batch_end(self, batch, logs=None):
        offset = self._offset if self._epoch == self._resumed_epoch else 0
        whole = self._whole()
        # (Keras's multi-step loop names its last, short run's step as a whole run's.)
        self._in_epoch = min(batch + 1 + offset, whole or math.inf)
        self._global = self._epoch_start_global + self._in_epoch
        if (self.every_steps and self._global % self.every_steps == 0
                and self._in_epoch != whole):
            self.save(self._epoch, self._in_epoch)

    def on_epoch_end(self, epoch, logs=None):
        whole = self._whole()  # unknown (a generator's): its end is the next epoch's start
        unknown = whole is None and self.model._fit_dataset is not None
        self.save(epoch + 1 if unknown else epoch, 0 if unknown else whole or self._in_epoch)

    def on_interrupt(self):
        """After a Ctrl-C (at a step boundary): a checkpoint of the steps done."""
        if self._in_epoch:
            self.save(self._epoch, self._in_epoch)
        self.model._initial_epoch = None

    def on_train_end(self, logs=None):
        self.model._initial_epoch = None
