"""Clearer errors where a model cannot be built from the batch it is fed: the batch's rows
do not fit its inputs or its outputs, its step takes a batch whose first axis is not the
samples, or its step builds layers that every device needs built before the first step."""

import re

import keras
from keras import tree

from keras_multigpu._checks import _does_not_fit, _input_rows, _one, _rows


def _rows_not_first(template, data_batch, error):
    """A clearer error where a model with its own `train_step` cannot be built from the
    batch it is fed (`error`, Keras's ValueError), an array of which has more axes than
    the model's input, else None.

    Such a step may take a batch whose first axis is not the samples (the anchors and
    positives of a metric-learning example stacked on axis 0, `data[0]` and `data[1]`):
    one device never calls the model on the batch, but any data-parallel engine splits
    the batch along its first axis, one share per device.
    """
    if type(template).train_step is keras.Model.train_step:
        return None
    x = data_batch[0] if isinstance(data_batch, (tuple, list)) else data_batch
    inputs = tree.flatten(getattr(template, "inputs", None) or [])
    arrays = tree.flatten(x)
    if len(inputs) != len(arrays) or not any(  # else Keras's error says what is wrong
            len(getattr(a, "shape", ())) > len(i.shape) for a, i in zip(arrays, inputs)):
        return None
    shapes = tree.map_structure(lambda t: tuple(getattr(t, "shape", ())), x)
    return ValueError(
        f"{type(template).__name__} has its own train_step, and the model cannot take the "
        f"batch it is fed: x of shape {shapes}. keras-multigpu, like any data-parallel "
        "engine, reads the first axis of every array as the samples, splits it among the "
        "devices, and builds the model, its loss and metrics from a batch. A batch whose "
        "first axis is not its samples (anchors and positives stacked on axis 0, read as "
        "data[0] and data[1]) cannot be split: feed batches whose arrays each have the "
        f"samples first, or train this model without the wrapper. Keras said: {error}"
    )


def _input_mismatch(template, data_batch, error):
    """One line where the batch's arrays do not fit the model's inputs (Keras's own error,
    `error`, wraps it in the model's call: ANSI codes and an "Arguments received" block),
    naming the shapes of the rows both have, else None (a model without declared inputs,
    or whose inputs x fits: a layer inside the model is what is wrong)."""
    said = next((line for line in str(error).splitlines() if "is incompatible with" in line),
                None)
    x = data_batch[0] if isinstance(data_batch, (tuple, list)) else data_batch
    found = _input_rows(template, x) if said else None
    if found is None or not any(found[2]):
        return None
    rows, takes, _ = found
    said = _plain(said)
    return ValueError(
        f"{_does_not_fit(template, rows, takes)} Keras said: {said.rstrip('.')}. Pass x "
        "whose rows have the shape the model takes, or build the model for x's.")


def _target_mismatch(template, data_batch, error):
    """One line where building the loss failed on a shape (a framework's error from inside
    the loss: JAX's "sub got incompatible shapes", torch's "The size of tensor a") and the
    batch's targets do not have the rows of the model's outputs, naming both, else None.
    Targets of one column, or of fewer axes (class indices for a sparse loss), are left to
    Keras."""
    text = _plain(str(error))
    outputs = tree.flatten(getattr(template, "outputs", None) or [])
    if not (isinstance(error, (ValueError, TypeError, RuntimeError)) and re.search(
            r"shape|size|[Dd]imension", text) and isinstance(data_batch, (tuple, list))
            and len(data_batch) > 1 and outputs):
        return None
    found = _rows(data_batch[1], outputs, getattr(template, "output_names", None))
    if found is None or not any(
            differs and len(t) == len(g) and t[-1:] != (1,)
            for t, g, differs in zip(*found)):
        return None
    targets, gives, _ = found
    said = next(iter(text.splitlines()), "")
    return ValueError(
        f"fit could not build {type(template).__name__} {template.name!r}'s loss from the "
        f"first batch, whose y does not have the rows of the model's output: each row of y "
        f"has the shape {_one(targets)}, and the model's output gives rows of the shape "
        f"{_one(gives)}. {type(error).__name__}: {said.rstrip('.')}. Pass y whose rows have "
        "the output's shape, or a loss that takes y's (a sparse loss takes class indices).")


def _build_error(template, data_batch, error):
    """A clearer error where the model cannot be built from the batch it is fed, or None."""
    if isinstance(error, ValueError):
        clearer = _rows_not_first(template, data_batch, error) or _input_mismatch(
            template, data_batch, error)
        if clearer is not None:
            return clearer
    return _target_mismatch(template, data_batch, error) or _built_in_its_step(
        template, error)


def _built_in_its_step(template, error):
    """A clearer error where Keras could not build, from a batch, a model with its own
    `train_step` and no `call` whose layers are not built (its step calls them), else
    None. Keras's TensorFlow trainer without a strategy builds nothing up front, so one
    device builds them in its first step there; every device needs the variables before
    the first step, as Keras's JAX and torch trainers do."""
    unbuilt = [layer.name for layer in template._flatten_layers(include_self=False)
               if not layer.built]
    if (type(template).train_step is keras.Model.train_step
            or type(template).call is not keras.Model.call or not unbuilt):
        return None  # with a `call`, Keras's error names what failed in it
    said = next(iter(_plain(str(error)).splitlines()), "")
    return RuntimeError(
        f"{type(template).__name__} {template.name!r} has its own train_step, and these "
        f"of its layers are not built: {', '.join(unbuilt)}. Keras could not build the "
        f"model from a batch ({type(error).__name__}: {said.rstrip('.')}). Its step "
        "builds them on one TensorFlow device, but every device needs the model's "
        "variables before the first step. Build them before fit: call each of these "
        "layers once on what its step passes it, then set the model's built = True (as "
        "keras-io's GAN on torch does).")


def _plain(text):
    """`text` without the ANSI codes Keras's errors set words in bold with."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text).strip()
