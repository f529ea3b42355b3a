"""The exactness rule of a layer or function whose rows depend on the whole batch (Keras's
`MixUp`, a layer or a custom step's function the user marks with `mixes_rows`), written once
in `keras.ops` (see `rules`): each replica runs it on the batch gathered from every replica
(`rules_gather.gather_all`) and keeps its own rows."""

import contextlib
import functools
import random
import types
import warnings
import weakref

import keras

from keras_multigpu.rules_gather import (
    GATHERED,
    gather,
    gather_all,
    own_rows,
    rows_among,
    rows_of,
    switched_on,
)

_MARKED = []  # the user's Layer classes marked with `mixes_rows`, in order
_MARKED_LAYERS = weakref.WeakSet()  # the user's layers marked one by one (a Lambda)


def mixes_rows(cls):
    """Marks a Layer class whose rows depend on the whole batch, as Keras's `MixUp` does: a
    minibatch standard deviation, a batch-centring layer, anything reducing over the batch.

    On TensorFlow and torch, each replica then runs the layer on the batch gathered from
    every replica (an all-reduce of its inputs, forward and backward) and keeps its own
    rows, as one device computes them; unmarked, such a layer sees only its replica's rows
    there. The JAX engine runs one step on the whole batch, with or without the mark. The
    layer's first argument (a tensor, or a list or dict of them) is what is gathered: pass
    every input of the batch's rows in it, not in further arguments. Subclasses
    share it, unless they override `call` (their `call` runs on the replica's rows, and a
    `super().call` on the gathered batch).

        @keras_multigpu.mixes_rows
        class MinibatchStd(keras.layers.Layer):
            def call(self, x):
                std = keras.ops.mean(keras.ops.std(x, axis=0))
                return keras.ops.concatenate([x, keras.ops.ones_like(x[:, :1]) * std], -1)

    A layer instance is marked alone, where its class is Keras's own (a `Lambda` of a
    function over the batch): `mixes_rows(keras.layers.Lambda(lambda t: t - ops.mean(t,
    axis=0)))`.

    A function that a custom `train_step` calls is marked as well: a contrastive loss that
    compares every row with every other (SimCLR's, CLIP's `ops.matmul(a, ops.transpose(b))`).
    Each replica calls it with every argument of the batch's rows gathered (the tensors
    whose first dimension is the replica's rows), and keeps its own rows of each result
    whose first dimension is the batch's; a result of one value is the batch's, on every
    replica. Metrics it updates see the whole batch.

        @keras_multigpu.mixes_rows
        def contrastive_loss(z1, z2):
            similarities = ops.matmul(z1, ops.transpose(z2))
            labels = ops.arange(ops.shape(z1)[0])
            return keras.losses.sparse_categorical_crossentropy(
                labels, similarities, from_logits=True)

    A method is marked in the class body as a function is. Marked or not, it runs as it is
    outside a step (and on JAX).

    Returns:
        `cls`, unchanged (a class decorator), the layer marked, or the function marked.
    """
    if isinstance(cls, keras.layers.Layer):
        _MARKED_LAYERS.add(cls)
        return cls
    if _is_function(cls):
        @functools.wraps(cls)
        def marked(*args, **kwargs):
            return _Marked.call(cls, *args, **kwargs)

        return marked
    if not (isinstance(cls, type) and issubclass(cls, keras.layers.Layer)):
        raise TypeError(
            "mixes_rows marks a keras.layers.Layer subclass (use it as a class decorator), "
            f"a layer, or a function of the batch's rows. Received: {cls!r}.")
    if cls not in _MARKED:
        _MARKED.append(cls)
    return cls


def _is_function(value):
    """Whether `value` is a plain function or method (`mixes_rows` marks it): not a class,
    not a layer, not any other callable object (an optimizer is one)."""
    return isinstance(value, (types.FunctionType, types.MethodType, functools.partial))


class _Marked:
    """Where a function `mixes_rows` marked is called: the rules patch `call` inside a
    step (`mixing_function`); elsewhere it calls the function as it is."""

    @staticmethod
    def call(function, *args, **kwargs):
        return function(*args, **kwargs)


def mixing_function(replica, original, function, *args, **kwargs):
    """A function `mixes_rows` marked (`original` calls it) on the global batch: every
    replica gathers its arguments of the batch's rows (`rows_among`: on eager replicas, one
    small vote), calls it with one device's draws for n rows, and keeps its own rows of
    each result whose first dimension is the batch's. A result of one value is the batch's
    on every replica: the step's logs take it as it is."""
    leaves = keras.tree.flatten((args, kwargs))
    tensors = [x for x in leaves if keras.ops.is_tensor(x)]
    rows = iter(rows_among(replica, tensors, f"all-reduce of {function.__name__}'s rows"))
    what = f"all-gather of the batch for {function.__name__}"
    batch = [gather(replica, x, what) if keras.ops.is_tensor(x) and next(rows) else x
             for x in leaves]
    args, kwargs = keras.tree.pack_sequence_as((args, kwargs), batch)
    with _on_the_batch(replica):
        result = original(function, *args, **kwargs)
        flat = keras.tree.flatten(result)
        batch_rows = [keras.ops.is_tensor(x) and rows_of(replica, x) for x in flat]

    def own(x, of_the_batch):
        if keras.ops.is_tensor(x) and len(x.shape) == 0:
            replica.results.append(x)  # the batch's already
        return own_rows(replica, x) if of_the_batch else x

    return keras.tree.pack_sequence_as(result, [own(x, b) for x, b in zip(flat, batch_rows)])


@contextlib.contextmanager
def _on_the_batch(replica):
    """`replica` as one device's for the duration (k = n rows from 0: its draws are one
    device's for the batch), inside a layer or function that runs on the gathered batch."""
    k, start = replica.k, replica.start
    replica.k, replica.start = replica.n, 0
    try:
        with switched_on(GATHERED):
            yield
    finally:
        replica.k, replica.start = k, start


def unmarked_product(replica, original, x1, x2):
    """Keras's `matmul` (`original`), as it is. Where a step multiplies two operands of the
    batch's rows outside a layer or function that runs on the gathered batch, and so
    computes over its replica's rows alone, it warns (Python's filters show one of each
    kind): a (rows, d) by (d, rows) product pairs the rows (a contrastive loss's
    similarities, SimCLR's and CLIP's), a (d, rows) by (rows, e) one sums over them
    (Barlow Twins' cross-correlation). A traced step's rows are its dynamic dimensions,
    asked once per trace. An eager replica's (torch) are its k rows, of two or more, in
    operands that are not weights (`_weight`): a vote at each product, every Dense layer's
    included, would cost too much, so an operand of k rows by chance warns too."""
    if not getattr(GATHERED, "on", False):
        kind = _product_of_rows(replica, x1, x2)
        if kind:
            warnings.warn(
                f"ops.matmul {kind} the rows of the batch in a step, outside a layer or "
                "function marked @keras_multigpu.mixes_rows: each replica computes it over "
                "its own rows, not over the whole batch as one device does. If it must see "
                "the whole batch (a contrastive loss, a correlation over the batch), mark "
                "the function that computes it, or its layer, with "
                "@keras_multigpu.mixes_rows.", UserWarning, stacklevel=2)
    return original(x1, x2)


def _product_of_rows(replica, x1, x2):
    """"pairs" or "sums over" where `matmul(x1, x2)` of two matrices multiplies the batch's
    rows with each other (a trace's dynamic dimensions, an eager replica's k); else None."""
    shapes = [getattr(x, "shape", None) for x in (x1, x2)]
    if any(shape is None or len(shape) != 2 for shape in shapes) or any(
            _weight(x) for x in (x1, x2)):
        return None
    rows = None if replica.traced else int(replica.k)
    if rows is not None and rows < 2:
        return None
    (a, b), (c, d) = (tuple(shape) for shape in shapes)
    if a == rows and d == rows:
        return "pairs"
    if b == rows and c == rows:
        return "sums over"
    return None


def _weight(x):
    """Whether `x` is a weight: a Keras variable (Dense passes its kernel as one), or a
    torch leaf that requires a gradient (a parameter)."""
    return isinstance(x, keras.Variable) or (
        getattr(x, "requires_grad", False) and getattr(x, "is_leaf", False))


def mixing_layers():
    """Keras's layers whose rows depend on the whole batch, and those `mixes_rows` marked:
    MixUp and CutMix mix each image with another image of the batch, RandomElasticTransform
    draws its displacements inside the backend's image function, not through
    `rules_random`'s draws, RandomGaussianBlur and RandAugment draw a shape of (2,) (the
    sigmas, the operations), which an eager replica of 1 or 2 rows takes for a draw per row
    (`rules_random.batch_draw`), and AugMix chooses its operations with Python's `random`.
    Their operations refuse a batch of no rows, which a replica's share may be, and so does
    MelSpectrogram's `stft`, whose decibel floor (`top_db`) is under the whole batch's peak."""
    # For a layer marked alone, the class whose `call` it runs (`mixing_layer` then asks).
    alone = tuple(next(c for c in type(layer).__mro__ if "call" in vars(c))
                  for layer in list(_MARKED_LAYERS))
    return tuple(dict.fromkeys(_marked_classes() + alone))


def _mixes(layer):
    """Whether `layer` runs on the gathered batch: of a marked class, or marked alone."""
    return isinstance(layer, _marked_classes()) or layer in _MARKED_LAYERS


def _marked_classes():
    """Keras's classes of `mixing_layers`, then those `mixes_rows` marked."""
    return _keras_mixing() + tuple(_MARKED)


@functools.cache
def _keras_mixing():
    """Keras's own classes of `mixing_layers` (looked up once: `_mixes` asks at each call)."""
    names = ("MixUp", "CutMix", "RandomElasticTransform", "RandomGaussianBlur", "RandAugment",
             "AugMix", "MelSpectrogram")
    return tuple(getattr(keras.layers, n) for n in names if hasattr(keras.layers, n))


def mixing_layer(replica, original, layer, data, *args, **kwargs):
    """A `mixing_layers` layer's `call` (`original`) on the global batch.

    Every replica gathers the batch, runs the layer on it with the draws of one device for
    n rows, and keeps its own rows of the result. So too where the layer passes its rows
    through (`training=False`): every replica joins the all-reduce, and Keras's layer is
    never called on a replica's share of no rows.
    """
    if not _mixes(layer):  # another layer of a class whose `call` a marked layer runs
        return original(layer, data, *args, **kwargs)
    batch = gather_all(replica, data, f"all-gather of the batch for {layer.name}")
    with _on_the_batch(replica), _python_draws_alike(replica, layer):
        mixed = original(layer, batch, *args, **kwargs)
    return keras.tree.map_structure(lambda x: own_rows(replica, x), mixed)


@contextlib.contextmanager
def _python_draws_alike(replica, layer):
    """Python's `random` as the first replica found it, for each replica's call of `layer`:
    AugMix chooses its operations with it as its step is traced, and TensorFlow traces
    its replicas one after another in one process, each moving it on. Every replica then
    chooses what one device chooses, which leaves it moved on once. (torch's processes
    each hold their own, process 0's.)"""
    if not replica.traced:
        yield
        return
    held = layer.__dict__.setdefault("_keras_multigpu_python_draws", [None, 0])
    if held[1] == 0:
        held[0] = random.getstate()
    else:
        random.setstate(held[0])
    held[1] = (held[1] + 1) % replica.replicas
    yield
