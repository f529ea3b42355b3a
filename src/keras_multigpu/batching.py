"""Global batches into batches whose rows divide by the replica count.

`batch_size` is the global batch. A batch whose row count does not divide
by the number of replicas is padded up to the next multiple, so that no
replica is ever empty. The padding repeats the batch's own rows, cyclically,
and each batch travels with a mask saying which rows are real:

>>> idx, mask = pad_indices(rows=5, replicas=4)
>>> idx.tolist(), mask.tolist()
([0, 1, 2, 3, 4, 0, 1, 2], [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0])

Replica 0 gets rows [0, 1], replica 1 gets [2, 3], replica 2 gets [4, 0*]
and replica 3 gets [1*, 2*] (* = padding, weight 0). Repeating real rows
instead of writing zeros keeps padded activations in the data's own range,
so BatchNormalization's batch statistics stay finite and close to the real
rows' statistics (see README, "Semantics").

Batches are `(x, y, (weights, mask))`: `weights` is the user's sample weight
(or class weight) times the mask, and `ParallelModel` uses the mask to make
the loss and the metrics those of the real rows alone. Arrays that need no
padding in any batch and carry no weights stay `(x, y)`.
"""

import dataclasses
import math
import types

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
    """Row indices of the padded batch, and its mask (1.0 real, 0.0 padding)."""
    size = padded_size(rows, replicas)
    positions = np.arange(size)
    return positions % rows, (positions < rows).astype("float32")


def _num_rows(structure, what):
    lengths = {int(np.shape(leaf)[0]) for leaf in tree.flatten(structure)}
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
    return tree.map_structure(lambda a: a[index], structure)


def _mask_like(mask, array):
    return mask.reshape((-1,) + (1,) * (np.ndim(array) - 1))


def pad_batch(batch, replicas, class_weight=None):
    """Pads one `(x,)`, `(x, y)` or `(x, y, sample_weight)` batch.

    Returns:
        `((x, y, (weights, mask)), rows)`, or `((x,), rows)` when the batch
        has no targets, where `rows` is the number of real rows.
    """
    parts = keras.utils.unpack_x_y_sample_weight(batch)
    rows = _num_rows(parts[0], "x")
    if rows == 0:
        raise ValueError("A batch has 0 rows. Every batch needs at least one sample.")
    index, mask = pad_indices(rows, replicas)
    gathered = tuple(
        None if part is None else _take(tree.map_structure(np.asarray, part), index)
        for part in parts
    )
    return with_mask(gathered, mask, class_weight), rows


def class_sample_weights(y, class_weight, sample_weight=None):
    """Per-sample weights from `class_weight` (Keras's own conversion)."""
    if sample_weight is not None:
        raise ValueError(
            "Pass either class_weight or sample_weight, not both. "
            f"Received: class_weight={class_weight!r} and sample weights."
        )
    if len(tree.flatten(y)) != 1:
        raise ValueError(
            "class_weight works with a single target array; this model "
            "has several outputs. Pass per-output sample_weight instead."
        )
    return data_adapter_utils.class_weight_to_sample_weights(
        np.asarray(tree.flatten(y)[0]), class_weight
    )


def with_mask(batch, mask, class_weight=None, always=True):
    """Adds `(weights, mask)` to an already padded batch (see `pad_batch`).

    With `always=False`, a batch with neither padding nor weights stays
    `(x, y)`. Keras fixes the data layout from an epoch's first batch, so a
    dataset passes False only when none of its batches needs a mask.
    """
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
    if y is None:
        return (x,)
    if class_weight is not None:
        sample_weight = class_sample_weights(y, class_weight, sample_weight)
    if sample_weight is None:
        if not always and mask.all():
            return x, y
        weights = mask
    else:
        weights = tree.map_structure(
            lambda w: np.asarray(w, "float32") * _mask_like(mask, w), sample_weight
        )
    return x, y, (weights, mask)


class PaddedBatches(keras.utils.PyDataset):
    """Base of the padded datasets: remembers each batch's real row count."""

    def __init__(self, replicas, class_weight=None, **kwargs):
        super().__init__(**kwargs)
        self.replicas = replicas
        self.class_weight = class_weight
        self.rows = {}

    def pad(self, index, batch):
        padded, self.rows[index] = pad_batch(batch, self.replicas, self.class_weight)
        return padded

    def real_row_index(self):
        """Positions of the real rows in the concatenated padded outputs.

        >>> ds = PaddedBatches(replicas=4)
        >>> ds.rows = {0: 4, 1: 2}
        >>> ds.real_row_index().tolist()
        [0, 1, 2, 3, 4, 5]
        """
        keep, offset = [], 0
        for i in sorted(self.rows):
            keep.append(offset + np.arange(self.rows[i]))
            offset += padded_size(self.rows[i], self.replicas)
        return np.concatenate(keep) if keep else np.zeros((0,), "int64")


class ArrayBatches(PaddedBatches):
    """Arrays (or dicts/lists of arrays) batched by a `Plan`, shuffled per epoch.

    With `place`, a function that puts `(x, y)` on the devices and returns
    `take(index)` (see `backends`), each batch is gathered on the devices
    instead of sliced on the host; `place` may return None to decline.
    """

    def __init__(self, x, y, sample_weight, plan, shuffle=False, class_weight=None,
                 place=None):
        super().__init__(plan.replicas)
        x, y, sample_weight = (
            None if part is None else tree.map_structure(np.asarray, part)
            for part in (x, y, sample_weight)
        )
        if class_weight is not None and y is not None:
            # Once for the whole set, rather than per batch.
            sample_weight = class_sample_weights(y, class_weight, sample_weight)
        self.x, self.y, self.sample_weight = x, y, sample_weight
        self.plan = plan
        self.shuffle = shuffle
        # Without padding or weights anywhere, batches stay (x, y): the step
        # runs as Keras's own and two small copies per step are saved.
        self.masked = sample_weight is not None or any(
            plan.rows(i) % plan.replicas for i in range(plan.num_batches)
        )
        self.take = place((x, y)) if place is not None else None
        self.order = np.arange(plan.num_samples)
        self.on_epoch_end()

    @property
    def num_batches(self):
        return self.plan.num_batches

    def __getitem__(self, index):
        if not 0 <= index < self.plan.num_batches:
            raise IndexError(f"Batch {index} of {self.plan.num_batches}.")
        start = index * self.plan.batch_size
        rows = self.order[start : start + self.plan.batch_size]
        # One gather per array: the batch's rows and its padding together.
        padding, mask = pad_indices(len(rows), self.replicas)
        index_rows = rows[padding]
        if self.take is not None:
            x, y = self.take(index_rows.astype("int32"))
        else:
            x, y = _take(self.x, index_rows), _take(self.y, index_rows)
        self.rows[index] = len(rows)
        return with_mask((x, y, _take(self.sample_weight, index_rows)), mask,
                         always=self.masked)

    def on_epoch_end(self):
        if self.shuffle:
            # The global NumPy generator, as Keras's own array adapter uses:
            # keras.utils.set_random_seed makes the order reproducible.
            self.order = np.random.permutation(self.plan.num_samples)


class WrappedPyDataset(PaddedBatches):
    """Pads the batches of a user's `keras.utils.PyDataset`."""

    def __init__(self, dataset, replicas, class_weight=None):
        super().__init__(
            replicas,
            class_weight,
            workers=dataset.workers,
            use_multiprocessing=dataset.use_multiprocessing,
            max_queue_size=dataset.max_queue_size,
        )
        self.dataset = dataset

    @property
    def num_batches(self):
        return self.dataset.num_batches

    def __getitem__(self, index):
        return self.pad(index, self.dataset[index])

    def on_epoch_end(self):
        self.dataset.on_epoch_end()


class WrappedIterable(PaddedBatches):
    """Pads a re-iterable of known length (tf.data, torch DataLoader, a list),
    iterating it afresh every epoch."""

    def __init__(self, iterable, replicas, class_weight=None):
        super().__init__(replicas, class_weight)
        self.iterable = iterable
        self.iterator = None

    @property
    def num_batches(self):
        return len(self.iterable)

    def __getitem__(self, index):
        if index == 0 or self.iterator is None:
            self.iterator = iter(self.iterable)
        return self.pad(index, next(self.iterator))


def _padded_generator(generator, dataset):
    for index, batch in enumerate(generator):
        yield dataset.pad(index, batch)


def _is_array_like(x):
    return all(hasattr(leaf, "shape") and hasattr(leaf, "__array__") for leaf in tree.flatten(x))


def as_padded(x, y=None, sample_weight=None, *, batch_size=None, replicas,
              shuffle=False, class_weight=None, drop_remainder=False, place=None):
    """Turns what `Model.fit` accepts into padded batches.

    Args:
        place: for array inputs, a function that puts `(x, y)` on the devices
            and returns `take(index)`, or None to keep them on the host.

    Returns:
        `(data, dataset)`: `data` is what to hand to Keras (a `PyDataset`, or
        a generator for generator input) and `dataset` the `PaddedBatches`
        that records the real row counts.
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
            dataset = WrappedPyDataset(x, replicas, class_weight)
            return dataset, dataset
        if isinstance(x, types.GeneratorType) or not hasattr(x, "__len__"):
            dataset = PaddedBatches(replicas, class_weight)
            return _padded_generator(x, dataset), dataset
        dataset = WrappedIterable(x, replicas, class_weight)
        return dataset, dataset
    if not _is_array_like(x):
        raise TypeError(
            "x must be arrays (NumPy, JAX, TensorFlow or PyTorch tensors, or a "
            "dict/list of them), a keras.utils.PyDataset, a generator, or a "
            f"dataset of known length. Received: x of type {type(x).__name__}."
        )
    rows = _num_rows(x, "x")
    for name, value in (("y", y), ("sample_weight", sample_weight)):
        if value is not None and _num_rows(value, name) != rows:
            raise ValueError(
                f"x has {rows} rows but {name} has {_num_rows(value, name)}. "
                f"Pass the same number of samples in x and {name}."
            )
    if batch_size is None:
        batch_size = 32
    dataset = ArrayBatches(
        x, y, sample_weight,
        plan(rows, batch_size, replicas, drop_remainder),
        shuffle=bool(shuffle), class_weight=class_weight, place=place,
    )
    return dataset, dataset
