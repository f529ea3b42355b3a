"""The padded-batch marker shared by engines that see the whole batch in each step.

The JAX engine (one program for the whole mesh) and the torch engine (one
process per device, each reading the whole global batch) mark a padded
batch the same way: by the *shape* of a small array, so the real row count
is known without reading device memory.
"""

import keras
import numpy as np
from keras import tree

# The keys of a tagged batch: no Keras batch is a dict with exactly these two.
_BATCH, _ROWS = "keras_multigpu_batch", "keras_multigpu_rows"


def tag(batch, rows, replicas):
    """The padded `batch` as fed to Keras, marked with its real row count.

    Args:
        batch: `(x,)`, `(x, y)` or `(x, y, sample_weight)`, every array
            padded to a multiple of `replicas` rows, real rows first.
        rows: how many leading rows are real.
        replicas: the device count.

    Returns:
        `(tagged,)`: Keras takes it for an `(x,)` batch, whatever the input
        kind (generators must yield tuples), and hands it to the step whole.
    """
    return ({_BATCH: batch, _ROWS: np.zeros((replicas, rows), "bool")},)


def _tagged(data):
    return isinstance(data, dict) and data.keys() == {_BATCH, _ROWS}


def untag(data):
    """Inside the step: the real rows of a tagged batch, else `data` itself.

    Accepts `(tagged,)` as `tag` returns it, and the `(tagged, None, None)`
    that Keras's `*_on_batch` methods build around their `x`.
    """
    if isinstance(data, (tuple, list)) and data and _tagged(data[0]):
        if any(part is not None for part in data[1:]):
            raise ValueError("A tagged batch must travel alone.")
        data = data[0]
    if not _tagged(data):
        return data
    rows = data[_ROWS].shape[1]
    batch = data[_BATCH]
    first = next(leaf for leaf in tree.flatten(batch) if leaf is not None)
    if first.shape[0] == rows:
        return batch
    return tree.map_structure(lambda a: _head(a, rows), batch)


def _head(array, rows):
    if array is None:
        return None
    if isinstance(array, keras.KerasTensor):  # Keras's symbolic build
        return keras.KerasTensor((rows, *array.shape[1:]), array.dtype)
    return array[:rows]


