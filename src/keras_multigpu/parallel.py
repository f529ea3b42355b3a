"""`multi_gpu_model()` and `ParallelModel`: thin wiring of the modules below.

`ParallelModel` is a `keras.Model` whose only layer is the user's model (the
*template*): it owns no variables, so training it trains the template. Its
`fit`, `evaluate` and `predict` are Keras's own, fed padded batches by
`batching` and run inside the backend's distribution scope, entered for the
call and left after it, so no global state outlives a call.

Every step is the template's own: `train_step`, `test_step` and
`predict_step` run on the template (with the real rows of each batch, see
`backends`), so its overrides of those, of `compute_loss` and
`compute_metrics`, its `metrics`, its losses and the way Keras passes it the
`training` flag all behave as on one device. `save` and the weight methods
act on the template, so every file written is a plain Keras file of the
user's model.
"""

import collections.abc
import contextlib
import inspect
import os
import zipfile

import keras
import numpy as np
from keras import tree

from keras_multigpu import backends, batching, interrupt, launch, processes
from keras_multigpu import devices as devices_lib
from keras_multigpu._io import atomic_path, unreadable
from keras_multigpu._keras import io_utils


def multi_gpu_model(model, gpus=None):
    """Returns a `ParallelModel` that trains `model` on several devices.

    Args:
        model: a Keras 3 model (Sequential, Functional or subclassed). It is
            not copied: after `fit`, `model` holds the trained weights.
            Passing a `ParallelModel` wraps its template again (no nesting).
        gpus: None for every accelerator (every CPU device when there is
            none); an int k for the first k devices (0 and 1 mean one
            device); or a list of device ids, e.g. `[0, 2]`.

    Example:

    ```python
    parallel = keras_multigpu.multi_gpu_model(model, gpus=4)
    parallel.compile(optimizer="sgd", loss="categorical_crossentropy")
    parallel.fit(x, y, batch_size=64 * parallel.num_replicas, epochs=70)
    model.save("trained.keras")  # the template holds the trained weights
    ```
    """
    if isinstance(model, ParallelModel):
        model = model.template
    if not isinstance(model, keras.Model):
        raise TypeError(
            "multi_gpu_model expects a keras.Model (Sequential, Functional or "
            f"subclassed). Received: model of type {type(model).__name__}."
        )
    if keras.distribution.distribution() is not None:
        raise RuntimeError(
            "A keras.distribution is set globally ("
            f"{type(keras.distribution.distribution()).__name__}), and multi_gpu_model "
            "distributes the model itself. Remove the keras.distribution.set_distribution(...) "
            "call, or train without multi_gpu_model."
        )
    backend = backends.current()
    if backends.has(backend, "check_model"):
        backend.check_model(model)
    chosen = devices_lib.select(gpus, backend.list_devices())
    if backends.has(backend, "process_per_device") and len(chosen) > 1 \
            and not launch.launched():
        launch.relaunch(len(chosen))  # as `keras-multigpu launch -n N` (does not return)
    return ParallelModel(model, chosen)


# Array datasets are placed on the devices once per call, and every batch is
# gathered there, when they take at most this share of the memory free on the
# fullest device (CPU devices share the host's memory, so each counts for an
# equal part of it: the copies multiply with the device count), and at most
# RESIDENT_LIMIT_BYTES. Larger ones stay on the host, and each batch is placed
# on the devices, split, while the step before it runs.
RESIDENT_FRACTION = 0.25
RESIDENT_LIMIT_BYTES = 2 * 2**30


def _needs_symbolic_build(model):
    """Keras's own test (`Trainer._symbolic_build`) for building from a batch."""
    return (
        not all(layer.built for layer in model._flatten_layers())
        or (model._compile_metrics is not None and not model._compile_metrics.built)
        or (model._compile_loss is not None and not model._compile_loss.built)
    )


def _builds_in_its_step(model):
    """A model with no `call` whose sub-models are built (a GAN whose `train_step` calls its
    generator and discriminator): nothing can build it from a batch, and its step needs
    nothing more."""
    return type(model).call is keras.Model.call and all(
        layer.built for layer in model._flatten_layers(include_self=False))


def _symbolic(value):
    if value is None:
        return None
    return keras.KerasTensor(value.shape, keras.backend.standardize_dtype(value.dtype))


class ParallelModel(keras.Model):
    """A model replicated on `devices`, each global batch split among them.

    Behaves like the Keras model it wraps (`compile`, `fit`, `evaluate`,
    `predict`, `save`, its attributes, ...). `batch_size` is the global
    batch: results equal one device's with the same batch (see the README's
    "Semantics").

    Attributes:
        template: the model passed to `multi_gpu_model`, which holds the
            weights.
        devices: the `Device` records replicas run on.
        num_replicas: `len(devices)`; with several TensorFlow workers (`TF_CONFIG`),
            every worker's devices (`devices` are this worker's).
    """

    def __init__(self, template, devices):
        backend = backends.current()
        distribution = backend.make_distribution(tuple(devices))
        # Several processes: each takes process 0's random state (shuffling, dropout), as
        # one process drawing for all of them would.
        processes.agree_on_random_state()
        # Built in the engine's scope: TensorFlow's trainer takes its strategy from it.
        with backend.scope(distribution):
            super().__init__(name=template.name)
        self.template = template
        self._devices = tuple(devices)
        self._backend = backend
        self._distribution = distribution
        self._synced_compile = None
        self._active = 0  # calls under way (`_placed`)
        self._fit_dataset = None  # the padded training data of the `fit` under way
        if template.built:
            self.built = True
        self._sync_compile()

    devices = property(lambda self: list(self._devices))
    num_replicas = property(lambda self: getattr(self._distribution, "num_replicas",
                                                 len(self._devices)))

    def __getattr__(self, name):
        # Only reached when normal lookup fails: the template's own public
        # attributes (output_names, an encoder, ...) read through the wrapper.
        with contextlib.suppress(AttributeError):
            # The torch backend keeps sub-modules (the template among them) in
            # torch.nn.Module's own tables, which its __getattr__ reads.
            return super().__getattr__(name)
        template = self.__dict__.get("template") or self.__dict__.get("_modules", {}).get(
            "template")
        if template is None or name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(template, name)

    def build(self, *args, **kwargs):
        self.built = True  # the template builds itself when first called

    def call(self, inputs, *args, **kwargs):
        # Keras calls the model itself on `x` of a batch to build it (predict on a partly
        # built model): a tagged batch holds `(x,)`, the template takes its `x`.
        rows = self._backend.untag(inputs)
        if rows is not inputs:
            rows, _, _ = keras.utils.unpack_x_y_sample_weight(rows)
        return self.template(rows, *args, **kwargs)

    # -- state ------------------------------------------------------------

    @property
    def metrics(self):
        return self.template.metrics

    def get_metrics_result(self):
        return self.template.get_metrics_result()

    def _state(self):
        """Every variable a call uses, and the template's optimizers (a model may have
        several: a GAN's `d_optimizer` and `g_optimizer`)."""
        optimizers = _optimizers(self.template)
        variables = list(self.template.variables) + list(self.metrics_variables)
        for optimizer in optimizers:
            # Includes the iteration count and learning rate, which exist
            # before the optimizer is built.
            variables += list(optimizer.variables)
        return variables, optimizers

    def _replicate_state(self):
        variables, optimizers = self._state()
        self._backend.replicate(variables, self._distribution, optimizers=optimizers)

    def _scope(self):
        return self._backend.scope(self._distribution)

    @contextlib.contextmanager
    def _placed(self):
        """The distribution scope, with every existing variable replicated."""
        self._active += 1
        failed = False
        try:
            with self._scope():
                self._replicate_state()
                yield
        except BaseException:
            failed = True
            raise
        finally:
            self._active -= 1
            if not self._active:
                if backends.has(self._backend, "release"):
                    variables, optimizers = self._state()
                    self._backend.release(variables, self._distribution, optimizers=optimizers,
                                          failed=failed)

    def reset_metrics(self):
        # Keras resets metrics at every epoch and evaluate with fresh arrays on
        # the default device; put them back on the mesh so that the compiled
        # step sees the placement it was compiled for.
        self.template.reset_metrics()
        if self._active:
            self._backend.replicate(self.metrics_variables, self._distribution)

    def _symbolic_build(self, iterator=None, data_batch=None):
        # The template builds itself, its compiled loss and metrics and its
        # optimizer, from the real rows of a batch. The batch is read from
        # `iterator` exactly when Keras would read it, so that shuffling draws
        # what a one-device `fit` draws.
        optimizer = getattr(self.template, "optimizer", None)
        building = _needs_symbolic_build(self.template) or (
            optimizer is not None and not optimizer.built)
        if data_batch is None and iterator is not None and _needs_symbolic_build(self.template):
            for _, _, data in iterator:
                data_batch = data[0] if isinstance(data, (list, tuple)) else next(data)
                break
        if data_batch is not None:
            data_batch = self._backend.untag(tree.map_structure(_symbolic, data_batch))
        self.template._symbolic_build(data_batch=data_batch)
        self.built = True
        if building:  # new variables: `_placed` replicated those that existed
            self._replicate_state()

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Trainers that build before tracing (TensorFlow's) call this. The
        # batch is described by the engine, not read, so that shuffling draws
        # what one device's `fit` draws.
        if _builds_in_its_step(self.template):
            # As Keras's own TensorFlow trainer without a strategy: nothing is built up
            # front, the model's step creates what it needs (in the engine's scope).
            self.built = True
            return
        if iterator is not None and data_batch is None \
                and backends.has(self._backend, "batch_spec"):
            data_batch = self._backend.batch_spec(iterator)
        with self._scope():
            self._symbolic_build(data_batch=data_batch)

    # -- compile ---------------------------------------------------------

    def compile(self, *args, **kwargs):
        """Compiles the template with exactly these arguments.

        They go to the template's own `compile` as given: Keras's, or a
        model's own signature (a GAN's `compile(d_optimizer, g_optimizer,
        loss_fn)`). The wrapper trains with what that compile sets up (the
        template's compiled loss, metrics and optimizers), so a file saved
        from the template resumes training like any compiled Keras model.
        """
        given = _compile_arguments(self.template, args, kwargs)
        if "optimizer" in given:
            _check_gradient_accumulation(given["optimizer"])
        if "loss" in given:
            _check_reductions(given["loss"])
        self.template.compile(*args, **kwargs)
        self._sync_compile()

    def _sync_compile(self):
        """Takes the template's optimizer and step options, if it is compiled.

        Called at every entry point too, so that compiling the template
        itself after wrapping it is seen.
        """
        template = self.template
        config = getattr(template, "_compile_config", None)
        if not getattr(template, "compiled", False) or config is self._synced_compile:
            return
        for optimizer in _optimizers(template):
            _check_gradient_accumulation(optimizer)
        with self._scope():
            super().compile(
                optimizer=template.optimizer,
                steps_per_execution=template.steps_per_execution,
                jit_compile=template.jit_compile if backends.has(self._backend, "jit")
                else False,
                run_eagerly=template.run_eagerly,
            )
        self._synced_compile = config

    # -- the template's steps ---------------------------------------------

    def _watched(self, function, what):
        if not backends.has(self._backend, "watch"):
            return function
        return self._backend.watch(function, self._distribution, what)

    def make_train_function(self, force=False):
        super().make_train_function(force)
        self.train_function = self._watched(self.train_function, "a training step")
        return self.train_function

    def make_test_function(self, force=False):
        super().make_test_function(force)
        self.test_function = self._watched(self.test_function, "an evaluation step")
        return self.test_function

    def make_predict_function(self, force=False):
        super().make_predict_function(force)
        self.predict_function = self._watched(self.predict_function, "a prediction step")
        return self.predict_function

    def train_step(self, *args):
        *state, data = args
        result = self._backend.run_step(lambda rows: self.template.train_step(*state, rows), data)
        return _checked_step_result(self.template, "train_step", result, bool(state))

    def test_step(self, *args):
        *state, data = args
        result = self._backend.run_step(lambda rows: self.template.test_step(*state, rows), data)
        return _checked_step_result(self.template, "test_step", result, bool(state))

    def predict_step(self, *args):
        *state, data = args
        return self._backend.run_step(lambda rows: self.template.predict_step(*state, rows), data,
                                      rows_out=True)

    # -- training and inference -----------------------------------------

    def resident_budget(self):
        """Bytes of array data `fit` keeps on every device (see RESIDENT_FRACTION)."""
        if not backends.has(self._backend, "free_memory"):
            return RESIDENT_LIMIT_BYTES
        free = self._backend.free_memory(self._devices)
        if any(f is None for f in free):
            return RESIDENT_LIMIT_BYTES
        return min(RESIDENT_LIMIT_BYTES, RESIDENT_FRACTION * min(free))

    def _place(self, arrays):
        """Keeps array data on the devices when it fits the budget (see README)."""
        if not backends.has(self._backend, "resident"):
            return None
        size = sum(leaf.nbytes for leaf in tree.flatten(arrays) if leaf is not None)
        if size > self.resident_budget():
            return None
        return self._backend.resident(arrays, self._distribution)

    def _put(self, batch):
        if not backends.has(self._backend, "shard"):
            return batch
        return self._backend.shard(batch, self._distribution)

    def _padded(self, x, y=None, sample_weight=None, **kwargs):
        _check_names(self.template, x, "x", "input")
        _check_names(self.template, y, "y", "output")
        backend = self._backend
        generator = backends.has(backend, "generator")
        return batching.as_padded(
            x, y, sample_weight, replicas=self.num_replicas, tag=backend.tag, place=self._place,
            put=self._put, engine_state=backend.random_state if generator else None,
            set_engine_state=backend.set_random_state if generator else None,
            to_backend=backend.to_backend if backends.has(backend, "to_backend") else None,
            **kwargs)

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
        _check_fit_arguments(epochs, initial_epoch, validation_freq, callbacks, steps_per_epoch)
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
        if validation_data is not None:
            if isinstance(validation_data, (tuple, list)):
                val_x, val_y, _ = keras.utils.unpack_x_y_sample_weight(tuple(validation_data))
                _check_targets(self.template, val_x, val_y, "fit's validation_data", "test_step")
            validation_data, validation_dataset = self._padded(
                *keras.utils.unpack_x_y_sample_weight(validation_data),
                batch_size=validation_batch_size or batch_size,
            )
        if self._backend.process_index() != 0:
            callbacks = _readers(callbacks)
        # Keras's own list, built here so that an interruption can end it.
        callbacks = interrupt.with_stop(callbacks)
        if not isinstance(callbacks, keras.callbacks.CallbackList):
            callbacks = keras.callbacks.CallbackList(
                callbacks, add_history=True, add_progbar=verbose != 0, verbose=verbose,
                epochs=epochs, steps=steps_per_epoch or getattr(data, "num_batches", None),
                model=self,
            )
        self._fit_dataset = dataset
        calls = _resumed_calls(callbacks, dataset, initial_epoch, epochs, steps_per_epoch)
        try:
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
        finally:
            self._fit_dataset = None
            _close(dataset)
            if validation_data is not None:
                _close(validation_dataset)

    def evaluate(self, x=None, y=None, batch_size=None, verbose="auto",
                 sample_weight=None, steps=None, callbacks=None,
                 return_dict=False, **kwargs):
        self._sync_compile()
        _check_targets(self.template, x, y, "evaluate", "test_step")
        data, dataset = self._padded(x, y, sample_weight, batch_size=batch_size)
        try:
            with interrupt.deferred(), self._placed():
                return super().evaluate(
                    data, verbose=verbose, steps=steps,
                    callbacks=interrupt.with_stop(callbacks), return_dict=return_dict, **kwargs,
                )
        finally:
            if not kwargs.get("_use_cached_eval_dataset"):  # fit's own: fit closes it
                _close(dataset)

    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
        """Keras's `predict`: exactly one output row per input row, in order."""
        self._sync_compile()
        data, dataset = self._padded(x, batch_size=batch_size)
        try:
            with interrupt.deferred(), self._placed():
                return super().predict(data, verbose=verbose, steps=steps,
                                       callbacks=interrupt.with_stop(callbacks))
        finally:
            _close(dataset)

    def _pad_one(self, x, y=None, sample_weight=None, class_weight=None):
        """One batch as the positional `x, y, sample_weight` of Keras's `*_on_batch`."""
        batch, _ = batching.pad_batch(
            batching._parts(x, y, sample_weight), self.num_replicas, self._backend.tag,
            class_weight, always=False,
        )
        return batch

    def train_on_batch(self, x, y=None, sample_weight=None, class_weight=None, return_dict=False):
        self._sync_compile()
        batch = self._pad_one(x, y, sample_weight, class_weight)
        with self._placed():
            return super().train_on_batch(*batch, return_dict=return_dict)

    def test_on_batch(self, x, y=None, sample_weight=None, return_dict=False):
        self._sync_compile()
        batch = self._pad_one(x, y, sample_weight)
        with self._placed():
            return super().test_on_batch(*batch, return_dict=return_dict)

    def predict_on_batch(self, x):
        self._sync_compile()
        batch = self._pad_one(x)
        with self._placed():
            return super().predict_on_batch(*batch)

    # -- the template's face --------------------------------------------

    def save(self, filepath, overwrite=True, **kwargs):
        """Saves the template as a plain `.keras` file, atomically (by one process only)."""
        if not overwrite and os.path.exists(filepath):
            raise FileExistsError(f"{filepath} exists and overwrite=False.")
        if self._backend.process_count() > 1:
            # The engine writes on the first process, atomically, and waits for it.
            return self.template.save(filepath, **kwargs)
        with atomic_path(filepath, ".keras") as tmp:
            self.template.save(tmp, **kwargs)

    def save_weights(self, filepath, overwrite=True, **kwargs):
        """Saves the template's weights (`.weights.h5`), atomically (by one process only)."""
        if not overwrite and os.path.exists(filepath):
            raise FileExistsError(f"{filepath} exists and overwrite=False.")
        if self._backend.process_count() > 1:
            return self.template.save_weights(filepath, **kwargs)
        with atomic_path(filepath, ".weights.h5") as tmp:
            self.template.save_weights(tmp, **kwargs)

    def load_weights(self, filepath, **kwargs):
        """Loads weights into the template; a missing or damaged file is named in the error."""
        if not os.path.exists(filepath):
            raise FileNotFoundError(
                f"No such weights file: {filepath}. Pass the path of a .weights.h5 or .keras "
                "file written by save_weights, save or ModelCheckpoint."
            )
        try:
            self.template.load_weights(filepath, **kwargs)
        except (OSError, zipfile.BadZipFile) as error:
            if not os.path.isfile(filepath):
                raise
            raise unreadable(os.fspath(filepath), error) from error

    def summary(self, *args, print_fn=None, **kwargs):
        """The template's summary, after a line naming the devices."""
        write = print_fn or io_utils.print_msg  # Keras's own, as its summary uses
        write(f"ParallelModel on {self.num_replicas} device(s): "
              f"{', '.join(map(str, self._devices))}")
        return self.template.summary(*args, print_fn=print_fn, **kwargs)

    def get_weights(self):
        return self.template.get_weights()

    def set_weights(self, weights):
        self.template.set_weights(weights)

    def get_config(self):
        return self.template.get_config()

    @property
    def layers(self):
        return self.template.layers

    @property
    def inputs(self):
        return self.template.inputs

    @property
    def outputs(self):
        return self.template.outputs


def _resumed_calls(callbacks, dataset, initial_epoch, epochs, steps_per_epoch):
    """The `(initial_epoch, epochs)` of each Keras `fit` call this `fit` makes.

    One, unless a `callbacks.Checkpoint` resumes in the middle of an epoch:
    then the rest of that epoch is a call of its own, whose data has that
    many batches, so that Keras ends it as it ends any epoch (a trainer draws
    from its generators at epoch ends), and the epochs after it are another.
    """
    from keras_multigpu.callbacks import Checkpoint

    whole = [(initial_epoch, epochs)]
    listed = callbacks.callbacks if isinstance(callbacks, keras.callbacks.CallbackList) else (
        callbacks or [])
    checkpoint = next((c for c in listed if isinstance(c, Checkpoint)), None)
    if checkpoint is None or steps_per_epoch is not None or dataset is None:
        return whole
    point = checkpoint.resume_point()
    if point is None:
        return whole
    epoch, step = point
    if not 0 < step < dataset.num_batches or epoch >= epochs or not dataset.resumable:
        return whole  # an epoch's end: the next starts afresh
    dataset.skip = step  # Keras reads the epoch's length as the call starts
    return [(epoch, epoch + 1)] + ([(epoch + 1, epochs)] if epoch + 1 < epochs else [])


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
    save the first process makes (a save ends at a barrier that every process must reach),
    writing nothing itself and deleting nothing at the end."""

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


def _readers(callbacks):
    """The callbacks a process other than the first runs (see `_WRITERS`)."""
    if callbacks is None or isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks
    listed = callbacks if isinstance(callbacks, (list, tuple)) else [callbacks]
    return [
        _RestoreOnly(c) if isinstance(c, keras.callbacks.BackupAndRestore) else c
        for c in listed if not isinstance(c, _WRITERS)
    ]


def _close(dataset):
    close = getattr(dataset, "close", None)
    if close is not None:
        close()


def _checked_step_result(template, step, result, stateless):
    """The template's step result, refused with a clear error if Keras could not use it."""
    logs = result
    if stateless:  # JAX: (logs, state)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(
                f"{type(template).__name__}.{step} must return (logs, state) on the JAX "
                f"backend, as Keras's own does. Received: {_describe(result)}."
            )
        logs = result[0]
    if not isinstance(logs, collections.abc.Mapping):
        raise TypeError(
            f"{type(template).__name__}.{step} must return its logs as a dict of metric "
            f"names to values (e.g. {{'loss': loss}}), as Keras's own does. Received: "
            f"logs of type {type(logs).__name__}: {_describe(logs)}."
        )
    return result


def _describe(value):
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _check_int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(
            f"{name} must be an int >= {minimum}. Received: {name}={value!r}"
            f"{'' if isinstance(value, (int, np.integer)) else f' of type {type(value).__name__}'}."
        )


def _check_fit_arguments(epochs, initial_epoch, validation_freq, callbacks, steps_per_epoch):
    """The scalar arguments of `fit`, refused before anything starts (Keras fails later)."""
    _check_int("epochs", epochs, 0)
    _check_int("initial_epoch", initial_epoch, 0)
    if steps_per_epoch is not None:
        _check_int("steps_per_epoch", steps_per_epoch, 1)
    if isinstance(validation_freq, (list, tuple)):
        for epoch in validation_freq:
            _check_int("each epoch in validation_freq", epoch, 1)
    else:
        _check_int("validation_freq", validation_freq, 1)
    if callbacks is not None and not isinstance(callbacks, keras.callbacks.CallbackList):
        listed = callbacks if isinstance(callbacks, (list, tuple)) else [callbacks]
        bad = [c for c in listed if not isinstance(c, keras.callbacks.Callback)]
        if bad or not isinstance(callbacks, (list, tuple)):
            raise TypeError(
                "callbacks must be a list of keras.callbacks.Callback instances. Received: "
                f"callbacks={_describe(callbacks)}."
            )


def _check_targets(template, x, y, method, step):
    """Array inputs without targets, for a compiled loss that needs them, are refused early.

    One device fails too, deep inside JAX ("None is not a valid value"). A model with
    its own step, or without a compiled loss, may well need no targets.
    """
    if y is not None or x is None or not batching._is_array_like(x):
        return
    if getattr(template, "_compile_loss", None) is None:
        return
    if getattr(type(template), step) is not getattr(keras.Model, step):
        return
    raise ValueError(
        f"{method} received inputs but no targets (y=None), and the model's compiled loss "
        f"compares predictions with targets. Pass y=..., or, for a model that computes "
        "its own loss (in its train_step or with add_loss), compile it without a loss."
    )


def _optimizers(model):
    """The model's optimizers: its compiled one, and any other it holds as an attribute
    (directly, or in a list, tuple or dict), each once."""
    found = []

    def add(value):
        if isinstance(value, keras.optimizers.Optimizer) and all(value is not f for f in found):
            found.append(value)

    add(getattr(model, "optimizer", None))
    for value in vars(model).values():
        if isinstance(value, dict):
            value = list(value.values())
        for item in value if isinstance(value, (list, tuple)) else (value,):
            add(item)
    return found


def _compile_arguments(template, args, kwargs):
    """The arguments of a `compile` call by parameter name, where they bind to the template's
    `compile` (else none: its own call then raises the user's error)."""
    try:
        return inspect.signature(template.compile).bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return {}


def _check_gradient_accumulation(optimizer):
    steps = getattr(optimizer, "gradient_accumulation_steps", None)
    if steps is None:
        return
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(
            "gradient_accumulation_steps must be None or an integer >= 2 (gradients "
            f"averaged over that many batches). Received: gradient_accumulation_steps={steps!r} "
            f"on {type(optimizer).__name__}. Pass None to update at every batch."
        )


def _check_reductions(loss):
    """Refuses losses that leave a vector, which no optimizer can minimise.

    One device fails on them too, but deep inside the gradient computation.
    """
    for item in tree.flatten(loss):
        reduction = getattr(item, "reduction", "sum_over_batch_size")
        if reduction in (None, "none"):
            raise ValueError(
                f"The loss {item!r} has reduction={reduction!r}, so it returns one value "
                "per sample and training has no scalar to minimise. Use "
                "'sum_over_batch_size' (the default), 'mean_with_sample_weight' or 'sum'."
            )


def _names(template, kind):
    """The template's input or output names, when it has them (Functional models)."""
    if kind == "output":
        names = getattr(template, "output_names", None)
        return list(names) if names else None
    struct = getattr(template, "_inputs_struct", None)
    if isinstance(struct, dict):
        return list(struct)
    inputs = getattr(template, "_inputs", None) if hasattr(template, "_inputs_struct") else None
    if not inputs:
        return None
    return [getattr(t, "name", None) for t in inputs]


def _check_names(template, data, what, kind):
    """Dict data must be keyed by the template's input (x) or output (y) names."""
    if not isinstance(data, dict):
        return
    names = _names(template, kind)
    if not names:
        return
    unknown = sorted(str(key) for key in data if key not in names)
    if unknown:
        raise ValueError(
            f"{what} is a dict with key(s) {unknown} that name no {kind} of the model "
            f"{template.name!r}. Its {kind}s are {names}. Key {what} by those names."
        )


def _split(x, y, sample_weight, fraction):
    """Keras's `validation_split`: the last `fraction` of the rows, unshuffled."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(
            f"validation_split must be in (0, 1). Received: validation_split={fraction}."
        )
    rows = batching._num_rows(x, "x")
    cut = int(rows * (1.0 - fraction))
    if cut in (0, rows):
        raise ValueError(
            f"validation_split={fraction} of {rows} samples leaves an empty "
            "training or validation set. Pass more data or another fraction."
        )

    train, val = slice(0, cut), slice(cut, rows)
    return (
        tuple(batching._take(part, train) for part in (x, y, sample_weight)),
        tuple(batching._take(part, val) for part in (x, y, sample_weight)),
    )

