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

import contextlib
import os
import warnings

import keras
from keras import tree

from keras_multigpu import _keras, backends, batching, launch, processes
from keras_multigpu import devices as devices_lib
from keras_multigpu._build_errors import _build_error
from keras_multigpu._calls import Calls
from keras_multigpu._checks import (
    _builds_in_its_step,
    _check_batch_state,
    _check_gradient_accumulation,
    _check_reductions,
    _checked_step_result,
    _compile_arguments,
    _needs_symbolic_build,
    _optimizers,
    _step_builds_it,
)
from keras_multigpu._face import TemplateFace, save_templates


def multi_gpu_model(model, gpus=None, cpu_merge=True, cpu_relocation=False):
    """Returns a `ParallelModel` that trains `model` on several devices.

    Args:
        model: a Keras 3 model (Sequential, Functional or subclassed). It is
            not copied: after `fit`, `model` holds the trained weights.
            Passing a `ParallelModel` wraps its template again (no nesting).
        gpus: None for every accelerator (every CPU device when there is
            none); an int k for the first k devices (0 and 1 mean one
            device); or a list of device ids, e.g. `[0, 2]`.
        cpu_merge, cpu_relocation: `tf.keras.utils.multi_gpu_model`'s, taken so
            that its callers run unchanged, and without effect: the engine merges
            outputs and gradients, and the template, which holds the weights,
            saves and loads on any device.

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
        path = isinstance(model, (str, os.PathLike))
        raise TypeError(
            "multi_gpu_model expects a keras.Model (Sequential, Functional or "
            f"subclassed). Received: model of type {type(model).__name__}."
            + (f" To wrap a saved model, load it first: keras.saving.load_model({str(model)!r})."
               if path else "")
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
    _check_batch_state(model, len(chosen), backends.has(backend, "whole_batch"))
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


def _symbolic(value):
    if value is None:
        return None
    dtype = "string" if batching.is_text(value) else keras.backend.standardize_dtype(value.dtype)
    return keras.KerasTensor(value.shape, dtype)


# Found by name where Keras rebuilds a ParallelModel from its config (clone_model).
@keras.saving.register_keras_serializable("keras_multigpu")
class ParallelModel(Calls, TemplateFace, keras.Model):
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
        save_templates()  # keras.saving.save_model(parallel, ...) writes the template too
        # Built in the engine's scope: TensorFlow's trainer takes its strategy from it.
        with backend.scope(distribution):
            super().__init__(name=template.name)
        self._keras_names = frozenset(self.__dict__)  # Keras's own (see `TemplateFace`)
        self.template = template
        self._devices = tuple(devices)
        self._backend = backend
        self._distribution = distribution
        # Again for several TensorFlow workers, whose replicas reach beyond `devices`.
        _check_batch_state(template, self.num_replicas, backends.has(backend, "whole_batch"))
        self._synced_compile = None
        self._active = 0  # calls under way (`_placed`)
        self._fit_dataset = None  # the padded training data of the `fit` under way
        if template.built:
            self.built = True
        self._sync_compile()

    devices = property(lambda self: list(self._devices))
    num_replicas = property(lambda self: getattr(self._distribution, "num_replicas",
                                                 len(self._devices)))

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
        for optimizer in optimizers:  # iterations and learning rate, built or not (a
            variables += list(optimizer.variables)  # wrapper's hold its inner one's)
        return list({id(v): v for v in variables}.values()), optimizers

    def _replicate_state(self):
        variables, optimizers = self._state()
        processes.check_same_model(variables)
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
            if backends.has(self._backend, "kept"):  # a call that raised between steps
                self._backend.put_back(self)
            raise
        finally:
            self._active -= 1
            if not self._active:
                if backends.has(self._backend, "release"):
                    variables, optimizers = self._state()
                    try:
                        self._backend.release(variables, self._distribution,
                                              optimizers=optimizers, failed=failed)
                    except Exception:
                        # The call's own error says what went wrong (a worker that
                        # stopped leaves every later read failing too): it goes on.
                        if not failed:
                            raise

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
        try:
            self.template._symbolic_build(data_batch=data_batch)
        except Exception as error:  # each framework's own, for a shape that does not fit
            clearer = _build_error(self.template, data_batch, error)
            if clearer is None:
                raise
            raise clearer from error
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
            try:
                self._symbolic_build(data_batch=data_batch)
            except Exception:
                if not _step_builds_it(self.template):
                    raise
                self.built = True  # as `_builds_in_its_step`: its step builds the model

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
        steps = wanted = template.steps_per_execution
        if steps > 1 and not backends.has(self._backend, "multi_step"):
            steps = (self._backend.steps_per_execution(self._distribution, steps) if
                     backends.has(self._backend, "lone_multi_step") else 1)
        if steps != wanted:
            warnings.warn(
                f"steps_per_execution={wanted} runs as {steps} on {self.num_replicas} "
                f"{keras.backend.backend()} device(s) under tf.distribute (all but the default "
                "device alone), whose multi-step loop fails (keras-team/keras#19246). The "
                "results are the same; callbacks' batch hooks run after every step.", stacklevel=3)
        with self._scope():
            super().compile(
                optimizer=template.optimizer,
                steps_per_execution=steps,
                jit_compile=template.jit_compile if backends.has(self._backend, "jit") else (
                    backends.has(self._backend, "xla_draws")
                    and self._backend.jit_compile(self._distribution, template.jit_compile)),
                run_eagerly=template.run_eagerly,
            )
        if backends.has(self._backend, "recompile"):
            self._backend.recompiled(self._state()[0], self._distribution)
        self._synced_compile = config

    # -- the template's steps ---------------------------------------------

    def _watched(self, function, what):
        if backends.has(self._backend, "kept"):
            function = self._backend.kept(function, self)
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
        if not getattr(self, "_built_to_predict", False):  # checked once, not every step
            if backends.has(self._backend, "process_per_device") and not all(
                    layer.built for layer in self.template._flatten_layers()):
                # Not in Keras's torch step, where each process drew its weights (the rules)
                x, _, _ = keras.utils.unpack_x_y_sample_weight(self._backend.untag(data))
                _keras.backend.compute_output_spec(self.template,
                                                   tree.map_structure(_symbolic, x))
            self._built_to_predict = True
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
