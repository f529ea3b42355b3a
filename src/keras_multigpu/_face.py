"""`ParallelModel`'s face: what it shows of its template (a mixin). `save` and the weight
methods act on the template, so every file written is a plain Keras file of the user's
model, written atomically, by one process only."""

import contextlib
import functools
import os
import zipfile

import keras

from keras_multigpu import processes
from keras_multigpu._io import (
    atomic_export,
    atomic_path,
    check_suffix,
    unreadable,
    without_values,
)
from keras_multigpu._keras import io_utils, replace_saving

# What Keras's `Model.save` writes: its own format, or the legacy HDF5 one.
SAVE_SUFFIXES = (".keras", ".h5", ".hdf5")


class TemplateFace:
    """The template's weights, files, summary and structure, as the `ParallelModel`'s."""

    def __getattr__(self, name):
        # Only reached when normal lookup fails: the template's own public
        # attributes (output_names, an encoder, ...) read through the wrapper.
        with contextlib.suppress(AttributeError):
            # The torch backend keeps sub-modules (the template among them) in
            # torch.nn.Module's own tables, which its __getattr__ reads.
            return super().__getattr__(name)
        template = _template(self)
        if template is None or name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(template, name)

    def __setattr__(self, name, value):
        """An attribute the template's own class set, written through the wrapper (a
        callback's `self.model.beta = 0.5`, which the template's `train_step` reads), is
        written to the template, where its steps read it, and read back from there. Keras's
        own attributes, and layers, variables, metrics and optimizers, stay where they are."""
        if name.startswith("_") or name in self.__dict__.get("_keras_names", ()):
            return super().__setattr__(name, value)  # most writes: Keras's own
        template = _template(self)
        if (template is not None and name in vars(template)
                and not isinstance(vars(template)[name], _TRACKED)
                and not isinstance(value, _TRACKED)):
            setattr(template, name, value)
            self.__dict__.pop(name, None)  # a copy the wrapper held before the template had it
            return
        super().__setattr__(name, value)

    def save(self, filepath, overwrite=True, zipped=None, **kwargs):
        """Saves the template as a plain Keras file, atomically (by one process only):
        `.keras`, or Keras's legacy HDF5 (`.h5`, `.hdf5`), as `Model.save` takes them;
        with `zipped=False`, Keras's unzipped folder (written in place, by Keras)."""
        if zipped is False:
            self._refuse_existing(filepath, overwrite)
            return self.template.save(filepath, zipped=False, **kwargs)
        filepath = check_suffix(filepath, SAVE_SUFFIXES)
        self._refuse_existing(filepath, overwrite)
        if self._backend.process_count() > 1:
            # The engine writes on the first process, atomically, and waits for it.
            return self.template.save(filepath, **kwargs)
        suffix = next(s for s in SAVE_SUFFIXES if filepath.endswith(s))
        with atomic_path(filepath, suffix) as tmp:
            self.template.save(tmp, **kwargs)

    def save_weights(self, filepath, overwrite=True, **kwargs):
        """Saves the template's weights (`.weights.h5`), atomically (by one process only)."""
        check_suffix(filepath, ".weights.h5")
        self._refuse_existing(filepath, overwrite)
        if self._backend.process_count() > 1:
            return self.template.save_weights(filepath, **kwargs)
        with atomic_path(filepath, ".weights.h5") as tmp:
            self.template.save_weights(tmp, **kwargs)

    def _refuse_existing(self, filepath, overwrite):
        """overwrite=False onto an existing path: `FileExistsError`, on every process alike
        (each looks before any writes: process 0 writes and goes on, and a process behind
        it would find its file)."""
        if overwrite:
            return
        there = os.path.exists(filepath)
        if self._backend.process_count() > 1:
            there = any(processes.all_gather_object(
                there, f"the check that {os.fspath(filepath)} is not there (overwrite=False)"))
        if there:
            raise FileExistsError(f"{filepath} exists and overwrite=False.")

    def load_weights(self, filepath, **kwargs):
        """Loads weights into the template; a missing or damaged file is named in the error."""
        if not os.path.exists(filepath):
            raise FileNotFoundError(
                f"No such weights file: {filepath}. Pass the path of a .weights.h5 or .keras "
                "file written by save_weights, save or ModelCheckpoint."
            )
        try:
            self.template.load_weights(filepath, **kwargs)
        except (OSError, KeyError, zipfile.BadZipFile) as error:
            # KeyError: a zip without the weights Keras looks for (zipfile's "There is no
            # item named 'model.weights.h5'").
            if not os.path.isfile(filepath):
                raise
            raise unreadable(os.fspath(filepath), error) from error
        except ValueError as error:  # another model's weights
            said = without_values(str(error))
            if said == str(error):
                raise
            raise ValueError(f"{os.fspath(filepath)} does not fit this model: {said}") from error

    def export(self, filepath, *args, **kwargs):
        """Exports the template (Keras's `Model.export`: a SavedModel, ONNX, ...), whole or
        not at all (`atomic_export`); with several processes, the first writes it and every
        process returns once it has."""
        backend = self._backend
        if backend.process_count() == 1:
            with atomic_export(filepath) as staged:
                return self.template.export(staged, *args, **kwargs)
        failed = None
        if backend.process_index() == 0:
            try:
                with atomic_export(filepath) as staged:
                    self.template.export(staged, *args, **kwargs)
            except Exception as error:
                failed = error
        said = processes.all_gather_object(
            None if failed is None else f"{type(failed).__name__}: {failed}",
            f"the export of {filepath} (process 0 writes it)")[0]
        if failed is not None:
            raise failed
        if said is not None:
            raise RuntimeError(f"Process 0 could not export {filepath}: {said}")
        return None

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

    def to_json(self, **kwargs):
        return self.template.to_json(**kwargs)

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """A model from the config `get_config` gives, the template's: so
        `keras.models.clone_model(parallel)` clones the template, a plain Keras model (as
        a `ParallelModel` saves one), for a Sequential or functional template."""
        if isinstance(config, dict) and "input_layers" in config:
            return keras.Model.from_config(config, custom_objects=custom_objects)
        if isinstance(config, dict) and "layers" in config:
            return keras.Sequential.from_config(config, custom_objects=custom_objects)
        raise TypeError(
            "A ParallelModel's config is its template's, and this template is a subclassed "
            "model, which only its own class rebuilds. Clone the template: "
            "keras.models.clone_model(parallel.template), and wrap the clone with "
            "multi_gpu_model to train it on every device.")

    def __reduce__(self):
        # pickle and copy.deepcopy copy the template, a plain Keras model, as `save` writes
        # it (Keras pickles a model through its saving library).
        return self.template.__reduce__()

    @property
    def layers(self):
        return self.template.layers

    @property
    def inputs(self):
        return self.template.inputs

    @property
    def outputs(self):
        return self.template.outputs


def _template(model):
    """The wrapper's template, or None while it is made (the torch backend keeps it in
    torch.nn.Module's table of sub-modules)."""
    return model.__dict__.get("template") or model.__dict__.get("_modules", {}).get("template")


_TRACKED = (keras.layers.Layer, keras.Variable, keras.metrics.Metric, keras.optimizers.Optimizer)


def save_templates():
    """Makes `keras.saving.save_model(parallel, ...)` and `keras.saving.save_weights` (and
    their aliases: `keras.models.save_model`) of a `ParallelModel` its own `save` and
    `save_weights`: the template, a plain Keras file that loads without this library. Once
    a model is wrapped (the wrapper is not a Keras class that Keras's loader knows)."""
    for name, method in (("save_model", "save"), ("save_weights", "save_weights")):
        replace_saving(name, functools.partial(_as_template, method), "_keras_multigpu_template")


def _as_template(method, function):
    @functools.wraps(function)
    def wrapper(model, *args, **kwargs):
        if isinstance(model, TemplateFace):
            return getattr(model, method)(*args, **kwargs)
        return function(model, *args, **kwargs)

    wrapper._keras_multigpu_template = function
    return wrapper
