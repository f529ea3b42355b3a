"""The TensorFlow engine's batches: a padded batch dealt to the replicas, and marked.

A padded batch travels with one marker row per row (`tag`): whether the row
is real, n, and the replica the row is dealt to. Real rows are dealt to
replicas in contiguous runs that differ by at most one, so only a batch
smaller than the device count leaves a replica with none; that replica runs
on zero rows and weighs nothing. A replica keeps the rows marked with its
index: its part of a distributed dataset (`fit`), or its run of the whole
batch that Keras's `*_on_batch` hand every replica.

A replica dealt no rows runs some of TensorFlow's ops on one row of zeros and keeps none
of it, where TensorFlow's own fail on zero rows: convolutions (`any_rows`), max pooling
(`pooled`) and `TimeDistributed` over a time axis of unknown length (`time_distributed`).
"""

import functools

import keras
import numpy as np
import tensorflow as tf
from keras import tree

_BATCH, _ROWS = "keras_multigpu_batch", "keras_multigpu_rows"


def _deal(rows, replicas):
    """Row order of a padded batch: each replica's real rows, then its padding.

    >>> _deal(5, 4).tolist()   # replicas get [0, 1], [2, 0*], [3, 0*], [4, 0*]
    [0, 1, 2, 0, 3, 0, 4, 0]
    """
    per = -(-rows // replicas)
    counts = [rows // replicas + (r < rows % replicas) for r in range(replicas)]
    order, start = [], 0
    for count in counts:
        real = list(range(start, start + count))
        order += real + [real[0] if real else 0] * (per - count)
        start += count
    return np.asarray(order), np.repeat(counts, per) > np.tile(np.arange(per), replicas)


def tag(batch, rows, replicas):
    """The padded `batch` (real rows first) reordered for the replicas, with a marker per row.

    Returns `(tagged,)`, as the JAX engine's: Keras takes it for an `(x,)`
    batch and hands it to the step whole; the strategy splits every part.
    """
    order, real = _deal(rows, replicas)  # covers the padded size, a multiple of replicas
    dealt = tree.map_structure(lambda a: None if a is None else np.asarray(a)[order], batch)
    replica = np.repeat(np.arange(replicas), len(order) // replicas)
    marker = np.stack([real, np.full(len(order), rows), replica], axis=1).astype("int32")
    return ({_BATCH: dealt, _ROWS: marker},)


def _tagged(data):
    return isinstance(data, dict) and data.keys() == {_BATCH, _ROWS}


def _unwrap(data):
    if isinstance(data, tuple) and data and _tagged(data[0]):
        if any(part is not None for part in data[1:]):
            raise ValueError("A tagged batch must travel alone.")
        return data[0]
    return data


def _replica_id():
    context = tf.distribute.get_replica_context()
    return tf.cast(0 if context is None else context.replica_id_in_sync_group, "int32")


def _mine(marker):
    """(first, k): where this replica's rows start among `marker`'s, and its real rows."""
    mine = tf.cast(marker[:, 2] == _replica_id(), "int32")
    return tf.argmax(mine, output_type=tf.int32), tf.reduce_sum(marker[:, 0] * mine)


def untag(data):
    """The real rows of this replica's part of a tagged batch, else `data` itself."""
    data = _unwrap(data)
    if not _tagged(data):
        return data
    batch, marker = data[_BATCH], data[_ROWS]
    if isinstance(marker, keras.KerasTensor):  # a symbolic build: shapes only
        return batch
    first, real = _mine(marker)
    return tree.map_structure(lambda a: None if a is None else a[first:first + real], batch)


def _counts(data):
    """(k, n, start) of this replica as int32 tensors: its real rows, the global batch's, and
    where its rows start in the global batch (`_deal`'s contiguous runs)."""
    data = _unwrap(data)
    context = tf.distribute.get_replica_context()
    replicas = context.num_replicas_in_sync
    replica = _replica_id()
    if _tagged(data):
        marker = data[_ROWS]
        # Every replica's part holds at least one marker row, so n is read there.
        k, n = _mine(marker)[1], tf.reduce_max(marker[:, 1])
        return k, n, replica * (n // replicas) + tf.minimum(replica, n % replicas)
    first = next(leaf for leaf in tree.flatten(data) if leaf is not None)
    k = tf.shape(first)[0]
    return k, k * replicas, replica * k


@functools.cache
def empty_convolution_misshaped():
    """Whether TensorFlow's CPU convolution gives an empty batch the wrong shape.

    With oneDNN (x86 CPUs with AVX-512, TensorFlow 2.20 and 2.21), a convolution of zero
    rows returns its input's shape: (0, 16, 3) for 8 filters. A replica dealt no rows
    (a batch smaller than the device count) then fails at the next layer.
    """
    with tf.device("/cpu:0"):
        out = tf.nn.convolution(tf.zeros((0, 4, 3)), tf.zeros((3, 3, 2)), padding="SAME")
    return out.shape[-1] != 2


def any_rows(replica, original, inputs, *args, **kwargs):
    """Keras's convolution `original`, shaped right for a replica with no rows too: on
    zero rows it convolves one row of zeros and keeps none of it.

    The row is made from the inputs' shape alone: padded onto the inputs, TensorFlow's
    graph optimizer took `conv(pad(x))[:0]` back to `conv(x)` in a step without gradients
    (evaluate, predict), and the empty batch was misshaped again."""

    def run(x):
        return original(x, *args, **kwargs)

    return _on_rows(tf.convert_to_tensor(inputs), run, run)


def pooled(replica, original, inputs, *args, **kwargs):
    """Keras's max pooling `original` on a replica's rows, and on no rows too: oneDNN's
    gradient of max pooling aborts the process on zero rows ("Check failed: dtype() ==
    expected_dtype" in MklMaxPoolingGradOp, TensorFlow 2.21; no probe can try it without
    aborting, so it is guarded everywhere). A replica with no rows pools one row of zeros
    and keeps none of it, added to its inputs rather than chosen by a `tf.cond`: in a
    branch, TensorFlow's MaxPool3D gives a window's gradient to each of its tied maxima,
    where the step's own op (oneDNN's) gives it to one, as one device's step does."""
    inputs = tf.convert_to_tensor(inputs)
    rows = tf.shape(inputs)[0]
    zeros = tf.zeros(tf.concat([[1 - tf.minimum(rows, 1)], tf.shape(inputs)[1:]], 0),
                     inputs.dtype)
    return original(tf.concat([inputs, zeros], 0), *args, **kwargs)[:rows]


def _on_rows(inputs, run, run_one_row):
    """`run(inputs)` where `inputs` has rows; on none, `run_one_row` of one row of zeros,
    made from the inputs' shape alone (see `any_rows`), keeping none of its rows."""

    def one_row():
        zeros = tf.zeros(tf.concat([[1], tf.shape(inputs)[1:]], 0), inputs.dtype)
        return run_one_row(zeros)[:0]

    return tf.cond(tf.shape(inputs)[0] > 0, lambda: run(inputs), one_row)


def time_distributed(replica, original, layer, inputs, *args, **kwargs):
    """Keras's `TimeDistributed.call` (`original`), which maps its layer over a time axis of
    unknown length with TensorFlow's `vectorized_map`: that fails on a replica with no rows
    ("Tried to stack elements of an empty list"), which then maps one row of zeros (no
    mask) and keeps none of it, as `any_rows` convolves one."""
    inputs = tf.convert_to_tensor(inputs)
    if inputs.shape.rank is None or inputs.shape.rank < 2 or inputs.shape[1] is not None:
        return original(layer, inputs, *args, **kwargs)
    return _on_rows(inputs, lambda x: original(layer, x, *args, **kwargs),
                    lambda x: original(layer, x, *args, **{**kwargs, "mask": None}))
