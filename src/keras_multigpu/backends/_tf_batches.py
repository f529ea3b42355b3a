"""The TensorFlow engine's batches: a padded batch dealt to the replicas, and marked.

A padded batch travels with one marker row per row (`tag`): whether the row
is real, n, and the replica the row is dealt to. Real rows are dealt to
replicas in contiguous runs that differ by at most one, so only a batch
smaller than the device count leaves a replica with none; that replica runs
on zero rows and weighs nothing. A replica keeps the rows marked with its
index: its part of a distributed dataset (`fit`), or its run of the whole
batch that Keras's `*_on_batch` hand every replica.
"""

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
