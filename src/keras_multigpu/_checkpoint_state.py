"""What a `Checkpoint` keeps of a run besides the model, and how it puts it back (a mixin):
the epoch and step, the data order read so far, the generators, the model's
`SeedGenerator`s and the metrics."""

import os
import random
import sys
import warnings

import keras
import numpy as np

from keras_multigpu import backends, batching, processes
from keras_multigpu._checks import _optimizers
from keras_multigpu._io import without_values
from keras_multigpu._keras import global_state, io_utils, seed_generator

CHECKPOINT_FORMAT = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, or that does not fit the run resuming from it."""


def _seed_generators(model):
    """The model's `SeedGenerator`s (Dropout's, noise layers', a model's own), in layer order.

    Their states are not in a `.keras` file, and a rebuilt model starts them at
    zero: a resumed run would draw other masks than an uninterrupted one.
    """
    found, seen = [], set()
    for layer in model._flatten_layers(include_self=True):
        for generator in getattr(layer, "_seed_generators", ()):
            if id(generator) not in seen:
                seen.add(id(generator))
                found.append(generator)
    return found


def _global_seed_generator():
    return global_state.get_global_attribute("global_seed_generator")


def _own_draws(dataset):
    """What the fit's input is (a `Feed`'s `source`), where it keeps a position or random
    state of its own that a checkpoint cannot hold; None for arrays, a PyDataset, and a
    DataLoader drawing its order from the engine's generator, which a checkpoint keeps."""
    source = getattr(dataset, "source", None)
    if source is None or dataset.resumable:
        return None
    data = sys.modules.get("torch.utils.data")  # a DataLoader exists only once imported
    if data is not None and isinstance(source, data.DataLoader):
        sampler = getattr(source.batch_sampler, "sampler", source.sampler)
        if not isinstance(source.dataset, data.IterableDataset) and (
                not hasattr(sampler, "generator") or (
                    sampler.generator is None and dataset._engine_state is not None)):
            return None  # it draws nothing, or from the engine's generator
        return "a torch DataLoader"
    if hasattr(source, "element_spec"):
        return "a tf.data.Dataset"
    return f"a {type(source).__name__}"


def _optimizer_names(model):
    """The classes of `model`'s optimizers (`_checks._optimizers`: the compiled one, the one
    a LossScaleOptimizer wraps, a GAN's own), or None where it has none."""
    return [type(optimizer).__name__ for optimizer in _optimizers(model)] or None


def _optimizer_weights(model):
    """For each of `model`'s optimizers (`_optimizers`' order), the places in `model.weights`
    of the variables it was built for, or None where it is not built (or holds others): a
    resume builds a GAN's own optimizers alike before their state loads, where their first
    step would build them after it (and their state would not load)."""
    places = {id(weight): i for i, weight in enumerate(model.weights)}
    found = []
    for optimizer in _optimizers(model):
        variables = getattr(optimizer, "_trainable_variables", None) if optimizer.built else None
        found.append(None if variables is None or any(id(v) not in places for v in variables)
                     else [places[id(v)] for v in variables])
    return found


def _build_optimizers(model, built):
    """Builds each optimizer of `model` that is not built on the weights `built`
    (`_optimizer_weights` of the run that wrote the checkpoint) names for it."""
    weights = model.weights
    for optimizer, places in zip(_optimizers(model), built or ()):
        if (places is not None and not optimizer.built
                and all(isinstance(p, int) and 0 <= p < len(weights) for p in places)):
            optimizer.build([weights[p] for p in places])


def _numpy(variable):
    return np.asarray(variable.numpy())


def _metric_state(model):
    variables = model.metrics_variables
    if backends.has(model._backend, "metric_shares"):
        return model._backend.global_metric_state(variables)
    return [_numpy(v) for v in variables]


def _epoch_batches(dataset):
    """The batches of the epoch `fit` runs (those a resume skips included); None where
    unknown: no dataset, or a generator's."""
    if dataset is None or dataset.num_batches is None:
        return None
    return dataset.num_batches + dataset.skip


# What a checkpoint's state.json holds (`CheckpointState._state`), and of which types.
_FIELDS = {"epoch": int, "step": int, "global_step": int, "num_batches": (int, type(None)),
           "data": dict, "random": dict}


def _checked_state(state):
    """`state` (state.json's), or a `CheckpointError` naming what does not fit."""
    if not isinstance(state, dict):
        raise CheckpointError(f"state.json holds a JSON {type(state).__name__}, not an object")
    if state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"format {state.get('format')!r}, expected {CHECKPOINT_FORMAT}")
    for key, kind in _FIELDS.items():
        if key not in state:
            raise CheckpointError(f"state.json has no {key!r}")
        if isinstance(state[key], bool) or not isinstance(state[key], kind):
            raise CheckpointError(f"state.json's {key!r} is {state[key]!r}")
    for key in ("batch_size", "rows"):  # (absent from checkpoints written before they were)
        value = state.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise CheckpointError(f"state.json's {key!r} is {value!r}")
    for key in ("epoch", "step", "global_step"):
        if state[key] < 0:
            raise CheckpointError(f"state.json's {key!r} is {state[key]}")
    if state["num_batches"] is not None and state["step"] > state["num_batches"]:
        raise CheckpointError(f"state.json's step {state['step']} is past its epoch's "
                              f"{state['num_batches']} steps")
    if "generators" not in state["data"] or not {"python", "numpy"} <= set(state["random"]):
        raise CheckpointError("state.json lacks the data's or the random state")
    built = state.get("optimizer_weights")  # absent from checkpoints written before it was kept
    if built is not None and not (isinstance(built, list) and all(
            places is None or isinstance(places, list) and all(
                isinstance(p, int) and not isinstance(p, bool) for p in places)
            for places in built)):
        raise CheckpointError(f"state.json's 'optimizer_weights' is {built!r}")
    return state


def _batch_size(dataset):
    """The global batch size of the epoch `fit` runs; None where its input has none of its
    own to tell (a generator's, a PyDataset's batches)."""
    size = getattr(dataset, "batch_size", None) if dataset is not None else None
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def _outside_stacklevel():
    """The `stacklevel` of the caller's first frame outside this package and Keras (the
    user's `fit`), for a warning raised in the function that calls this."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in (
            "keras_multigpu", "keras"):
        frame, level = frame.f_back, level + 1
    return level


def _rows(dataset):
    """The rows of the arrays `fit` runs on (after `validation_split`); None where its
    input is not arrays (a generator's, a PyDataset's, tf.data's)."""
    arrays = getattr(dataset, "arrays", None) if dataset is not None else None
    return None if arrays is None else batching._num_rows(arrays[0], "x")  # (SciPy's too)


class CheckpointState:
    """`Checkpoint`'s state: `_state` (to save) and `_restore`."""

    def _state(self, epoch, step, dataset, metrics=None):
        model = self._parallel()
        position = dataset.position() if dataset is not None else None
        now = dataset._generators() if hasattr(dataset, "_generators") else None
        whole = _epoch_batches(dataset)
        if step == 0 or position is None or step == whole:
            # A pass not begun, or an epoch's end: the generators as they are now draw the
            # next pass (not the finished pass's start, which would draw it again).
            generators, order = now, None
        else:
            generators, order = position["generators"], position["order"]
        state = {
            "format": CHECKPOINT_FORMAT,
            "epoch": int(epoch), "step": int(step), "global_step": int(self._global),
            "num_batches": None if whole is None else int(whole),
            "batch_size": _batch_size(dataset),
            "rows": _rows(dataset),
            "backend": keras.backend.backend(),
            "replicas": model.num_replicas,
            "optimizers": _optimizer_names(model.template),
            "optimizer_weights": _optimizer_weights(model.template),
            "data": {"generators": generators, "now": now},
            "random": {**batching.generator_state(random),
                       **batching.generator_state(np.random)},
        }
        arrays = {}
        if order:
            batches = [np.atleast_1d(np.asarray(b, "int64")) for b in order]
            arrays["order"] = np.concatenate(batches)
            arrays["order_lengths"] = np.asarray([len(b) for b in batches], "int64")
        for i, generator in enumerate(_seed_generators(model.template)):
            arrays[f"seed_{i}"] = _numpy(generator.state)
        global_generator = _global_seed_generator()
        # Not one the TensorFlow engine made for its replicas that no step has drawn from
        # (backends/_tf_seeds.py): one device has none.
        if global_generator is not None and not getattr(
                global_generator, "_keras_multigpu_unused", False):
            arrays["seed_global"] = _numpy(global_generator.state)
        for i, value in enumerate(metrics or ()):
            arrays[f"metric_{i}"] = value
        state["arrays"] = sorted(arrays)  # what the reader checks arrays.npz holds
        return state, arrays

    def _restore(self, path, state, arrays):
        model = self._parallel()
        template = model.template
        dataset = model._fit_dataset
        batches = state["num_batches"]
        have = _epoch_batches(dataset)
        # (A checkpoint written before it kept its batch size: the steps alone.)
        size, my_size = state.get("batch_size"), _batch_size(dataset)
        rows, my_rows = state.get("rows"), _rows(dataset)
        if batches != have or any(None not in pair and pair[0] != pair[1]
                                  for pair in ((size, my_size), (rows, my_rows))):
            def said(size, rows):
                return f"batch_size={size}" + ("" if rows is None else f", {rows} rows")

            raise CheckpointError(
                f"Checkpoint {path} was written by a run with {batches} steps per epoch "
                f"({said(size, rows)}); this fit has {have} ({said(my_size, my_rows)}). "
                "Resume with the same data and batch_size, or pass resume=False (or another "
                "directory) to start afresh."
            )
        if state.get("backend", keras.backend.backend()) != keras.backend.backend() and (
                processes.rank() == 0):
            warnings.warn(
                f"Checkpoint {path} was written on Keras's {state['backend']} backend; this "
                f"run is on {keras.backend.backend()}, whose random draws differ (dropout and "
                "noise masks; on TensorFlow, the shuffled arrays' order): the resume is not "
                "exact.", stacklevel=_outside_stacklevel())
        optimizer = getattr(template, "optimizer", None)
        written, mine = state.get("optimizers"), _optimizer_names(template)
        if written is not None and written != mine:
            raise CheckpointError(
                f"Checkpoint {path} was written by a run with the optimizers {written}; this "
                f"model has {mine}. Resume with the same optimizers, or pass "
                "resume=False (or another directory) to start afresh.")
        if optimizer is not None and not optimizer.built:
            optimizer.build(template.trainable_variables)
        # Another optimizer of the model's (a GAN's) is built by its first step, after this:
        # built here on the weights it was built on in the run that wrote the checkpoint.
        _build_optimizers(template, state.get("optimizer_weights"))
        unbuilt = [o.name for o in _optimizers(template) if not o.built]
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.filterwarnings("always", message="Skipping variable loading")
                template.load_weights(os.path.join(path, "model.keras"))
        except (ValueError, OSError) as error:
            # (Keras's message prints each variable it names with its values: left out.)
            said = without_values(str(error))
            raise CheckpointError(
                f"Checkpoint {path} does not fit this model: {said}. Resume with the "
                "program that wrote it, or pass resume=False."
            ) from error
        # Keras loads what fits and warns of the rest ("Skipping variable loading for
        # optimizer 'adam', because it has 10 variables whereas the saved optimizer has 2").
        skipped = [w for w in caught if str(w.message).startswith("Skipping variable loading")]
        for warning in caught:
            if warning not in skipped:
                warnings.warn_explicit(warning.message, warning.category, warning.filename,
                                       warning.lineno)
        if skipped and not unbuilt:
            raise CheckpointError(
                f"Checkpoint {path} does not fit this model: {skipped[0].message} Resume "
                "with the program that wrote it, or pass resume=False.")
        if skipped:
            warnings.warn(
                f"Checkpoint {path}: the state of the optimizer(s) {unbuilt}, which their "
                "first step builds (after a checkpoint loads), is not restored: they start "
                "afresh, and the resume is not exact.", stacklevel=2)
        generators = _seed_generators(template)
        for i, generator in enumerate(generators):
            if f"seed_{i}" in arrays:
                generator.state.assign(arrays[f"seed_{i}"])
        if "seed_global" in arrays:
            keras.random.SeedGenerator  # noqa: B018 (the global one exists once used)
            global_generator = _global_seed_generator()
            if global_generator is None:
                global_generator = seed_generator.global_seed_generator()
            global_generator.state.assign(arrays["seed_global"])
        batching.set_generator_state(random, {"python": state["random"]["python"]})
        batching.set_generator_state(np.random, {"numpy": state["random"]["numpy"]})
        epoch, step = state["epoch"], state["step"]
        if batches is not None and step >= batches:  # an epoch's end: the next afresh
            epoch, step = epoch + 1, 0
        epochs = (self.params or {}).get("epochs")
        if epochs is not None and epoch >= epochs:
            warnings.warn(
                f"Checkpoint {path} has {epoch} epoch(s) done, and this fit asks for "
                f"epochs={epochs}: it trains nothing. Pass a larger epochs to train on, or "
                "resume=False (or another directory) to start afresh.", stacklevel=4)
        order = None
        if "order" in arrays:
            order = np.split(arrays["order"], np.cumsum(arrays["order_lengths"])[:-1])
        if dataset is not None and (step or state["data"]["generators"] is not None):
            if step and not dataset.resumable:
                raise CheckpointError(
                    f"Checkpoint {path} was saved in the middle of an epoch, and this fit's "
                    f"input ({type(dataset).__name__}) cannot start there. Pass the arrays or "
                    "PyDataset the checkpoint was written with."
                )
            dataset.resume({"generators": state["data"]["generators"], "order": order,
                            "now": state["data"].get("now")}, step)
        own = _own_draws(dataset)
        if epoch and own:
            warnings.warn(
                f"Checkpoint: this fit's input is {own}, whose position and random state are "
                f"its own, not in {path}. The resumed epochs ({epoch + 1} on) read it from "
                "its start: where it draws anything anew each pass (a shuffle that "
                "reshuffles each iteration, random augmentation), in another order than an "
                "uninterrupted run's. For an exact resume, pass arrays or a "
                "keras.utils.PyDataset.",
                stacklevel=4)
        self._pending_metrics = {int(k[len("metric_"):]): v for k, v in arrays.items()
                                 if k.startswith("metric_")} or None
        model._replicate_state()
        model._initial_epoch = epoch
        self._resumed_epoch, self._offset = epoch, step
        self._global = state["global_step"]
        self._last_saved = self._global
        self.resumed_from = path
        io_utils.print_msg(
            f"Checkpoint: resuming from {path} at epoch {epoch + 1}, step {step}/{batches}.")

    # -- the callback ----------------------------------------------------
