"""`multi_gpu_model()` and `ParallelModel`: thin wiring of the modules below.

`ParallelModel` is a `keras.Model` whose only layer is the user's model (the
*template*): it owns no variables, so training it trains the template. Its
`fit`, `evaluate` and `predict` are Keras's own, fed padded batches by
`batching` and run inside the backend's distribution scope, entered for the
call and left after it, so no global state outlives a call. `save` and the
weight methods act on the template, so every file written is a plain Keras
file of the user's model.
"""

import contextlib
import os

import keras
from keras import tree
from keras.src.utils import io_utils

from keras_multigpu import backends, batching, masking
from keras_multigpu import devices as devices_lib
from keras_multigpu._io import atomic_path


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
    backend = backends.current()
    chosen = devices_lib.select(gpus, backend.list_devices())
    return ParallelModel(model, chosen)


# Array datasets up to this size (per device: each holds a copy) are placed on
# the devices once per call, and every batch is gathered there.
RESIDENT_LIMIT_BYTES = 2 * 2**30


class ParallelModel(keras.Model):
    """A model replicated on `devices`, each global batch split among them.

    Behaves like the Keras model it wraps (`compile`, `fit`, `evaluate`,
    `predict`, `save`, ...). `batch_size` is the global batch: results equal
    one device's with the same batch (see the README's "Semantics").

    Attributes:
        template: the model passed to `multi_gpu_model`, which holds the
            weights.
        devices: the `Device` records replicas run on.
        num_replicas: `len(devices)`.
    """

    def __init__(self, template, devices):
        super().__init__(name=f"parallel_{template.name}")
        self.template = template
        self._devices = tuple(devices)
        self._backend = backends.current()
        self._distribution = self._backend.make_distribution(self._devices)
        self._scale_by_rows = True
        if template.built:
            self.built = True
        if getattr(template, "compiled", False):
            self._compile_like_template()

    devices = property(lambda self: list(self._devices))
    num_replicas = property(lambda self: len(self._devices))

    def call(self, inputs, training=None):
        return self.template(inputs, training=training)

    def _replicate_state(self):
        variables = list(self.template.variables) + list(self.metrics_variables)
        if getattr(self, "optimizer", None) is not None:
            # Includes the iteration count and learning rate, which exist
            # before the optimizer is built.
            variables += list(self.optimizer.variables)
        self._backend.replicate(variables, self._distribution)

    @contextlib.contextmanager
    def _placed(self):
        """The distribution scope, with every existing variable replicated."""
        with self._distribution.scope():
            self._replicate_state()
            yield

    def reset_metrics(self):
        # Keras resets metrics at every epoch and evaluate with fresh arrays on
        # the default device; put them back on the mesh so that the compiled
        # step sees the placement it was compiled for.
        super().reset_metrics()
        self._backend.replicate(self.metrics_variables, self._distribution)

    def _symbolic_build(self, *args, **kwargs):
        # Keras builds the compiled metrics here, and metric objects the user
        # made (e.g. keras.metrics.AUC()) created their variables outside the
        # scope: place them before the step is compiled.
        super()._symbolic_build(*args, **kwargs)
        self._replicate_state()

    # -- compile ---------------------------------------------------------

    def compile(self, optimizer="rmsprop", loss=None, **kwargs):
        # The template is compiled too, sharing the optimizer, so that a file
        # saved from it can resume training like any compiled Keras model.
        masking.scales_by_rows(loss)  # refuse a bad loss before changing anything
        self.template.compile(optimizer=optimizer, loss=loss, **kwargs)
        self._compile_own(self.template.optimizer, loss, kwargs)

    def _compile_like_template(self):
        config = dict(self.template._compile_config.config)
        config.pop("optimizer", None)
        loss = config.pop("loss", None)
        self._compile_own(self.template.optimizer, loss, config)

    def _compile_own(self, optimizer, loss, kwargs):
        self._scale_by_rows = masking.scales_by_rows(loss)
        with self._distribution.scope():
            super().compile(optimizer=optimizer, loss=loss, **kwargs)
        # Bypass attribute tracking: the tracker replaces Keras's, not adds to it.
        object.__setattr__(self, "_loss_tracker", masking.RowMean(name="loss"))

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        weights, mask = sample_weight or (None, None)
        return masking.compute_loss(self, y, y_pred, weights, mask, self._scale_by_rows)

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        weights, mask = sample_weight or (None, None)
        masking.update_metrics(self._compile_metrics, y, y_pred, weights, mask)
        return self.get_metrics_result()

    # -- training and inference -----------------------------------------

    def _place(self, arrays):
        """Keeps array data on the devices when it is small enough (see README)."""
        size = sum(leaf.nbytes for leaf in tree.flatten(arrays) if leaf is not None)
        if size > RESIDENT_LIMIT_BYTES:
            return None
        return self._backend.resident(arrays, self._distribution)

    def _padded(self, x, y=None, sample_weight=None, **kwargs):
        return batching.as_padded(x, y, sample_weight, replicas=self.num_replicas,
                                  place=self._place, **kwargs)

    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto",
            callbacks=None, validation_split=0.0, validation_data=None,
            shuffle=True, class_weight=None, sample_weight=None, initial_epoch=0,
            steps_per_epoch=None, validation_steps=None, validation_batch_size=None,
            validation_freq=1, drop_remainder=False):
        """Keras's `fit`, with `batch_size` the global batch.

        `drop_remainder=True` skips the last, partial batch of each epoch
        (array inputs) instead of padding it.
        """
        if validation_split and validation_data is None:
            if not batching._is_array_like(x):
                raise ValueError(
                    "validation_split needs array inputs. Received: x of type "
                    f"{type(x).__name__}. Pass validation_data instead."
                )
            (x, y, sample_weight), validation_data = _split(x, y, sample_weight, validation_split)
        data, _ = self._padded(
            x, y, sample_weight, batch_size=batch_size, shuffle=shuffle,
            class_weight=class_weight, drop_remainder=drop_remainder,
        )
        if validation_data is not None:
            validation_data, _ = self._padded(
                *keras.utils.unpack_x_y_sample_weight(validation_data),
                batch_size=validation_batch_size or batch_size,
            )
        with self._placed():
            return super().fit(
                data, epochs=epochs, verbose=verbose, callbacks=callbacks,
                validation_data=validation_data, shuffle=False,
                initial_epoch=initial_epoch, steps_per_epoch=steps_per_epoch,
                validation_steps=validation_steps, validation_freq=validation_freq,
            )

    def evaluate(self, x=None, y=None, batch_size=None, verbose="auto",
                 sample_weight=None, steps=None, callbacks=None,
                 return_dict=False, **kwargs):
        data, _ = self._padded(x, y, sample_weight, batch_size=batch_size)
        with self._placed():
            return super().evaluate(
                data, verbose=verbose, steps=steps, callbacks=callbacks,
                return_dict=return_dict, **kwargs,
            )

    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
        """Keras's `predict`: exactly one output row per input row, in order."""
        data, dataset = self._padded(x, batch_size=batch_size)
        with self._placed():
            outputs = super().predict(data, verbose=verbose, steps=steps, callbacks=callbacks)
        keep = dataset.real_row_index()
        return tree.map_structure(lambda out: out[keep], outputs)

    def train_on_batch(self, x, y=None, sample_weight=None, class_weight=None, return_dict=False):
        batch, _ = batching.pad_batch((x, y, sample_weight), self.num_replicas, class_weight)
        with self._placed():
            return super().train_on_batch(*batch, return_dict=return_dict)

    def test_on_batch(self, x, y=None, sample_weight=None, return_dict=False):
        batch, _ = batching.pad_batch((x, y, sample_weight), self.num_replicas)
        with self._placed():
            return super().test_on_batch(*batch, return_dict=return_dict)

    def predict_on_batch(self, x):
        (x,), rows = batching.pad_batch((x,), self.num_replicas)
        with self._placed():
            outputs = super().predict_on_batch(x)
        return tree.map_structure(lambda out: out[:rows], outputs)

    # -- the template's face --------------------------------------------

    def save(self, filepath, overwrite=True, **kwargs):
        """Saves the template as a plain `.keras` file, atomically."""
        if not overwrite and os.path.exists(filepath):
            raise FileExistsError(f"{filepath} exists and overwrite=False.")
        with atomic_path(filepath, ".keras") as tmp:
            self.template.save(tmp, **kwargs)

    def save_weights(self, filepath, overwrite=True, **kwargs):
        """Saves the template's weights (`.weights.h5`), atomically."""
        if not overwrite and os.path.exists(filepath):
            raise FileExistsError(f"{filepath} exists and overwrite=False.")
        with atomic_path(filepath, ".weights.h5") as tmp:
            self.template.save_weights(tmp, **kwargs)

    def load_weights(self, filepath, **kwargs):
        self.template.load_weights(filepath, **kwargs)

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
