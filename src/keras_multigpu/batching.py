"""Global batches into batches whose rows divide by the replica count.

`batch_size` is the global batch. A batch whose row count does not divide
by the number of replicas is padded up to the next multiple, so that every
device receives the same number of rows and none is ever empty. The padding
repeats the batch's own rows, cyclically, after the real ones:

>>> idx, real = pad_indices(rows=5, replicas=4)
>>> idx.tolist(), real.tolist()
([0, 1, 2, 3, 4, 0, 1, 2], [True, True, True, True, True, False, False, False])

Replica 0 gets rows [0, 1], replica 1 gets [2, 3], replica 2 gets [4, 0*]
and replica 3 gets [1*, 2*] (* = padding). A padded batch travels *tagged*
with its real row count (`backends.<engine>.tag`), and the engine hands the
model's own step only the real rows (`untag`), so padding never reaches a
loss, a metric or a BatchNormalization moment. Batches of a dataset that
never needs padding travel as Keras would carry them: `(x,)`, `(x, y)` or
`(x, y, sample_weight)`.

The batches, and their order, are Keras's own: a `Feed` is a Keras data
adapter around Keras's adapter for the user's data (for arrays, for their
row indices), and pads what it yields. Nothing here re-draws a shuffle.
"""

import concurrent.futures
import dataclasses
import inspect
import math
import random
import warnings

import keras
import numpy as np
from keras import tree

from keras_multigpu._keras import (
    data_adapter,
    data_adapter_utils,
    data_adapters,
    generator_data_adapter,
    py_dataset_adapter,
)


@dataclasses.dataclass(frozen=True)
class Plan:
    """How `num_samples` rows split into steps of `batch_size` rows.

    >>> p = plan(num_samples=100, batch_size=30, replicas=3)
    >>> [p.rows(i) for i in range(p.num_batches)], p.padded_rows(3)
    ([30, 30, 30, 10], 12)
    """

    num_samples: int
    batch_size: int
    replicas: int
    drop_remainder: bool = False

    @property
    def num_batches(self):
        if self.drop_remainder:
            return self.num_samples // self.batch_size
        return math.ceil(self.num_samples / self.batch_size)

    def rows(self, step):
        """Real rows in batch `step`."""
        return min(self.batch_size, self.num_samples - step * self.batch_size)

    def padded_rows(self, step):
        """Rows batch `step` has after padding to a multiple of the replicas."""
        return padded_size(self.rows(step), self.replicas)

    @property
    def padded(self):
        """Whether any batch of an epoch needs padding."""
        return any(self.rows(i) % self.replicas for i in range(self.num_batches))


def _check_positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int. Received: {name}={value!r}.")
    if value < 1:
        raise ValueError(f"{name} must be >= 1. Received: {name}={value}.")


def plan(num_samples, batch_size, replicas, drop_remainder=False):
    """Returns the `Plan` for one epoch, validating its arguments."""
    _check_positive_int("batch_size", batch_size)
    _check_positive_int("replicas", replicas)
    if num_samples < 1:
        raise ValueError(
            "The input has no samples (0 rows). Pass at least one sample."
        )
    if drop_remainder and num_samples < batch_size:
        raise ValueError(
            f"drop_remainder=True with {num_samples} samples and "
            f"batch_size={batch_size} leaves no batch at all. Pass a smaller "
            "batch_size or drop_remainder=False."
        )
    return Plan(int(num_samples), int(batch_size), int(replicas), drop_remainder)


def padded_size(rows, replicas):
    return -(-rows // replicas) * replicas


def pad_indices(rows, replicas):
    """Row indices of the padded batch, and which of its rows are real."""
    size = padded_size(rows, replicas)
    positions = np.arange(size)
    return positions % rows, positions < rows


def _num_rows(structure, what):
    lengths = {int(np.shape(leaf)[0]) for leaf in tree.flatten(structure) if leaf is not None}
    if not lengths:
        raise ValueError(f"{what} holds no arrays. Received: {what}={structure!r}.")
    if len(lengths) > 1:
        raise ValueError(
            f"All arrays in {what} must have the same number of rows. "
            f"Received row counts {sorted(lengths)}."
        )
    return lengths.pop()


def _take(structure, index):
    if structure is None:
        return None
    return tree.map_structure(lambda a: None if a is None else a[index], structure)


def _parts(x, y, sample_weight):
    """Keras's batch structure: `(x,)`, `(x, y)` or `(x, y, sample_weight)`."""
    if sample_weight is not None:
        return (x, y, sample_weight)
    if y is not None:
        return (x, y)
    return (x,)


def _numeric(dtype):
    """`(name, whether a model can take it)` for any framework's dtype."""
    try:
        name = keras.backend.standardize_dtype(dtype)
    except (ValueError, TypeError):
        return getattr(dtype, "name", str(dtype)), False
    return name, name == "bool" or name.startswith(("float", "int", "uint", "bfloat", "complex"))


def check_dtypes(structure, what):
    """Refuses arrays no model can take (strings, objects), as Keras does, but early."""
    for leaf in tree.flatten(structure):
        dtype = getattr(leaf, "dtype", None)
        if dtype is None:
            continue
        name, numeric = _numeric(dtype)
        if not numeric:
            raise ValueError(
                f"Invalid dtype: {name} in {what} (an array of shape {tuple(np.shape(leaf))}). "
                "A model takes numbers: turn text into numbers first (e.g. "
                "keras.layers.StringLookup or TextVectorization, applied to the data), and "
                "object arrays into numeric ones (np.asarray(a, 'float32'))."
            )


def check_class_weight(class_weight, y=None):
    """`class_weight` must map class indices to weights.

    With `y`, keys that name no class in it are warned about.
    """
    if class_weight is None:
        return
    if not isinstance(class_weight, dict):
        raise TypeError(
            "class_weight must be a dict mapping class indices to weights, e.g. "
            f"{{0: 1.0, 1: 5.0}}. Received: class_weight of type {type(class_weight).__name__}: "
            f"{class_weight!r}."
        )
    for key, value in class_weight.items():
        if isinstance(key, bool) or not isinstance(key, (int, np.integer)):
            raise TypeError(
                "class_weight's keys must be class indices (ints). Received: key "
                f"{key!r} of type {type(key).__name__}."
            )
        if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
            raise TypeError(
                f"class_weight's values must be numbers. Received: {key}: {value!r}."
            )
    if y is None or len(tree.flatten(y)) != 1:
        return
    labels = np.asarray(tree.flatten(y)[0])
    if labels.ndim > 1 and labels.shape[-1] > 1:
        classes = set(range(labels.shape[-1]))
    else:
        classes = {int(c) for c in np.unique(labels.astype("int64"))}
    unknown = sorted(int(k) for k in class_weight if int(k) not in classes)
    if unknown:
        warnings.warn(
            f"class_weight has key(s) {unknown} that name no class in y (its classes: "
            f"{sorted(classes)[:20]}{' ...' if len(classes) > 20 else ''}); they weigh nothing. "
            "Check the keys against your labels.",
            stacklevel=4,
        )


def class_sample_weights(y, class_weight, sample_weight=None):
    """Per-sample weights from `class_weight` (Keras's own conversion)."""
    check_class_weight(class_weight)
    if sample_weight is not None:
        raise ValueError(
            "Pass either class_weight or sample_weight, not both. "
            f"Received: class_weight={class_weight!r} and sample weights."
        )
    if y is None:
        raise ValueError(
            "class_weight needs targets, and this input has none (y=None). "
            "Pass y, or drop class_weight."
        )
    if len(tree.flatten(y)) != 1:
        raise ValueError(
            "class_weight works with a single target array; this model "
            "has several outputs. Pass per-output sample_weight instead."
        )
    return data_adapter_utils.class_weight_to_sample_weights(
        np.asarray(tree.flatten(y)[0]), class_weight
    )


def pad_batch(batch, replicas, tag, class_weight=None, always=True):
    """Pads one `(x,)`, `(x, y)` or `(x, y, sample_weight)` batch.

    Args:
        batch: the batch, as a user's dataset yields it.
        replicas: the device count.
        tag: the engine's `tag(batch, rows, replicas)` (see `backends`).
        class_weight: Keras's `class_weight`, turned into sample weights.
        always: tag the batch even when it needs no padding. A dataset
            whose batches may differ must tag them all, because Keras fixes
            the data layout from an epoch's first batch.

    Returns:
        `(data, rows)`: what to hand to Keras, and the real row count.
    """
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
    rows = _num_rows(x, "x")
    check_dtypes((x, y, sample_weight), "a batch")
    if rows == 0:
        raise ValueError("A batch has 0 rows. Every batch needs at least one sample.")
    if class_weight is not None:
        sample_weight = class_sample_weights(y, class_weight, sample_weight)
    parts = tuple(
        None if part is None else tree.map_structure(np.asarray, part)
        for part in _parts(x, y, sample_weight)
    )
    if rows % replicas == 0 and not always:
        return parts, rows
    index, _ = pad_indices(rows, replicas)
    return tag(tuple(_take(part, index) for part in parts), rows, replicas), rows


def generator_state(rng):
    """A generator's state as plain data (NumPy's RandomState, Python's Random)."""
    if hasattr(rng, "get_state"):  # a RandomState, or NumPy's global one (np.random)
        kind, keys, pos, has_gauss, gauss = rng.get_state()
        return {"numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)]}
    return {"python": _listed(rng.getstate())}


def _listed(value):
    return [_listed(v) for v in value] if isinstance(value, (tuple, list)) else value


def _tupled(value):
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value


def set_generator_state(rng, state):
    if "numpy" in state:
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        rng.set_state((kind, np.asarray(keys, "uint32"), pos, has_gauss, gauss))
    else:
        rng.setstate(_tupled(state["python"]))


def global_generators(engine_state=None):
    """Python's and NumPy's global generators (Keras's adapters draw orders from them),
    and the engine's (`engine_state()`, torch's), as plain data."""
    state = {**generator_state(random), **generator_state(np.random)}
    if engine_state is not None:
        state["engine"] = engine_state()
    return state


def set_global_generators(state, set_engine_state=None):
    if state.get("python") is not None:
        set_generator_state(random, {"python": state["python"]})
    if state.get("numpy") is not None:
        set_generator_state(np.random, {"numpy": state["numpy"]})
    if state.get("engine") is not None and set_engine_state is not None:
        set_engine_state(state["engine"])


def _is_array_like(x):
    return all(
        hasattr(leaf, "shape") and hasattr(leaf, "__array__")
        for leaf in tree.flatten(x) if leaf is not None
    ) and any(leaf is not None for leaf in tree.flatten(x))


def _to_numpy(batch):
    """A batch from one of Keras's adapters (NumPy, TensorFlow or torch tensors) in NumPy."""
    def convert(leaf):
        if leaf is None or isinstance(leaf, np.ndarray):
            return leaf
        if hasattr(leaf, "detach"):  # torch
            leaf = leaf.detach().cpu()
        return np.asarray(leaf)

    return tree.map_structure(convert, batch, none_is_leaf=False)


class Feed(data_adapter.DataAdapter):
    """Keras's own data adapter for the user's data (`inner`), its batches padded.

    Keras's epoch iterator drives this adapter as it would drive `inner`, and
    every call reaches `inner` when Keras would make it: `inner`'s iterators are
    made when Keras makes this adapter's, `on_epoch_begin`/`on_epoch_end` pass
    through. So the order of the batches, and each random draw Keras's adapters
    make for it (NumPy's or Python's generators, a `DataLoader`'s seeds, a
    tf.data reshuffle, per-epoch seeds on newer Keras), is Keras's own, on
    whichever Keras is installed. Each batch `inner` yields then goes through
    `serve`, which pads it for the replicas and tags it (see `pad_batch`).

    Array inputs go through Keras's array adapter as their row indices
    (`np.arange(n)`, batched and shuffled by Keras): `serve` then gathers those
    rows, on the devices (`take`) or from the host (`put` places them, while a
    thread prepares the next batch).

    A checkpoint (`callbacks.Checkpoint`) keeps where an epoch is: the global
    generators as its pass began (`position`), the batches served, and the
    epoch ends `inner` has seen; `resume` makes the next pass draw the same
    order again and serve only its batches from `skip` on.

    Args:
        inner: Keras's adapter for the data (`data_adapters.get_data_adapter`).
        serve: a host batch from `inner` (NumPy) -> the batch handed to Keras.
        replicas: the device count.
        num_batches: batches per epoch (None: `inner`'s).
        arrays: `(x, y, sample_weight)` when `inner` yields their row indices.
        resident: `serve` gathers them on the devices.
        prefetch: `serve` may prepare the next batch in a thread (its input
            is pulled from `inner` beside the current one: only where that
            draws nothing).
        engine_state, set_engine_state: the engine's global generator (torch's).
        to_backend: turns a served batch into the tensors the backend's
            trainer takes from a `DataLoader` (torch).
    """

    def __init__(self, inner, serve, *, replicas, num_batches=None, arrays=None, resident=False,
                 prefetch=False, engine_state=None, set_engine_state=None, to_backend=None):
        self.inner = inner
        self.serve = serve
        self.replicas = replicas
        self.arrays = arrays
        # Arrays gathered on the devices: serving a batch is device work, not the host's
        # (DeviceMonitor times `pad`, the host's part).
        self.resident = resident
        self._num_batches = num_batches
        self._prefetch = prefetch
        self._engine_state, self._set_engine_state = engine_state, set_engine_state
        self._to_backend = to_backend
        self._executor = None
        self.skip = 0  # a resumed epoch: its first `skip` batches are not served
        self.ends = 0  # `on_epoch_end` calls `inner` has had
        self._pass_state = None  # the global generators as the current epoch began
        self._served = []  # the current pass's batches as read (array inputs: row indices)
        self._resume = None  # what the next epoch's pass restores (see `resume`)
        self._restore_now = None  # the generators to set once a resumed pass has drawn
        self._not_an_end = False  # the next on_epoch_end is a new Keras call's start
        self._signature = None
        self._inner_tf = None

    # -- Keras's DataAdapter ------------------------------------------------

    @property
    def num_batches(self):
        total = self._num_batches if self._num_batches is not None else self.inner.num_batches
        return None if total is None else total - self.skip

    @property
    def batch_size(self):
        return self.inner.batch_size

    @property
    def has_partial_batch(self):
        return self.inner.has_partial_batch

    @property
    def partial_batch_size(self):
        return self.inner.partial_batch_size

    def on_epoch_begin(self):
        self._not_an_end = False  # (only an end before the next epoch begins is skipped)
        resume, self._resume = self._resume, None
        if resume is not None:
            # The resumed epoch draws its order from the generators as they were when it
            # began (and from `inner` at the same epoch count: newer Keras seeds by it);
            # once its skipped batches are drawn, they are set as at the checkpoint.
            self._replay_ends(resume.get("ends"))
            set_global_generators(resume["generators"], self._set_engine_state)
            self._restore_now = resume.get("now")
        self._pass_state = global_generators(self._engine_state)
        self._pass_state["ends"] = self.ends
        self._served = []
        self.inner.on_epoch_begin()

    def on_epoch_end(self):
        if self._not_an_end:
            self._not_an_end = False
            return
        self.ends += 1
        self.inner.on_epoch_end()

    def continue_epochs(self):
        """After a resumed epoch's Keras call, the next call trains the epochs after it.

        Its batches are whole again, and the `on_epoch_end` Keras's new epoch iterator
        calls as it starts is not passed on: in one uninterrupted call, one epoch end
        separates two epochs (Keras's adapters count them: newer Keras seeds its orders by
        that count)."""
        self.skip = 0
        self._not_an_end = True

    def get_numpy_iterator(self):
        return self._pass(self.inner.get_numpy_iterator)

    def get_jax_iterator(self):
        # NumPy from `inner` (its draws are those of its JAX iterator): the batch is padded,
        # and placed (`serve`), on the host.
        return self._pass(self.inner.get_numpy_iterator)

    def get_torch_dataloader(self):
        loader = self.inner.get_torch_dataloader()  # made when Keras would make it
        return _Passes(self, loader)

    def get_tf_dataset(self):
        import tensorflow as tf

        if self._inner_tf is None:
            # Made once, as in one Keras call: a resumed fit makes one call for the rest of
            # its epoch and another for the epochs after it (newer Keras seeds the array
            # order by the epoch count when the pipeline is made).
            self._inner_tf = self.inner.get_tf_dataset()
        dataset = self._inner_tf
        if self.skip:
            dataset = dataset.skip(self.skip)
        spec = dataset.element_spec
        if self._signature is None:
            self._signature = self._output_signature(spec)
        out_spec = self._signature
        flat_out = tree.flatten(out_spec)

        def serve(*flat):
            batch = tree.pack_sequence_as(spec, [np.asarray(a) for a in flat])
            if self._restore_now is not None:  # the resumed pass has drawn its order
                set_global_generators(self._restore_now, self._set_engine_state)
                self._restore_now = None
            self._served.append(np.asarray(tree.flatten(batch)[0]) if self.arrays else None)
            out = tree.flatten(self.pad(batch))  # on tf.data's threads
            return [np.asarray(leaf, s.dtype.as_numpy_dtype) for leaf, s in zip(out, flat_out)]

        def mapped(*flat):
            out = tf.numpy_function(serve, list(flat), [s.dtype for s in flat_out],
                                    stateful=True)
            for tensor, s in zip(out, flat_out):
                tensor.set_shape(s.shape)
            return tree.pack_sequence_as(out_spec, out)

        return dataset.map(mapped)

    # -- the passes -----------------------------------------------------------

    def next_from(self, iterator):
        """The next batch of `inner`'s (one place for the fetch, which DeviceMonitor times)."""
        return next(iterator)

    def pad(self, batch):
        return self.serve(batch)

    def host_parts(self, future):
        """Waits for a batch prepared in the background (the wait DeviceMonitor times)."""
        return future.result()

    def _pass(self, make):
        """One pass: `inner`'s batches from `make()`, served (a generator: nothing is made
        until Keras asks for the first batch, as with `inner`'s own)."""
        iterator = iter(make())
        return self._served_from(iterator)

    def _served_from(self, iterator):
        total = self.num_batches
        count = 0
        for _ in range(self.skip):  # a resumed epoch: the batches done are drawn, not served
            self._served.append(self._read(self.next_from(iterator)))
        if self._restore_now is not None:
            set_global_generators(self._restore_now, self._set_engine_state)
            self._restore_now = None
        self._check_order()
        pending = None
        while total is None or count < total:
            if pending is not None:
                read, future = pending
                pending = None
                batch = self.host_parts(future)
            else:
                try:
                    read = self._read(self.next_from(iterator))
                except StopIteration:
                    return
                batch = self.serve(read) if self.resident else self.pad(read)
            self._served.append(read if self.arrays is not None else None)
            count += 1
            if self._prefetch and (total is None or count < total):
                try:
                    following = self._read(self.next_from(iterator))
                except StopIteration:
                    following = None
                if following is not None:
                    pending = (following, self._background(following))
            yield batch

    def _read(self, batch):
        batch = _to_numpy(batch)
        if self.arrays is not None:  # Keras's array adapter yields `(indices,)`
            return np.asarray(tree.flatten(batch)[0]).astype("int64")
        return batch

    def _background(self, read):
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="keras_multigpu-prefetch")
        return self._executor.submit(self.serve, read)

    def _check_order(self):
        """A resumed pass must draw the checkpoint's order again (arrays: the rows)."""
        expected, self._expected = getattr(self, "_expected", None), None
        if expected is None or self.arrays is None:
            return
        drawn = self._served[:len(expected)]
        if not all(np.array_equal(a, b) for a, b in zip(drawn, expected)):
            warnings.warn(
                "The resumed epoch's data order differs from the checkpoint's: the "
                "generators it was drawn from could not be restored (set a seed, e.g. "
                "keras.utils.set_random_seed, before building the model). Its remaining "
                "batches come in this run's order.",
                stacklevel=4,
            )

    def _replay_ends(self, ends):
        while ends is not None and self.ends < ends:
            self.on_epoch_end()

    def _output_signature(self, spec):
        """The TF signature of served batches: `serve` on two made-up batches (1 and 2
        rows) of `inner`'s spec, which draws nothing and reads no data."""
        def made_up(rows):
            def leaf(s):
                shape = [rows if d is None else d for d in s.shape.as_list()]
                shape[0] = rows
                if self.arrays is not None:
                    return np.zeros(shape, s.dtype.as_numpy_dtype)
                return np.ones(shape, s.dtype.as_numpy_dtype)
            return tree.map_structure(leaf, spec)

        served = [tree.map_structure(np.asarray, self.serve(made_up(rows)))
                  for rows in (1, self.replicas + 1)]  # padded sizes that differ
        return data_adapter_utils.get_tensor_spec(served)

    # -- exact resume (see `keras_multigpu.callbacks.Checkpoint`) ----------------

    @property
    def resumable(self):
        """Whether an epoch can resume in its middle: its batches are drawn again in the
        same order (arrays, and a PyDataset of known length)."""
        if self.arrays is not None:
            return True
        return isinstance(self.inner, py_dataset_adapter.PyDatasetAdapter) and (
            self.inner.py_dataset.num_batches is not None)

    def position(self):
        """Where the current epoch is: the generators as it began, and (arrays) the rows of
        each batch read."""
        if self._pass_state is None:
            return None
        order = [b for b in self._served if b is not None] if self.arrays is not None else None
        return {"generators": self._pass_state, "order": order}

    def _generators(self):
        """The generators as they are now (what the next pass draws from), and the epoch
        ends `inner` has seen."""
        state = global_generators(self._engine_state)
        state["ends"] = self.ends
        return state

    def resume(self, state, skip):
        """Makes the next epoch's pass resume from `state` (`position()` and `_generators()`
        of a checkpoint): drawn from the same generators, serving batches from `skip` on."""
        self.skip = int(skip)
        if skip and not self.resumable:
            raise ValueError(
                f"This input ({type(self.inner).__name__}) cannot resume in the middle of an "
                "epoch (its batches are not drawn again in the same order). Checkpoint at "
                "epoch ends only (Checkpoint(save_freq='epoch')), or pass arrays or a "
                "keras.utils.PyDataset.")
        self._expected = state.get("order")
        if skip:
            self._resume = {"generators": state["generators"], "now": state.get("now"),
                            "ends": (state["generators"] or {}).get("ends")}
        else:  # an epoch's end: the next pass draws from the generators as they were
            self._replay_ends((state.get("now") or {}).get("ends"))
            if state.get("now") is not None:
                set_global_generators(state["now"], self._set_engine_state)

    def close(self):
        """Ends the prefetch thread, if any (a later pass starts it again)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None


class _Passes:
    """What a `Feed` hands Keras's torch trainer for a `DataLoader`: each iteration starts
    `inner`'s loader's own iteration at once (its seeds are drawn when Keras would draw
    them) and serves its batches as torch tensors."""

    def __init__(self, feed, loader):
        self.feed, self.loader = feed, loader

    def __iter__(self):
        iterator = iter(self.loader)
        convert = self.feed._to_backend or (lambda batch: batch)
        return (convert(batch) for batch in self.feed._served_from(iterator))

    def __len__(self):
        return len(self.loader)


def _array_server(x, y, sample_weight, plan, tag, take=None, put=None):
    """`serve` for array inputs: a batch of row indices -> those rows, padded and tagged."""

    def serve(rows):
        padding, _ = pad_indices(len(rows), plan.replicas)
        index = rows[padding]
        if take is not None:
            # One gather per array on the devices: the batch's rows and its padding together.
            px, py = take(index.astype("int32"))
            parts = _parts(px, py, _take(sample_weight, index))
        else:
            parts = _parts(_take(x, index), _take(y, index), _take(sample_weight, index))
            if put is not None:
                parts = put(parts)
        if not plan.padded:
            return parts
        return tag(parts, len(rows), plan.replicas)

    return serve


def as_padded(x, y=None, sample_weight=None, *, batch_size=None, replicas, tag,
              shuffle=False, class_weight=None, drop_remainder=False, place=None,
              put=None, steps_per_epoch=None, engine_state=None, set_engine_state=None,
              to_backend=None):
    """Turns what `Model.fit` accepts into a `Feed` of padded batches, in Keras's order.

    Args:
        tag: the engine's `tag(batch, rows, replicas)` (see `backends`).
        shuffle: Keras's `shuffle`, passed on to Keras's adapter.
        place: for array inputs, a function that puts `(x, y)` on the devices
            and returns `take(index)`, or None to keep them on the host.
        put: for array inputs kept on the host, a function that places one
            batch on the devices (batches are then prefetched).
        engine_state, set_engine_state, to_backend: see `Feed`.

    Returns:
        `(data, feed)`: what to hand to Keras, and the `Feed` (the same object).
    """
    if isinstance(x, Feed):
        return x, x
    if x is None:
        raise ValueError("No input data. Received: x=None.")
    if isinstance(x, (str, bytes)):
        raise TypeError(
            "x must be arrays, a keras.utils.PyDataset, a generator or a dataset. "
            f"Received: x of type {type(x).__name__}."
        )
    check_class_weight(class_weight, y if _is_array_like(x) else None)
    if shuffle not in (True, False, "batch"):
        raise ValueError(
            f"shuffle must be True, False or 'batch', as in Keras. Received: shuffle={shuffle!r}."
        )
    options = {"engine_state": engine_state, "set_engine_state": set_engine_state,
               "to_backend": to_backend}
    if not _is_array_like(x):
        if isinstance(x, (dict, list, tuple)):
            raise TypeError(
                "x must be arrays (NumPy, JAX, TensorFlow or PyTorch tensors, or a "
                "dict/list of them), a keras.utils.PyDataset, a generator, or a "
                f"dataset of known length. Received: x of type {type(x).__name__}."
            )
        for name, value in (("y", y), ("sample_weight", sample_weight)):
            if value is not None:
                raise ValueError(
                    f"When x is a {type(x).__name__}, it must yield the targets "
                    f"and sample weights itself; {name} must be None. "
                    f"Received: {name} of type {type(value).__name__}."
                )
        if drop_remainder:
            raise ValueError(
                "drop_remainder=True applies to array inputs. A "
                f"{type(x).__name__} decides its own batches: make it yield "
                "full batches only."
            )
        try:
            inner = data_adapters.get_data_adapter(
                _checked_generator(x), batch_size=batch_size, steps_per_epoch=steps_per_epoch,
                shuffle=shuffle, class_weight=class_weight)
        except ValueError as error:
            if "Unrecognized data type" not in str(error):
                raise
            inner = None
        if inner is None and hasattr(x, "__iter__") and hasattr(x, "__len__"):
            if class_weight is not None:
                raise ValueError(
                    f"class_weight applies to array inputs; a {type(x).__name__} must yield "
                    "sample weights itself. Received: class_weight with an iterable x."
                )
            inner = _Iterable(x)
        if inner is None:
            raise TypeError(
                "x must be arrays (NumPy, JAX, TensorFlow or PyTorch tensors, or a "
                "dict/list of them), a keras.utils.PyDataset, a generator, or a "
                f"dataset of known length. Received: x of type {type(x).__name__}."
            ) from None
        feed = Feed(inner, lambda batch: _stream_server(batch, replicas, tag),
                    replicas=replicas, **options)
        return feed, feed
    rows = _num_rows(x, "x")
    check_dtypes(x, "x")
    check_dtypes(y, "y")
    check_dtypes(sample_weight, "sample_weight")
    for name, value in (("y", y), ("sample_weight", sample_weight)):
        if value is not None and _num_rows(value, name) != rows:
            raise ValueError(
                f"x has {rows} rows but {name} has {_num_rows(value, name)}. "
                f"Pass the same number of samples in x and {name}."
            )
    if sample_weight is not None and y is not None and not tree.is_nested(sample_weight) \
            and not tree.is_nested(y):
        weights, targets = np.shape(sample_weight), np.shape(y)
        if len(weights) > len(targets) or targets[: len(weights)] != weights:
            raise ValueError(
                f"sample_weight has shape {weights}, which does not match y's {targets}: pass "
                f"one weight per sample, shape ({rows},), or per time step, a prefix of y's "
                "shape."
            )
    if batch_size is None:
        batch_size = 32
    batches = plan(rows, batch_size, replicas, drop_remainder)
    x, y, sample_weight = (
        None if part is None else tree.map_structure(np.asarray, part)
        for part in (x, y, sample_weight)
    )
    if class_weight is not None:
        # Once for the whole set, rather than per batch.
        sample_weight = class_sample_weights(y, class_weight, sample_weight)
    take = place((x, y)) if place is not None else None
    put = put if take is None else None
    # The rows' order is Keras's own: its array adapter batches and shuffles their indices.
    inner = data_adapters.get_data_adapter(
        np.arange(rows, dtype="int64"), batch_size=batch_size,
        steps_per_epoch=steps_per_epoch, shuffle=shuffle)
    serve = _array_server(x, y, sample_weight, batches, tag, take=take, put=put)
    # A prefetch reads the next batch's rows early: not with shuffle="batch", whose draws
    # are made as each batch is read.
    feed = Feed(inner, serve, replicas=replicas, num_batches=batches.num_batches,
                arrays=(x, y, sample_weight), resident=take is not None,
                prefetch=put is not None and shuffle != "batch", **options)
    return feed, feed


def _first_batch_checked(first):
    """Keras's generator rule (yield tuples), said with the batch's shape rather than its values."""
    if first is None:
        raise ValueError("The data yielded no batch. Received: an empty iterator.")
    if not isinstance(first, tuple):
        shapes = tree.map_structure(lambda leaf: tuple(np.shape(leaf)), first)
        raise ValueError(
            "When passing a Python generator to a Keras model, the generator must return a "
            "tuple, either (input,) or (inputs, targets) or (inputs, targets, sample_weights). "
            f"Received: {type(first).__name__} of shape {shapes}. Yield (x, y), or (x,) for "
            "inputs alone."
        )


def _checked_generator(x):
    """A Python generator, with its first batch checked before Keras reads it."""
    if not inspect.isgenerator(x):
        return x
    first = next(x, None)
    _first_batch_checked(first)

    def restored():
        yield first
        yield from x

    return restored()


class _Iterable(generator_data_adapter.GeneratorDataAdapter):
    """A re-iterable of batches (`__iter__` and `__len__`, read afresh each epoch).

    Keras takes generators, which last one epoch; an object that makes a new iterator
    each epoch, as tf.data and DataLoaders do, is read as Keras reads a generator, once
    per epoch, for `len(iterable)` steps.
    """

    def __init__(self, iterable):
        _first_batch_checked(next(iter(iterable), None))
        super().__init__(iter(iterable))
        self.generator = lambda: iter(iterable)
        self._length = len(iterable)

    @property
    def num_batches(self):
        return self._length


def _stream_server(batch, replicas, tag):
    """`serve` for a stream (PyDataset, generator, tf.data, DataLoader): every batch is
    tagged, since Keras fixes the data layout from an epoch's first batch."""
    if not isinstance(batch, (tuple, list)) or not 1 <= len(batch) <= 3:
        if isinstance(batch, dict) or hasattr(batch, "shape"):
            batch = (batch,)
        else:
            raise ValueError(
                "A batch of the input must be a tuple, either (inputs,) or (inputs, targets) "
                "or (inputs, targets, sample_weights). Received: "
                f"{type(batch).__name__}. Yield (x, y) batches, or (x,) for inputs alone.")
    return pad_batch(tuple(batch), replicas, tag)[0]
