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

The batches, and their order, are Keras's own: a `Feed` (`feed.py`) is a Keras
data adapter around Keras's adapter for the user's data (for arrays, for their
row indices), and pads what it yields; `inputs.as_padded` makes one of any
input Keras takes. Nothing here re-draws a shuffle.
"""

import dataclasses
import math
import random
import warnings

import keras
import numpy as np
from keras import tree

from keras_multigpu._keras import data_adapters


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
    if not isinstance(drop_remainder, (bool, np.bool_)):
        raise TypeError(f"drop_remainder must be True or False. Received: {drop_remainder=}.")
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
    leaves = [leaf for leaf in tree.flatten(structure) if leaf is not None]
    shapes = [np.shape(leaf) for leaf in leaves]
    scalar = next((leaf for leaf, shape in zip(leaves, shapes) if not shape), None)
    if scalar is not None:
        # A Python list of numbers reads as a list of inputs, one number each (Keras's
        # structures): no array of samples is in it.
        raise ValueError(
            f"{what} must be arrays whose first axis is the samples; it holds a value of no "
            f"axis ({type(scalar).__name__} {scalar!r}). A Python list is a list of arrays, "
            f"one per model input or output: pass a list of numbers as np.asarray(...). "
            f"Received: {what} of type {type(structure).__name__}.")
    lengths = {int(shape[0]) for shape in shapes}
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
    return tree.map_structure(lambda a: None if a is None else _rows(a[index]), structure)


def _rows(taken):
    """Rows taken from an array, dense: SciPy's sparse rows (`as_csr`) made dense."""
    return taken.toarray() if hasattr(taken, "toarray") else taken


def is_sparse(leaf):
    """A SciPy sparse matrix (a TF-IDF matrix), or TensorFlow's or JAX's sparse tensor,
    which Keras's array adapter takes too: their rows are gathered per batch (`as_csr`),
    and served dense."""
    kind = type(leaf)
    return kind.__module__.startswith("scipy.sparse") or (kind.__name__, kind.__module__.split(
        ".")[0]) in (("SparseTensor", "tensorflow"), ("BCOO", "jax"))


def as_csr(leaf):
    """A 2-D sparse matrix or tensor (`is_sparse`) as SciPy's CSR matrix, whose rows index."""
    import scipy.sparse

    if hasattr(leaf, "tocsr"):  # SciPy's own
        return leaf.tocsr()
    if len(leaf.shape) != 2:
        raise ValueError(
            f"A sparse x must have 2 dimensions (samples, features). Received: a "
            f"{type(leaf).__name__} of shape {tuple(leaf.shape)}. Pass it dense, or as a "
            "dataset.")
    indices, values = (np.asarray(leaf.indices), np.asarray(
        leaf.values if hasattr(leaf, "values") else leaf.data))
    if indices.ndim != 2 or indices.shape[-1] != 2:  # a BCOO with batch or dense dimensions
        return scipy.sparse.csr_matrix(np.asarray(leaf.todense()))
    return scipy.sparse.coo_matrix((values, (indices[:, 0], indices[:, 1])),
                                   shape=tuple(int(d) for d in leaf.shape)).tocsr()


def _parts(x, y, sample_weight):
    """Keras's batch structure: `(x,)`, `(x, y)` or `(x, y, sample_weight)`."""
    if sample_weight is not None:
        return (x, y, sample_weight)
    if y is not None:
        return (x, y)
    return (x,)


def keras_batch(x, y=None, sample_weight=None):
    """A batch of arrays as Keras's array adapter hands it to a step: x alone when it is
    all there is and not a tuple or list (`keras.utils.pack_x_y_sample_weight`), else
    `_parts` (which keeps sample weights without targets, for a model's own loss)."""
    if y is None and sample_weight is None and not isinstance(x, (tuple, list)):
        return x
    return _parts(x, y, sample_weight)


def _numeric(dtype):
    """`(name, whether a model can take it)` for any framework's dtype."""
    try:
        name = keras.backend.standardize_dtype(dtype)
    except (ValueError, TypeError):
        return getattr(dtype, "name", str(dtype)), False
    return name, name == "bool" or name.startswith(("float", "int", "uint", "bfloat", "complex"))


def is_text(array):
    """Whether `array` holds text: strings or bytes (NumPy's, a TensorFlow string tensor's),
    or an object array of nothing else."""
    dtype = getattr(array, "dtype", None)
    if getattr(dtype, "name", None) == "string":  # TensorFlow's
        return True
    kind = getattr(dtype, "kind", None)
    return kind in ("U", "S") or kind == "O" and all(
        isinstance(value, (str, bytes)) for value in np.asarray(array).flat)


def check_dtypes(structure, what, text=False):
    """Refuses arrays no model can take (strings, objects), as Keras does, but early; text
    where the model can take it (`text`: a TensorFlow model with a string input)."""
    for leaf in tree.flatten(structure):
        dtype = getattr(leaf, "dtype", None)
        if dtype is None:
            continue
        name, numeric = _numeric(dtype)
        if not numeric and not (text and is_text(leaf)):
            raise ValueError(
                f"Invalid dtype: {name} in {what} (an array of shape {tuple(np.shape(leaf))}). "
                "A model takes numbers: turn text into numbers first (e.g. "
                "keras.layers.StringLookup or TextVectorization, applied to the data), and "
                "object arrays into numeric ones (np.asarray(a, 'float32')). On TensorFlow, "
                "a model whose input is keras.Input(..., dtype='string') takes text."
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
    return data_adapters.data_adapter_utils.class_weight_to_sample_weights(
        np.asarray(tree.flatten(y)[0]), class_weight
    )


def check_batched(shapes):
    """Every array of a batch has its samples on its first axis (`shapes`, one per array;
    None where unknown): a batch holding a scalar comes from a dataset of single samples."""
    shapes = [shape for shape in shapes if shape is not None]
    if any(len(shape) == 0 for shape in shapes):
        raise ValueError(
            "A batch of the input holds a scalar (shape ()): every array of a batch has its "
            "samples on its first axis. Batch a dataset or generator of single samples "
            f"first, e.g. dataset.batch(32). Received: a batch of shapes {shapes}."
        )


def pad_batch(batch, replicas, tag, class_weight=None, text=False):
    """Pads one `x`, `(x,)`, `(x, y)` or `(x, y, sample_weight)` batch, and tags it even when
    it needs no padding: Keras fixes a stream's data layout from its first batch, and
    TensorFlow's `*_on_batch` hand every replica the whole batch, which the marker splits.

    Args:
        batch: the batch, as a user's dataset yields it. The step gets its rows in the same
            structure: x alone stays x alone, as on one device.
        replicas: the device count.
        tag: the engine's `tag(batch, rows, replicas)` (see `backends`).
        class_weight: Keras's `class_weight`, turned into sample weights.

    Returns:
        `(data, rows)`: what to hand to Keras, and the real row count.
    """
    check_batched([None if leaf is None else tuple(np.shape(leaf))
                   for leaf in tree.flatten(batch)])
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
    rows = _num_rows(x, "x")
    for name, part in (("y", y), ("sample_weight", sample_weight)):
        if part is not None and _num_rows(part, name) != rows:
            raise ValueError(
                f"A batch's x has {rows} rows but its {name} has {_num_rows(part, name)}: "
                "every array of a batch needs one row per sample."
            )
    check_dtypes((x, y, sample_weight), "a batch", text)
    if rows == 0:
        raise ValueError("A batch has 0 rows. Every batch needs at least one sample.")
    if class_weight is not None:
        sample_weight = class_sample_weights(y, class_weight, sample_weight)
    index, _ = pad_indices(rows, replicas)
    parts = tuple(None if part is None else _take(tree.map_structure(np.asarray, part), index)
                  for part in _parts(x, y, sample_weight))
    if not isinstance(batch, (tuple, list)) and len(parts) == 1:
        parts = parts[0]
    return tag(parts, rows, replicas), rows


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
        hasattr(leaf, "shape") and (hasattr(leaf, "__array__") or is_sparse(leaf))
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
