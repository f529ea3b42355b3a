"""Any input Keras takes (arrays, a tf.data dataset, a PyDataset, a generator, a torch
DataLoader), as a `Feed` of padded batches: `as_padded`."""

import inspect
import zlib

import numpy as np
from keras import tree

from keras_multigpu import processes
from keras_multigpu._keras import data_adapters
from keras_multigpu.batching import (
    _is_array_like,
    _num_rows,
    _take,
    as_csr,
    check_class_weight,
    check_dtypes,
    class_sample_weights,
    is_sparse,
    keras_batch,
    pad_batch,
    pad_indices,
    plan,
)
from keras_multigpu.feed import Feed


def _array_server(x, y, sample_weight, plan, tag, take=None, put=None):
    """`serve` for array inputs: a batch of row indices -> those rows, padded and tagged."""

    def serve(rows):
        padding, _ = pad_indices(len(rows), plan.replicas)
        index = rows[padding]
        if take is not None:
            # One gather per array on the devices: the batch's rows and its padding together.
            px, py = take(index.astype("int32"))
            parts = keras_batch(px, py, _take(sample_weight, index))
        else:
            parts = keras_batch(_take(x, index), _take(y, index), _take(sample_weight, index))
            if put is not None:
                parts = put(parts)
        if not plan.padded:
            return parts
        return tag(parts, len(rows), plan.replicas)

    return serve


def as_padded(x, y=None, sample_weight=None, *, batch_size=None, replicas, tag,
              shuffle=False, class_weight=None, drop_remainder=False, place=None,
              put=None, steps_per_epoch=None, engine_state=None, set_engine_state=None,
              to_backend=None, text=False):
    """Turns what `Model.fit` accepts into a `Feed` of padded batches, in Keras's order.

    Args:
        tag: the engine's `tag(batch, rows, replicas)` (see `backends`).
        shuffle: Keras's `shuffle`, passed on to Keras's adapter.
        place: for array inputs, a function that puts `(x, y)` on the devices
            and returns `take(index)`, or None to keep them on the host.
        put: for array inputs kept on the host, a function that places one
            batch on the devices (batches are then prefetched).
        engine_state, set_engine_state, to_backend: see `Feed`.
        text: whether the engine's model can take text (see `batching.check_dtypes`).

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
        feed = _stream_feed(x, y, sample_weight, replicas=replicas, tag=tag, text=text,
                            options=options, batch_size=batch_size, shuffle=shuffle,
                            class_weight=class_weight, drop_remainder=drop_remainder,
                            steps_per_epoch=steps_per_epoch)
    else:
        feed = _array_feed(x, y, sample_weight, replicas=replicas, tag=tag, text=text,
                           options=options, batch_size=batch_size, shuffle=shuffle,
                           class_weight=class_weight, drop_remainder=drop_remainder,
                           steps_per_epoch=steps_per_epoch, place=place, put=put)
    if processes.count() > 1:  # (a summary reads rows of every array)
        processes.check_same_data(summary(feed))
    return feed, feed


def summary(feed):
    """What every process compares of its data (`processes.check_same_data`): arrays' rows,
    their shapes and dtypes and a checksum of three rows; the batch size and count."""
    sizes = {"batch_size": feed.batch_size, "batches": feed.num_batches}
    if feed.arrays is None:
        return sizes
    leaves = [leaf for leaf in tree.flatten(feed.arrays) if leaf is not None]
    rows = _num_rows(feed.arrays[0], "x")
    checksum = 0
    for leaf in (leaf for leaf in leaves if rows and not is_sparse(leaf)):
        for i in sorted({0, rows // 2, rows - 1}):
            row = np.asarray(leaf[i])
            checksum = zlib.crc32(row.tobytes() if row.dtype != object else
                                  repr(row.tolist()).encode(), checksum)
    return {**sizes, "rows": rows, "checksum": checksum,
            "layout": [[list(np.shape(leaf)[1:]), str(leaf.dtype)] for leaf in leaves]}


def _stream_feed(x, y, sample_weight, *, replicas, tag, text, options, batch_size, shuffle,
                 class_weight, drop_remainder, steps_per_epoch):
    """A `Feed` of a stream (PyDataset, generator, tf.data, DataLoader) read by Keras's adapter."""
    if isinstance(x, (dict, list, tuple)):
        raise _not_an_input(x)
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
        raise _not_an_input(x) from None
    feed = Feed(inner, lambda batch: _stream_server(batch, replicas, tag, text),
                replicas=replicas, **options)
    feed.source = x
    return feed


def _not_an_input(x):
    return TypeError(
        "x must be arrays (NumPy, JAX, TensorFlow or PyTorch tensors, or a dict/list of "
        "them), a keras.utils.PyDataset, a generator, or a dataset of known length. "
        f"Received: x of type {type(x).__name__}.")


def _array_feed(x, y, sample_weight, *, replicas, tag, text, options, batch_size, shuffle,
                class_weight, drop_remainder, steps_per_epoch, place, put):
    """A `Feed` of arrays: their rows' order from Keras's own array adapter, then gathered."""
    rows = _num_rows(x, "x")
    check_dtypes(x, "x", text)
    check_dtypes(y, "y", text)
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
        # Keras squeezes a weight's trailing axes of one: (rows, 1) weighs y of (rows,).
        kept = len(weights)
        while kept > 1 and weights[kept - 1] == 1:
            kept -= 1
        if kept > len(targets) or targets[:kept] != weights[:kept]:
            raise ValueError(
                f"sample_weight has shape {weights}, which does not match y's {targets}: pass "
                f"one weight per sample, shape ({rows},), or per time step, a prefix of y's "
                "shape."
            )
    if batch_size is None:
        batch_size = 32
    batches = plan(rows, batch_size, replicas, drop_remainder)
    x, y, sample_weight = (
        None if part is None else tree.map_structure(
            lambda a: as_csr(a) if is_sparse(a) else np.asarray(a), part)
        for part in (x, y, sample_weight)
    )
    if class_weight is not None:
        # Once for the whole set, rather than per batch.
        sample_weight = class_sample_weights(y, class_weight, sample_weight)
    sparse = any(is_sparse(leaf) for leaf in tree.flatten((x, y)))
    take = place((x, y)) if place is not None and not sparse else None
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
    return feed


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


class _Iterable(data_adapters.GeneratorDataAdapter):
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


def _stream_server(batch, replicas, tag, text=False):
    """`serve` for a stream (PyDataset, generator, tf.data, DataLoader): every batch is
    tagged, since Keras fixes the data layout from an epoch's first batch."""
    if not isinstance(batch, (tuple, list)) or not 1 <= len(batch) <= 3:
        if not (isinstance(batch, dict) or hasattr(batch, "shape")):
            raise ValueError(
                "A batch of the input must be a tuple, either (inputs,) or (inputs, targets) "
                "or (inputs, targets, sample_weights). Received: "
                f"{type(batch).__name__}. Yield (x, y) batches, or (x,) for inputs alone.")
    return pad_batch(tuple(batch) if isinstance(batch, list) else batch, replicas, tag,
                     text=text)[0]
