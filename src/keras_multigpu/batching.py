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

Shuffling follows Keras's own data adapters draw for draw (`np.random`
permutations for arrays, `random.shuffle` of the batch order for a
`PyDataset`), but from a private generator that `ParallelModel.fit` seeds
with the global generator's state when the call starts (see `RandomState`).
"""

import concurrent.futures
import dataclasses
import math
import random
import threading
import types
import warnings

import keras
import numpy as np
from keras import tree
from keras.src.trainers.data_adapters import data_adapter_utils


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


def numpy_order(num_samples, batch_size, shuffle, rng):
    """The row order of Keras's NumPy and JAX array iterators.

    Returns `new_pass()`, an iterator over one pass's batches of row indices,
    drawing from `rng` when and as Keras does: the whole permutation as the
    pass starts (`shuffle=True`), or each batch's as it is read (`"batch"`).
    """

    def new_pass():
        permutation = rng.permutation(num_samples) if shuffle is True else None
        for start in range(0, num_samples, batch_size):
            stop = min(start + batch_size, num_samples)
            if shuffle == "batch":
                yield start + rng.permutation(stop - start)
            elif permutation is not None:
                yield permutation[start:stop]
            else:
                yield np.arange(start, stop)

    return new_pass


class RandomState:
    """The random draws of one `fit`, as Keras would make them.

    Keras shuffles arrays with `np.random` and a `PyDataset`'s batch order
    with Python's `random`, drawing from the global generators as it goes.
    Here the draws come from private copies, taken when `fit` starts: the
    order of every epoch is fixed by the state at that moment (under
    `keras.utils.set_random_seed(s)`, by `s` and the program before `fit`)
    and cannot be changed by anything drawing from the global generators
    during training. `commit()` then moves the global generators on by
    exactly the draws made, so code after `fit` sees the state it would have
    seen after Keras's own `fit`.
    """

    def __init__(self):
        self.numpy = np.random.RandomState()
        self.numpy.set_state(np.random.get_state())
        self.python = random.Random()
        self.python.setstate(random.getstate())

    def commit(self):
        np.random.set_state(self.numpy.get_state())
        random.setstate(self.python.getstate())


class PaddedBatches(keras.utils.PyDataset):
    """Base of the padded datasets."""

    def __init__(self, replicas, tag, class_weight=None, **kwargs):
        super().__init__(**kwargs)
        self.replicas = replicas
        self.tag = tag
        self.class_weight = class_weight

    def pad(self, batch):
        return pad_batch(batch, self.replicas, self.tag, self.class_weight)[0]

    def next_from(self, iterator):
        """The user's next batch from a generator or an iterable's iterator.

        One place for the fetch, so that DeviceMonitor can time the wait for it.
        """
        return next(iterator)

    # -- exact resume (see `keras_multigpu.callbacks.Checkpoint`) -----------
    #
    # A dataset that can resume mid-epoch records, as each pass starts, the
    # state of every generator its order draws from (`pass_state`) and the
    # pass's order as read (`order`). `resume(state, skip)` puts those
    # generators back, so that the next pass draws the same order again, and
    # makes every pass serve only its batches from `skip` on (`num_batches`
    # less `skip`), until `skip` is set back to 0: `ParallelModel.fit` runs
    # the rest of the interrupted epoch as a Keras call of its own.

    resumable = False
    skip = 0

    def position(self):
        """What `resume` needs: None where this input cannot resume mid-epoch."""
        return None

    def resume(self, state, skip):
        raise ValueError(
            f"A {type(self).__name__} cannot resume in the middle of an epoch (its batches "
            "are not indexed). Checkpoint at epoch ends only (Checkpoint(save_freq='epoch')), "
            "or pass arrays or a keras.utils.PyDataset."
        )


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


class ArrayBatches(PaddedBatches):
    """Arrays (or dicts/lists of arrays) batched by a `Plan`, shuffled as Keras does.

    Args:
        shuffle: False, True (a new permutation of every row at the start of
            each pass) or `"batch"` (rows shuffled within each batch, the
            batches in order), Keras's `fit(shuffle=...)`.
        rng: the `np.random.RandomState` to draw from (default: NumPy's
            global generator, as Keras's own adapter uses on JAX).
        order: `new_pass()` from the engine's `array_order` (see
            `backends`), where its Keras trainer does not shuffle with NumPy.
        place: a function that puts `(x, y)` on the devices and returns
            `take(index)` (see `backends`), so that each batch is gathered on
            the devices instead of sliced on the host; it may return None to
            decline.
        put: for data left on the host, a function that places one batch on
            the devices, split (`backends.<engine>.shard`). The next batch
            is then sliced and placed in a background thread while Keras runs
            the current step (not with `shuffle="batch"`, whose draws must
            stay in Keras's order).
    """

    def __init__(self, x, y, sample_weight, plan, tag, shuffle=False, class_weight=None,
                 place=None, rng=None, put=None, order=None):
        super().__init__(plan.replicas, tag)
        x, y, sample_weight = (
            None if part is None else tree.map_structure(np.asarray, part)
            for part in (x, y, sample_weight)
        )
        if class_weight is not None:
            # Once for the whole set, rather than per batch.
            sample_weight = class_sample_weights(y, class_weight, sample_weight)
        self.x, self.y, self.sample_weight = x, y, sample_weight
        self.plan = plan
        self.shuffle = shuffle
        self.rng = np.random if rng is None else rng
        self.take = place((x, y)) if place is not None else None
        self.put = put if self.take is None else None
        self.passes = order or numpy_order(plan.num_samples, plan.batch_size, shuffle, self.rng)
        self._batches = None  # the current pass: an iterator of row indices, and those read
        self._pass = 0  # counts passes (batch 0 reads), so a prefetch knows its own
        self._pending = None  # (pass, index, future) of the batch being prefetched
        self._executor = None
        self._pass_state = None  # the generators' state as the current pass started

    resumable = True

    @property
    def num_batches(self):
        return self.plan.num_batches - self.skip

    def _generators(self):
        """States of the generators a pass draws from: this dataset's, and the engine's."""
        state = generator_state(self.rng) if hasattr(self.rng, "get_state") else {}
        get_state = getattr(self.passes, "get_state", None)
        if get_state is not None:
            state["engine"] = get_state()
        return state

    def _set_generators(self, state):
        if state.get("numpy") is not None and hasattr(self.rng, "set_state"):
            set_generator_state(self.rng, state)
        if state.get("engine") is not None and hasattr(self.passes, "set_state"):
            self.passes.set_state(state["engine"])

    def position(self):
        if self._batches is None:
            return None
        return {"generators": self._pass_state, "order": [np.asarray(b) for b in
                                                          self._batches[1]]}

    def resume(self, state, skip):
        self.skip = int(skip)
        self._expected = state.get("order")
        self._batches = None
        if self.skip:
            # Restored as the pass starts, where they were captured: anything the
            # trainer draws before (torch's DataLoader does) is then drawn alike.
            # Once the pass is drawn, the engine's generator is set as it was at
            # the checkpoint: the steps done had drawn from it too (torch's
            # unseeded Dropout does).
            self._resume_generators = state["generators"]
            self._resume_now = state.get("now")
        elif state.get("generators") is not None:
            self._set_generators(state["generators"])

    def _rows(self, index, new_pass=False):
        """The row indices of batch `index` of the current pass (with `new_pass`, of a new one)."""
        if new_pass or self._batches is None:
            if getattr(self, "_resume_generators", None) is not None:
                self._set_generators(self._resume_generators)
                self._resume_generators = None
            self._pass_state = self._generators()
            self._batches = (self.passes(), [])
        batches, read = self._batches
        while len(read) <= index:
            read.append(next(batches))
        now = getattr(self, "_resume_now", None)
        if now is not None:
            self._resume_now = None
            if now.get("engine") is not None and hasattr(self.passes, "set_state"):
                self.passes.set_state(now["engine"])
        return read[index]

    def _host_batch(self, rows):
        """Slices (and, with `put`, places) one padded batch from the host arrays."""
        padding, _ = pad_indices(len(rows), self.replicas)
        index_rows = rows[padding]
        parts = _parts(_take(self.x, index_rows), _take(self.y, index_rows),
                       _take(self.sample_weight, index_rows))
        return parts if self.put is None else self.put(parts)

    def _prefetch(self, index):
        if self.put is None or self.shuffle == "batch" or index >= self.plan.num_batches:
            return
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="keras_multigpu-prefetch"
            )
        future = self._executor.submit(self._host_batch, self._rows(index))
        self._pending = (self._pass, index, future)

    def close(self):
        """Ends the prefetch thread, if any (a later read starts it again)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor, self._pending = None, None

    def _resumed_rows(self, index):
        """Batch `index` of a resumed pass: the pass is drawn again, its first `skip` not served."""
        new_pass = index == 0
        index += self.skip
        rows = self._rows(index, new_pass=new_pass)
        expected = getattr(self, "_expected", None)
        if new_pass and expected:
            self._expected = None
            batches, read = self._batches
            if not all(np.array_equal(a, b) for a, b in zip(read, expected)):
                warnings.warn(
                    "The resumed epoch's data order differs from the checkpoint's: the "
                    "generators it was drawn from could not be restored (set a seed, e.g. "
                    "keras.utils.set_random_seed, before building the model). The epoch "
                    "goes on in the checkpoint's order, as far as it was read.",
                    stacklevel=3,
                )
                read[:len(expected)] = [np.asarray(b) for b in expected]
                rows = self._rows(index)
        return index, rows

    def __getitem__(self, index):
        if not 0 <= index < self.num_batches:
            raise IndexError(f"Batch {index} of {self.num_batches}.")
        if index == 0:
            self._pass += 1
        if self.skip:
            index, rows = self._resumed_rows(index)
        else:
            # Batch 0 starts a pass: Keras draws its permutation as its iterator starts.
            rows = self._rows(index, new_pass=index == 0)
        if self.take is not None:
            # One gather per array: the batch's rows and its padding together.
            padding, _ = pad_indices(len(rows), self.replicas)
            x, y = self.take(rows[padding].astype("int32"))
            parts = _parts(x, y, _take(self.sample_weight, rows[padding]))
        else:
            parts = self.host_parts(index, rows)
            self._prefetch(index + 1)
        if not self.plan.padded:
            return parts
        return self.tag(parts, len(rows), self.replicas)


    def host_parts(self, index, rows):
        """Batch `index` from the host: the prefetched one (waiting for it), else built now.

        The time spent here is the step's wait for its input (what DeviceMonitor times).
        """
        pending, self._pending = self._pending, None
        if pending is not None and pending[:2] == (self._pass, index):
            return pending[2].result()
        return self._host_batch(rows)


class WrappedPyDataset(PaddedBatches):
    """Pads the batches of a user's `keras.utils.PyDataset`, shuffling their order as Keras does.

    Keras's own adapter shuffles a `PyDataset` of known length with
    `random.shuffle` of the batch indices when a pass starts; `rng` is the
    `random.Random` to draw from (default: Python's global generator).
    """

    def __init__(self, dataset, replicas, tag, class_weight=None, shuffle=False, rng=None):
        super().__init__(
            replicas,
            tag,
            class_weight,
            workers=dataset.workers,
            use_multiprocessing=dataset.use_multiprocessing,
            max_queue_size=dataset.max_queue_size,
        )
        self.dataset = dataset
        self.shuffle = bool(shuffle) and dataset.num_batches is not None
        self.rng = random if rng is None else rng
        self.order = None
        self._threaded = dataset.workers > 1 or (
            dataset.workers > 0 and dataset.use_multiprocessing
        )
        self._lock = threading.Lock()
        self._pass_state = None
        # Keras's TensorFlow adapter reads a few batches for their shapes before the first
        # epoch begins, unshuffled and without drawing: those reads are passed through.
        self._started = False

    @property
    def num_batches(self):
        return self.dataset.num_batches - self.skip

    @property
    def resumable(self):
        return self.dataset.num_batches is not None

    def position(self):
        if not self.resumable:
            return None
        order = self.order if self.shuffle else None
        return {"generators": self._pass_state, "order": order}

    def resume(self, state, skip):
        self.skip = int(skip)
        self.order = None
        order = state.get("order")
        self._expected = None if order is None else [int(np.ravel(b)[0]) for b in order]
        generators = state.get("generators")
        if self.skip:
            self._resume_generators = generators  # restored as the pass draws (see ArrayBatches)
        elif generators is not None:
            set_generator_state(self.rng, generators)

    def _position(self, index):
        if not self.shuffle:
            return index
        with self._lock:
            # Unthreaded, Keras draws as a pass starts (batch 0); threaded,
            # its enqueuer draws once an epoch, so the order is reset at the
            # epoch's end and drawn by whichever fetch comes first.
            if self.order is None or (index == self.skip and not self._threaded):
                if getattr(self, "_resume_generators", None) is not None:
                    set_generator_state(self.rng, self._resume_generators)
                    self._resume_generators = None
                self._pass_state = generator_state(self.rng) if hasattr(
                    self.rng, "getstate") else None
                order = list(range(self.dataset.num_batches))
                self.rng.shuffle(order)
                expected = getattr(self, "_expected", None)
                if expected is not None and list(expected) != order:
                    warnings.warn(
                        "The resumed epoch's batch order differs from the checkpoint's (set a "
                        "seed, e.g. keras.utils.set_random_seed, before building the model): "
                        "it follows the checkpoint's.",
                        stacklevel=2,
                    )
                    order = [int(i) for i in expected]
                self._expected = None
                self.order = order
            return self.order[index]

    def __getitem__(self, index):
        if self._started:
            return self.pad(self.dataset[self._position(index + self.skip)])
        return self.pad(self.dataset[index])

    def on_epoch_begin(self):
        self._started = True
        self.dataset.on_epoch_begin()

    def on_epoch_end(self):
        if self._threaded:
            self.order = None
        self.dataset.on_epoch_end()


class WrappedIterable(PaddedBatches):
    """Pads a re-iterable of known length (tf.data, torch DataLoader, a list),
    iterating it afresh every epoch, once per epoch as Keras does.

    Keras's TensorFlow adapter reads a few batches for their shapes before the
    first epoch begins: those come from the iteration the first epoch then
    goes on with (a new iteration would draw another shuffle, tf.data's and a
    DataLoader's alike).
    """

    def __init__(self, iterable, replicas, tag, class_weight=None):
        super().__init__(replicas, tag, class_weight)
        self.iterable = iterable
        self.iterator = None
        self._started = False
        self._peeked = []  # batches read before the first epoch, from `self.iterator`

    @property
    def num_batches(self):
        return len(self.iterable)

    def __getitem__(self, index):
        if not self._started:  # Keras reads a batch for its shapes
            if self.iterator is None:
                self.iterator = iter(self.iterable)
            while len(self._peeked) <= index:
                self._peeked.append(self.next_from(self.iterator))
            return self.pad(self._peeked[index])
        if index < len(self._peeked):  # the first epoch: the batches read already
            return self.pad(self._peeked[index])
        self._peeked = []
        if index == 0 or self.iterator is None:
            self.iterator = iter(self.iterable)
        return self.pad(self.next_from(self.iterator))

    def on_epoch_begin(self):
        if self._started:  # the first epoch is over: the batches read before it are served
            self._peeked = []
        self._started = True


def _padded_generator(generator, dataset):
    generator = iter(generator)
    while True:
        try:
            batch = dataset.next_from(generator)
        except StopIteration:
            return
        if not isinstance(batch, (tuple, list)) or not 1 <= len(batch) <= 3:
            raise ValueError(
                "When passing a Python generator to a Keras model, the generator must return "
                "a tuple, either (input,) or (inputs, targets) or (inputs, targets, "
                f"sample_weights). Received: {type(batch).__name__}"
                + (f" of shape {np.shape(batch)}" if hasattr(batch, "shape") else "")
                + ". Yield (x, y) batches, or (x,) for inputs alone."
            )
        yield dataset.pad(tuple(batch))


def _is_array_like(x):
    return all(
        hasattr(leaf, "shape") and hasattr(leaf, "__array__")
        for leaf in tree.flatten(x) if leaf is not None
    ) and any(leaf is not None for leaf in tree.flatten(x))


def as_padded(x, y=None, sample_weight=None, *, batch_size=None, replicas, tag,
              shuffle=False, class_weight=None, drop_remainder=False, place=None,
              put=None, rng=None, array_order=None):
    """Turns what `Model.fit` accepts into padded batches.

    Args:
        tag: the engine's `tag(batch, rows, replicas)` (see `backends`).
        shuffle: Keras's `shuffle` (arrays and `PyDataset`s; other inputs
            order themselves, as in Keras).
        place: for array inputs, a function that puts `(x, y)` on the devices
            and returns `take(index)`, or None to keep them on the host.
        put: for array inputs kept on the host, a function that places one
            batch on the devices (batches are then prefetched).
        rng: a `RandomState` to shuffle with (default: the global generators).
        array_order: the engine's `array_order` (see `backends`), which
            shuffles array inputs as the backend's Keras trainer does.

    Returns:
        `(data, dataset)`: `data` is what to hand to Keras (a `PyDataset`, or
        a generator for generator input) and `dataset` the `PaddedBatches`.
    """
    if isinstance(x, PaddedBatches):
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
    streaming = isinstance(x, (keras.utils.PyDataset, types.GeneratorType)) or (
        not _is_array_like(x) and hasattr(x, "__iter__") and not isinstance(x, (dict, list, tuple))
    )
    if streaming:
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
        if isinstance(x, keras.utils.PyDataset):
            dataset = WrappedPyDataset(x, replicas, tag, class_weight, shuffle=shuffle,
                                       rng=None if rng is None else rng.python)
            return dataset, dataset
        if isinstance(x, types.GeneratorType) or not hasattr(x, "__len__"):
            dataset = PaddedBatches(replicas, tag, class_weight)
            return _padded_generator(x, dataset), dataset
        dataset = WrappedIterable(x, replicas, tag, class_weight)
        return dataset, dataset
    if not _is_array_like(x):
        raise TypeError(
            "x must be arrays (NumPy, JAX, TensorFlow or PyTorch tensors, or a "
            "dict/list of them), a keras.utils.PyDataset, a generator, or a "
            f"dataset of known length. Received: x of type {type(x).__name__}."
        )
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
    dataset = ArrayBatches(
        x, y, sample_weight,
        plan(rows, batch_size, replicas, drop_remainder),
        tag, shuffle=shuffle, class_weight=class_weight, place=place,
        rng=None if rng is None else rng.numpy, put=put,
        order=None if array_order is None else array_order(rows, batch_size, shuffle),
    )
    return dataset, dataset
