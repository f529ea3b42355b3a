"""`ParallelModel`'s calls: Keras's own `fit`, `evaluate`, `predict` and `*_on_batch`, fed
padded batches by `batching` inside the engine's scope (`Calls`, a mixin as Keras's own
`Trainer` is); the calls a mid-epoch resume needs; the callbacks each process runs."""

import contextlib
import gc
import re

import keras
import numpy as np

from keras_multigpu import backends, batching, inputs, interrupt, processes
from keras_multigpu._checks import (
    _check_fit_arguments,
    _check_names,
    _check_rows,
    _check_targets,
    _split,
    _takes_text,
    check_callbacks,
    check_overwritten,
)
from keras_multigpu._replica_state import StateCheck


def _check_compiled(model, call):
    """Keras's own error for a model never compiled (which Keras's torch trainer does not
    raise before `evaluate` reads the optimizer), saying where to compile."""
    if not model.compiled:
        raise ValueError(f"You must call `compile()` before `{call}()`: the model (and its "
                         "wrapper) was never compiled. Call `compile(optimizer=..., "
                         "loss=...)` on the ParallelModel first.")


class Calls:
    """`fit`, `evaluate`, `predict` and `*_on_batch` of a `ParallelModel`."""

    @property
    def _takes_text(self):
        return _takes_text(self.template, backends.has(self._backend, "text"))

    def _padded(self, x, y=None, sample_weight=None, **kwargs):
        _check_names(self.template, x, "x", "input")
        _check_names(self.template, y, "y", "output")
        if isinstance(kwargs.get("batch_size"), np.integer):  # torch's samplers take int alone
            kwargs["batch_size"] = int(kwargs["batch_size"])
        backend = self._backend
        generator = backends.has(backend, "generator")
        return inputs.as_padded(
            x, y, sample_weight, replicas=self.num_replicas, tag=backend.tag, place=self._place,
            put=self._put, engine_state=backend.random_state if generator else None,
            set_engine_state=backend.set_random_state if generator else None,
            to_backend=backend.to_backend if backends.has(backend, "to_backend") else None,
            text=self._takes_text, **kwargs)

    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto",
            callbacks=None, validation_split=0.0, validation_data=None,
            shuffle=True, class_weight=None, sample_weight=None, initial_epoch=0,
            steps_per_epoch=None, validation_steps=None, validation_batch_size=None,
            validation_freq=1, drop_remainder=False):
        """Keras's `fit`, with `batch_size` the global batch.

        `drop_remainder=True` skips the last, partial batch of each epoch
        (array inputs) instead of padding it.
        """
        self._sync_compile()
        _check_compiled(self, "fit")
        callbacks = _check_fit_arguments(epochs, initial_epoch, validation_freq, callbacks,
                                         steps_per_epoch)
        check_overwritten(self.template, self.num_replicas, backends.has(self._backend,
                                                                         "whole_batch"))
        if validation_split and validation_data is None:
            if not batching._is_array_like(x):
                raise ValueError(
                    "validation_split needs array inputs. Received: x of type "
                    f"{type(x).__name__}. Pass validation_data instead."
                )
            (x, y, sample_weight), validation_data = _split(x, y, sample_weight, validation_split)
        _check_targets(self.template, x, y, "fit", "train_step")
        data, dataset = self._padded(
            x, y, sample_weight, batch_size=batch_size, shuffle=shuffle,
            class_weight=class_weight, drop_remainder=drop_remainder,
            steps_per_epoch=steps_per_epoch,
        )
        validation_dataset = None
        if validation_data is not None:
            if isinstance(validation_data, (tuple, list)):
                val_x, val_y, _ = keras.utils.unpack_x_y_sample_weight(tuple(validation_data))
                _check_targets(self.template, val_x, val_y, "fit's validation_data", "test_step")
                _check_rows(self.template, val_x, "fit's validation_data")
            try:
                validation_data, validation_dataset = self._padded(
                    *keras.utils.unpack_x_y_sample_weight(validation_data),
                    batch_size=validation_batch_size or batch_size,
                )
            except (TypeError, ValueError) as error:  # the message names x, y: say which
                if type(error) not in (TypeError, ValueError):
                    raise
                raise type(error)(f"fit's validation_data: {error}") from None
        if self._backend.process_index() != 0:
            callbacks = _readers(callbacks)
        if self.num_replicas > 1 and not backends.has(self._backend, "whole_batch"):
            callbacks = _added(callbacks, StateCheck(self.template, self._backend,
                                                     self._distribution, self.num_replicas))
        # Keras's own list, built here so that an interruption can end it.
        callbacks = interrupt.with_stop(callbacks)
        if not isinstance(callbacks, keras.callbacks.CallbackList):
            callbacks = keras.callbacks.CallbackList(
                callbacks, add_history=True, add_progbar=verbose != 0, verbose=verbose,
                epochs=epochs, steps=steps_per_epoch or getattr(data, "num_batches", None),
                model=self,
            )
        self._fit_dataset = dataset
        try:
            calls = _resumed_calls(callbacks, dataset, initial_epoch, epochs, steps_per_epoch)
            with interrupt.deferred(), self._placed():
                for first, last, (start, stop) in _ends(calls):
                    with _only_ends(callbacks, first, last):
                        self._initial_epoch = None
                        history = super().fit(
                            data, epochs=stop, verbose=verbose, callbacks=callbacks,
                            validation_data=validation_data, shuffle=False,
                            initial_epoch=start, steps_per_epoch=steps_per_epoch,
                            validation_steps=validation_steps, validation_freq=validation_freq,
                        )
                    if not last:
                        # A resumed epoch is done: the next are whole, and the next Keras
                        # call's start is not an epoch's end (see `Feed.continue_epochs`).
                        dataset.continue_epochs()
                    if self.stop_training:
                        break
                return history
        except interrupt.Interrupted:
            interrupt.end_training(callbacks)
            raise
        except Exception as error:
            _raise_failed(self, error, dataset, validation_dataset)
            raise
        finally:
            self._fit_dataset = None
            _close(dataset, validation_dataset)

    def evaluate(self, x=None, y=None, batch_size=None, verbose="auto",
                 sample_weight=None, steps=None, callbacks=None,
                 return_dict=False, **kwargs):
        self._sync_compile()
        _check_compiled(self, "evaluate")
        callbacks = check_callbacks(callbacks)
        _check_targets(self.template, x, y, "evaluate", "test_step")
        data, dataset = self._padded(x, y, sample_weight, batch_size=batch_size)
        try:
            with interrupt.deferred(), self._placed():
                return super().evaluate(
                    data, verbose=verbose, steps=steps,
                    callbacks=interrupt.with_stop(callbacks), return_dict=return_dict,
                    **kwargs,
                )
        except Exception as error:
            _raise_failed(self, error, dataset)
            raise
        finally:
            if not kwargs.get("_use_cached_eval_dataset"):  # fit's own: fit closes it
                _close(dataset)

    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
        """Keras's `predict`: exactly one output row per input row, in order."""
        self._sync_compile()
        callbacks = check_callbacks(callbacks)
        data, dataset = self._padded(x, batch_size=batch_size)
        try:
            with interrupt.deferred(), self._placed():
                return super().predict(data, verbose=verbose, steps=steps,
                                       callbacks=interrupt.with_stop(callbacks))
        except Exception as error:
            _raise_failed(self, error, dataset)
            raise
        finally:
            _close(dataset)

    def _pad_one(self, x, y=None, sample_weight=None, class_weight=None):
        """One batch as the positional `x, y, sample_weight` of Keras's `*_on_batch`."""
        batch, _ = batching.pad_batch(
            batching._parts(x, y, sample_weight), self.num_replicas, self._backend.tag,
            class_weight, self._takes_text,
        )
        return batch

    def train_on_batch(self, x, y=None, sample_weight=None, class_weight=None, return_dict=False):
        self._sync_compile()
        _check_compiled(self, "train_on_batch")
        check_overwritten(self.template, self.num_replicas, backends.has(self._backend,
                                                                         "whole_batch"))
        batch = self._pad_one(x, y, sample_weight, class_weight)
        with self._placed():
            return super().train_on_batch(*batch, return_dict=return_dict)

    def test_on_batch(self, x, y=None, sample_weight=None, return_dict=False):
        self._sync_compile()
        _check_compiled(self, "test_on_batch")
        batch = self._pad_one(x, y, sample_weight)
        with self._placed():
            return super().test_on_batch(*batch, return_dict=return_dict)

    def predict_on_batch(self, x):
        self._sync_compile()
        batch = self._pad_one(x)
        with self._placed():
            return super().predict_on_batch(*batch)


def _resumed_calls(callbacks, dataset, initial_epoch, epochs, steps_per_epoch):
    """The `(initial_epoch, epochs)` of each Keras `fit` call this `fit` makes.

    One, unless a `callbacks.Checkpoint` resumes in the middle of an epoch:
    then the rest of that epoch is a call of its own, whose data has that
    many batches, so that Keras ends it as it ends any epoch (a trainer draws
    from its generators at epoch ends), and the epochs after it are another.
    """
    from keras_multigpu.callbacks import Checkpoint, CheckpointError

    whole = [(initial_epoch, epochs)]
    listed = callbacks.callbacks if isinstance(callbacks, keras.callbacks.CallbackList) else (
        callbacks or [])
    checkpoint = next((c for c in listed if isinstance(c, Checkpoint)), None)
    point = problem = None
    if checkpoint is not None:
        try:
            point = checkpoint.resume_point(_stacklevel=5)  # shown at the user's `fit`
        except (CheckpointError, OSError) as error:  # raised below, once all have looked
            problem = error
    if processes.count() > 1:
        _check_same_checkpoint(checkpoint, point, problem)
    elif problem is not None:
        raise problem
    if point is None or steps_per_epoch is not None or dataset is None:
        return whole
    epoch, step = point
    if not 0 < step < dataset.num_batches or epoch >= epochs or not dataset.resumable:
        return whole  # an epoch's end: the next starts afresh
    dataset.skip = step  # Keras reads the epoch's length as the call starts
    return [(epoch, epoch + 1)] + ([(epoch + 1, epochs)] if epoch + 1 < epochs else [])


def _check_same_checkpoint(checkpoint, point, problem):
    """Every process has a `Checkpoint` saving as often, and resumes where process 0 does,
    or every process raises: a folder per process (where only process 0's holds
    checkpoints) had them run other epochs and wait for each other's collectives, until
    the timeout; saves at other steps made gloo abort the processes. `problem`, a process's
    failure to read its checkpoints, is raised on every process, once all have looked."""
    mine = None if checkpoint is None else {
        "directory": checkpoint.directory, "save_freq": checkpoint.every_steps or "epoch",
        "at": None if point is None else [int(point[0]), int(point[1])],
        "problem": None if problem is None else f"{type(problem).__name__}: {problem}"}
    everyone = processes.all_gather_object(
        mine, "the start of fit, where every process checks that it resumes alike")
    if problem is not None:
        raise problem
    failed = next((r for r, theirs in enumerate(everyone) if theirs and theirs["problem"]),
                  None)
    if failed is not None:
        raise RuntimeError(f"Process {failed} could not read its Checkpoint: "
                           f"{everyone[failed]['problem']}")

    def compared(theirs):
        return theirs and (theirs["save_freq"], theirs["at"])

    other = next((r for r, theirs in enumerate(everyone)
                  if compared(theirs) != compared(everyone[0])), None)
    if other is None:
        return

    def shown(rank):
        if everyone[rank] is None:
            return f"process {rank} has no Checkpoint"
        theirs = everyone[rank]
        at = theirs["at"]
        where = ("starts afresh" if at is None else
                 f"resumes after {at[1]} step(s) of epoch {at[0] + 1}")
        return (f"process {rank} has Checkpoint({theirs['directory']!r}, "
                f"save_freq={theirs['save_freq']!r}) and {where}")

    raise ValueError(
        f"The {len(everyone)} processes' Checkpoints differ: {shown(other)}; {shown(0)}. "
        "Pass the same Checkpoint on every process: one directory that every process reads "
        "(process 0 writes it; a folder shared between machines), and the same save_freq."
    )


def _ends(calls):
    return [(i == 0, i == len(calls) - 1, call) for i, call in enumerate(calls)]


@contextlib.contextmanager
def _only_ends(callbacks, first, last):
    """Within one `fit` made of several Keras calls, the training starts once and ends once."""
    silenced = [name for name, keep in (("on_train_begin", first), ("on_train_end", last))
                if not keep]
    for name in silenced:
        setattr(callbacks, name, lambda logs=None: None)
    try:
        yield
    finally:
        for name in silenced:
            delattr(callbacks, name)


# Callbacks that write files of their own: with several processes, only the first runs them.
# (ModelCheckpoint and BackupAndRestore save through the model, which writes on the first
# process alone; BackupAndRestore still restores on every process.)
_WRITERS = (keras.callbacks.CSVLogger, keras.callbacks.TensorBoard)


class _RestoreOnly(keras.callbacks.Callback):
    """A `BackupAndRestore` on a process that does not write: it restores, and joins every
    save the first process makes (it returns once that save is written, see
    `keras_multigpu.processes`), writing nothing itself and deleting nothing at the end."""

    def __init__(self, callback):
        super().__init__()
        self.callback = callback
        callback._save_model = self._join_save  # its own saving decides when; this, how

    def _join_save(self):
        self.callback.model.save_weights(self.callback._weights_path, overwrite=True)

    def set_model(self, model):
        super().set_model(model)
        self.callback.set_model(model)

    def on_train_begin(self, logs=None):
        self.callback.on_train_begin(logs)

    def on_epoch_end(self, epoch, logs=None):
        self.callback.on_epoch_end(epoch, logs)

    def on_train_batch_end(self, batch, logs=None):
        self.callback.on_train_batch_end(batch, logs)


def _added(callbacks, callback):
    """`callbacks` (None, a list or a `CallbackList`) with `callback` added."""
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks.callbacks.append(callback)
        return callbacks
    return [*(callbacks if isinstance(callbacks, (list, tuple)) else
              [] if callbacks is None else [callbacks]), callback]


def _readers(callbacks):
    """The callbacks a process other than the first runs (see `_WRITERS`)."""
    if callbacks is None or isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks
    listed = callbacks if isinstance(callbacks, (list, tuple)) else [callbacks]
    return [
        _RestoreOnly(c) if isinstance(c, keras.callbacks.BackupAndRestore) else c
        for c in listed if not isinstance(c, _WRITERS)
    ]


def _raise_failed(model, error, *datasets):
    """A batch a feed could not serve on tf.data's threads (x and y of different rows):
    TensorFlow raised its own graph error for it; the feed's error is raised instead. A
    shape error from a step that ran on one replica's share says so (`_SHARE_NOTE`). An
    engine's own error from a collective is raised as the `CollectiveError` that says what
    it means (a process that stopped)."""
    failed = next((d.failed for d in datasets if getattr(d, "failed", None)), None)
    if failed is not None and failed is not error:
        raise failed from error
    if backends.has(model._backend, "collective_errors"):
        said = model._backend.collective_error(error)
        if said is not None:
            raise said from error
    if (model.num_replicas > 1 and not backends.has(model._backend, "whole_batch")
            and _SHAPE_ERROR.search(str(error)) and hasattr(error, "add_note")):
        error.add_note(_SHARE_NOTE.format(model.num_replicas))


# TensorFlow's and torch's words for tensors whose shapes do not fit together.
_SHAPE_ERROR = re.compile(
    r"Incompatible shapes|Dimensions must be equal|must match the size of tensor"
    r"|Sizes of tensors must match|shapes cannot be multiplied")
_SHARE_NOTE = (
    "keras-multigpu: each of the {} replicas ran this step on its share of the global batch. "
    "If a shape above is the global batch size where the share's rows were expected, the "
    "step fixes it (`keras.random.normal((batch_size, ...))` with `batch_size` a constant): "
    "take the rows from the data, `keras.ops.shape(x)[0]`, or train with gpus=1.")


def _close(*datasets):
    """Closes a call's feeds; then, once, frees the tf.data iterators Keras's call left in a
    reference cycle (see `Feed.leaves_iterators`)."""
    for dataset in datasets:
        close = getattr(dataset, "close", None)
        if close is not None:
            close()
    if any(getattr(dataset, "leaves_iterators", False) for dataset in datasets):
        gc.collect()
