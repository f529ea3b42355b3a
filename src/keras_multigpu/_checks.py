"""The checks `ParallelModel` makes before a call: an error that says what was received
and what to do, before anything starts (Keras would fail later, or deep inside)."""

import collections.abc
import inspect

import keras
import numpy as np
from keras import tree

from keras_multigpu import batching


def _takes_text(model, engine_can):
    """Whether `model` may be fed text: on an engine whose model can take it (`engine_can`,
    see `batching.check_dtypes`), a model with a string input, or one that declares none
    (a subclassed model, which may hold a TextVectorization)."""
    inputs = tree.flatten(getattr(model, "inputs", None) or [])
    return engine_can and (not inputs or any(
        getattr(t, "dtype", None) == "string" for t in inputs))


def _rows(data, tensors, names):
    """The row shapes of `data`'s arrays in the order of `tensors` (the model's inputs or
    outputs; a dict of arrays is matched by `names`, as Keras matches it), of `tensors`,
    and whether any pair differs; None where they cannot be paired or a shape is of
    unknown rank."""
    try:
        if isinstance(data, dict):
            if not names or any(n not in data for n in names):
                return None
            data = [data[n] for n in names]
        arrays = tree.flatten(data)
        rows = [tuple(getattr(a, "shape", ()))[1:] for a in arrays]
        takes = [tuple(t.shape)[1:] for t in tensors]
    except (TypeError, ValueError):
        return None
    if len(rows) != len(takes):
        return None

    def fits(r, t):  # Keras adds a last axis of 1 to an array of one axis fewer
        r = r + (1,) if len(r) + 1 == len(t) and t[-1:] == (1,) else r
        return len(r) == len(t) and all(a is None or b is None or a == b for a, b in zip(r, t))

    return rows, takes, [not fits(r, t) for r, t in zip(rows, takes)]


def _input_rows(template, x):
    """`_rows` of `x` against the model's declared inputs, or None (none declared)."""
    inputs = tree.flatten(getattr(template, "inputs", None) or [])
    return _rows(x, inputs, [i.name for i in inputs]) if inputs else None


def _does_not_fit(template, rows, takes):
    return (f"x does not fit {type(template).__name__} {template.name!r}: each row of x has "
            f"the shape {_one(rows)}, and the model's input takes rows of the shape "
            f"{_one(takes)}.")


def _one(shapes):
    return shapes[0] if len(shapes) == 1 else shapes


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


def _check_batch_state(model, replicas, whole_batch):
    """Refuses layers whose state holds one row per sample of a fixed batch (stateful RNNs),
    on several replicas of an engine where each sees its share of the batch (without the
    `whole_batch` capability)."""
    if replicas < 2 or whole_batch:
        return
    layers = [layer for layer in model._flatten_layers() if bool(getattr(layer, "stateful", 0))]
    inner = {id(sub) for layer in layers for sub in layer._flatten_layers(include_self=False)}
    stateful = [layer.name for layer in layers if id(layer) not in inner]  # a Bidirectional once
    if stateful:
        raise ValueError(
            f"The model has stateful layer(s) {stateful} (stateful=True): their state keeps "
            "one row per sample of a fixed batch from batch to batch, and on the "
            f"{keras.backend.backend()} backend each device runs its own share of the batch. "
            "Train it on one device (gpus=1), with stateful=False, or on the JAX backend, "
            "whose devices run one step on the whole batch."
        )


def check_overwritten(model, replicas, whole_batch):
    """Refuses to train variables that the optimizer overwrites with their "gradient"
    (Keras's float8 layers' scales and amax histories) on several replicas of an engine where
    each sees its share of the batch (without the `whole_batch` capability)."""
    if replicas < 2 or whole_batch:
        return
    names = [v.path for v in model.trainable_variables
             if getattr(v, "overwrite_with_gradient", False)]
    if names:
        raise ValueError(
            f"The model has {len(names)} variable(s) that its optimizer overwrites with their "
            f"gradient ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}): Keras's "
            "float8 training (model.quantize('float8')). Each holds the largest value over "
            f"the whole batch, and on the {keras.backend.backend()} backend each device "
            "trains on its own share, with gradients scaled for its share: those values, and "
            "the float8 rounding they set, would not be one device's. Train it on one device "
            "(gpus=1), or on the JAX backend, whose devices run one step on the whole batch. "
            "evaluate and predict run on every device as they are."
        )


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
    return check_callbacks(callbacks)


def check_callbacks(callbacks):
    """`callbacks` as Keras's `CallbackList` takes them (None, a `CallbackList`, one callback,
    or lists of them, which it flattens), as None, that `CallbackList` or a list."""
    if callbacks is None or isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks
    listed = keras.tree.flatten(callbacks) if isinstance(callbacks, (list, tuple)) \
        else [callbacks]
    if any(not isinstance(c, keras.callbacks.Callback) for c in listed):
        raise TypeError(
            "callbacks must be a list of keras.callbacks.Callback instances. Received: "
            f"callbacks={_describe(callbacks)}."
        )
    return listed


def _check_rows(template, x, method):
    """Arrays whose rows cannot fit the model's declared inputs (an axis of another size, at
    the input's rank) are refused before training: validation data is fed only after an
    epoch, where Keras's own error would come."""
    found = _input_rows(template, x) if batching._is_array_like(x) else None
    if found is not None and any(differs and len(r) == len(t) for r, t, differs in zip(*found)):
        raise ValueError(f"{method}: {_does_not_fit(template, *found[:2])} Pass x whose rows "
                         "have the shape the model takes.")


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
    (directly, or in a list, tuple or dict), each once, with the optimizer a wrapper holds
    (a LossScaleOptimizer's, under mixed_float16)."""
    found = []

    def add(value):
        if isinstance(value, keras.optimizers.Optimizer) and all(value is not f for f in found):
            found.append(value)
            add(getattr(value, "inner_optimizer", None))

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


def _needs_symbolic_build(model):
    """Keras's own test (`Trainer._symbolic_build`) for building from a batch."""
    return (
        not all(layer.built for layer in model._flatten_layers())
        or (model._compile_metrics is not None and not model._compile_metrics.built)
        or (model._compile_loss is not None and not model._compile_loss.built)
    )


def _step_builds_it(model):
    """A model with its own `train_step` whose layers, compiled loss and metrics are built,
    and which has no `build` of its own: what a batch would build is the model alone, which
    its step calls. Keras's TensorFlow trainer without a strategy builds nothing up front,
    so such a model trains on one device even where Keras's guess of its inputs (the batch
    unpacked into x, y and sample weights) is not what its step calls it on: keras-io's
    Siamese network, fed (anchor, positive, negative) tuples."""
    return (type(model).train_step is not keras.Model.train_step
            and type(model).build is keras.Model.build
            and all(layer.built for layer in model._flatten_layers(include_self=False))
            and all(part is None or part.built
                    for part in (model._compile_loss, model._compile_metrics)))


def _builds_in_its_step(model):
    """A model with no `call` whose sub-models are built (a GAN whose `train_step` calls its
    generator and discriminator): nothing can build it from a batch, and its step needs
    nothing more."""
    return type(model).call is keras.Model.call and all(
        layer.built for layer in model._flatten_layers(include_self=False))
