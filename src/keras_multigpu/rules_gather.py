"""The exactness rules that need the whole batch, written once in `keras.ops` (see `rules`):
the gather itself (which `rules_mixing` runs a layer that mixes rows on), a loss that returns
one value for the batch, and a `tensordot` that sums over the batch axis or pairs its rows,
run on the batch gathered from every replica."""

import contextlib
import threading

import keras

from keras_multigpu._keras import backend, base_trainer
from keras_multigpu.rules_weights import weighted_sum

# `on` while a layer or function runs on the gathered batch (`rules_mixing`): every replica
# then holds the whole batch, one device's.
GATHERED = threading.local()

# Set while the loss a model compiles runs: its Losses see the batch's rows.
_compiled = threading.local()


def gather(replica, x, what):
    """The global batch's rows of `x`, whose rows are this replica's: every replica pads
    its rows with zeros to the n rows of the batch, and one all-reduce sums them
    (`rules.weighted_sum`, whose gradient keeps the rule). The padding keeps a replica of
    no rows in the gradient's graph, so that its backward pass joins the all-reduce too."""

    x = keras.ops.convert_to_tensor(x)
    dtype = keras.backend.standardize_dtype(x.dtype)
    # Summed as float32 where an all-reduce may have no kernel (uint8 images, bools);
    # exact, since each element is another than zero on one replica at most.
    summed = dtype if dtype.startswith(("float", "bfloat")) or dtype in (
        "int32", "int64") else "float32"
    after = replica.n - replica.start - replica.k
    buffer = keras.ops.pad(keras.ops.cast(x, summed),
                           [[replica.start, after]] + [[0, 0]] * (len(x.shape) - 1))
    return keras.ops.cast(weighted_sum(replica, buffer, what), dtype)


def gather_all(replica, structure, what):
    """Every tensor of `structure` (a tensor, a list or dict of them, None where there is
    none) gathered from every replica (`gather`)."""
    if structure is None:
        return None
    return keras.tree.map_structure(
        lambda x: None if x is None else gather(replica, x, what), structure)


def own_rows(replica, x):
    """This replica's rows of `x`, whose rows are the global batch's."""
    return keras.ops.take(x, keras.ops.arange(replica.k) + replica.start, axis=0)


def on_the_batch(replica, original, holder, y_true, y_pred, **kwargs):
    """`original(holder, y_true, y_pred, **kwargs)` (a Loss's call, a metric's update) on
    the `y_true` and `y_pred` gathered from every replica, as one device runs it (the rules
    suspended)."""
    from keras_multigpu.rules import suspended  # `rules` imports this module

    what = f"all-gather of the batch for {holder.name}"
    batch = [gather_all(replica, y, what) for y in (y_true, y_pred)]
    with suspended():
        return original(holder, *batch, **kwargs)


def batch_contraction(replica, original, x1, x2, axes=2):
    """The backend's `tensordot` (`original`, which `ops.tensordot` calls) on two operands
    of the batch's rows that it mixes.

    Where it sums over the batch axis of both (keras-io's collaborative filtering contracts
    `axes=2` of two (rows, d) embeddings: one value for the batch, which every row's
    prediction adds), each replica contracts the batch gathered from every replica, as one
    device does. Where it contracts neither (keras-io's PointNet: an activity regularizer's
    `tensordot(x, x, axes=(2, 2))`, summed over every pair of the batch's rows), each
    replica pairs its own rows with the gathered batch's: its rows stay first, and its sum
    is its rows' part of one device's. The gather's gradient hands each replica its rows'
    part. Any other contraction is Keras's own."""
    mixed = _mixes_rows(replica, x1, x2, axes)
    if not mixed:
        return original(x1, x2, axes=axes)
    what = "all-gather of the batch for ops.tensordot"
    if mixed == "paired":
        x1 = gather(replica, x1, what)
    return original(x1, gather(replica, x2, what), axes=axes)


def rows_of(replica, x):
    """Whether `x`'s first dimension may be this replica's rows: equal to k where both are
    known, and unknown in a trace whose batch dimension is dynamic."""
    shape = () if x is None else keras.ops.shape(x)
    if not shape:
        return False
    rows = shape[0]
    if replica.traced:
        return not isinstance(rows, int)  # a static first dimension is not this step's rows
    return int(rows) == int(replica.k)


def _mixes_rows(replica, x1, x2, axes):
    """"paired" where `tensordot` pairs axis 0 of `x1` with axis 0 of `x2`, "pairs" where
    it contracts neither (its result holds every pair of their rows), and both hold this
    replica's rows; else False. A traced step's rows are its dynamic first dimension.
    Eager replicas join a vote (the axes, so the call to vote, are the same on every one):
    the rows are the batch's where every replica sees its own k rows there, and each
    operand is not the same on every replica (a weight of k rows is)."""
    ndim1, ndim2 = len(keras.ops.shape(x1)), len(keras.ops.shape(x2))
    if not (ndim1 and ndim2):
        return False
    if isinstance(axes, int):  # x1's last `axes` axes with x2's first
        first, second = list(range(ndim1 - axes, ndim1)), list(range(axes))
    else:
        first, second = ([a] if isinstance(a, int) else list(a) for a in axes)
    first, second = [a % ndim1 for a in first], [b % ndim2 for b in second]
    paired = any(a == 0 and b == 0 for a, b in zip(first, second))
    if not (paired or (0 not in first and 0 not in second)):
        return False
    rows = rows_of(replica, x1) and rows_of(replica, x2)
    if not voted(replica, rows, (x1, x2), "all-reduce of ops.tensordot's rows"):
        return False
    return "paired" if paired else "pairs"


def voted(replica, rows, tensors, what):
    """Whether `tensors` hold the batch's rows. A traced step's finding (`rows`, from its
    dynamic first dimension) is the same on every replica. Eager replicas vote: every
    replica has its own k rows there (`rows`, its own finding), and the tensors are not the
    same on every replica (a weight of k rows is). One small all-reduce, which every
    replica must join: call it where the question is the same on every one."""
    if replica.traced:
        return bool(rows)
    return all(_voted(replica, [rows] * len(tensors), tensors, what))


def rows_among(replica, tensors, what):
    """For each of `tensors`, whether it holds the batch's rows (`rows_of`; for eager
    replicas, `voted`'s vote, one for each tensor in one all-reduce). Every replica asks
    about as many tensors."""
    rows = [rows_of(replica, x) for x in tensors]
    if replica.traced or not tensors:
        return rows
    return _voted(replica, rows, tensors, what)


def _voted(replica, rows, tensors, what):
    """Each tensor's vote (`voted`): every replica found its rows there (`rows`, a finding
    per tensor), and the tensor is not the same on every replica."""
    mine = keras.ops.stop_gradient(keras.ops.stack(
        [keras.ops.convert_to_tensor(float(r)) for r in rows]
        + [keras.ops.cast(keras.ops.sum(x), "float32") for x in tensors]))
    every = every_replicas(replica, mine, what)
    found, sums = every[:, :len(rows)], every[:, len(rows):]
    return list(found.all(axis=0) & (sums != sums[:1]).any(axis=0))


def every_replicas(replica, values, what):
    """Every replica's float32 vector `values`, one row per replica, as NumPy (one small
    all-reduce, which every replica must join)."""
    slot = keras.ops.one_hot(replica.index, replica.replicas, dtype="float32")
    return keras.ops.convert_to_numpy(replica.all_reduce([slot[:, None] * values[None]],
                                                         what)[0])


def classes_defining(base, name):
    """`base` and every subclass of it defined so far (the user's too) with a `name` of its
    own: the classes whose `name` a rule patches."""
    found, stack = [], [base]
    while stack:
        cls = stack.pop()
        if name in vars(cls):
            found.append(cls)
        stack.extend(cls.__subclasses__())
    return list(dict.fromkeys(found))


def loss_classes():
    """Every Loss class with a `call` of its own, but the loss a model compiles from them
    (`CompileLoss`), whose one value is their sum."""
    return [cls for cls in classes_defining(keras.losses.Loss, "call")
            if not issubclass(cls, base_trainer.CompileLoss)]


def loss_calls():
    """Every Loss class with a `__call__` of its own (keras-io's SupervisedContrastiveLoss),
    but Keras's `Loss` and the loss a model compiles (`CompileLoss`)."""
    return [cls for cls in classes_defining(keras.losses.Loss, "__call__")
            if cls is not keras.losses.Loss and not issubclass(cls, base_trainer.CompileLoss)]


def own_call_loss(replica, original, loss, y_true, y_pred, sample_weight=None):
    """A Loss's own `__call__` (`original`), inside the loss a model compiles. It returns one
    value for the batch, whatever it reduces: keras-io's supervised contrastive loss
    compares every row with every other. Every replica computes it on the batch's
    `y_true`, `y_pred` and sample weights gathered from every replica, as one device does
    (the rules suspended); the gather's gradient hands each replica its rows' part. Values
    whose rows are not the batch's are left as they are. (`CompileLoss` passes all three
    positionally, as this passes them on.)"""
    from keras_multigpu.rules import suspended

    parts = (y_true, y_pred, sample_weight)
    if not getattr(_compiled, "on", False) or not all(
            rows_of(replica, x) for x in keras.tree.flatten(parts) if x is not None):
        return original(loss, y_true, y_pred, sample_weight)
    what = f"all-gather of the batch for {loss.name}"
    y_true, y_pred, sample_weight = (gather_all(replica, part, what) for part in parts)
    with suspended():
        value = original(loss, y_true, y_pred, sample_weight)
    replica.results.append(value)  # the batch's already
    return value


def compiled_loss(replica, original, compile_loss, *args, **kwargs):
    """The loss a model compiles (`CompileLoss.call`, `original`): the Losses it calls see
    the batch's rows (each output's `y_true` and `y_pred`), which `one_value_loss` may
    gather. A Loss a custom step calls itself may see other rows (a GAN's real and
    generated rows, concatenated), and is left to the reductions.

    A lone `y_true` for several outputs (keras-io's miniature GPT: `loss=[fn, None]`) goes
    in a list of one, where Keras places it at the one output with a loss: as it is, Keras's
    `tree.pack_sequence_as` takes its rows for the outputs where they number alike, as a
    replica's k rows may where the batch's n do not."""
    if args and _lone_target(args[0], args[1] if len(args) > 1 else kwargs.get("y_pred")):
        args = ([args[0]], *args[1:])
    with switched_on(_compiled):
        return original(compile_loss, *args, **kwargs)


def _lone_target(y_true, y_pred):
    """Whether `y_true` is one tensor where `y_pred` holds several outputs."""
    return (y_true is not None and not keras.tree.is_nested(y_true)
            and keras.tree.is_nested(y_pred) and len(keras.tree.flatten(y_pred)) > 1)


@contextlib.contextmanager
def switched_on(flag):
    """`flag.on` (a `threading.local`'s) True in this thread for the duration."""
    before = getattr(flag, "on", False)
    flag.on = True
    try:
        yield
    finally:
        flag.on = before


def one_value_loss(replica, original, loss, y_true, y_pred):
    """A Loss's `call` (`original`), inside the loss a model compiles: where it returns one
    value for the batch, not one per row, that value is computed on the global batch.

    Such a loss need not be a mean over the rows: Dice and Tversky (`axis=None`) divide
    sums over the whole batch, which no weighing of the replicas' values gives. Every
    replica computes the same value from the gathered `y_true` and `y_pred`, as one device
    does (the rules suspended: a Loss it calls sees the whole batch); the gather's gradient
    hands each replica its rows' part of it. Which losses return one value: `one_value`.
    """
    if not getattr(_compiled, "on", False):
        return original(loss, y_true, y_pred)
    if getattr(loss, "fn", None) in _PAIRING:
        return _rows_of_the_batch(replica, original, loss, y_true, y_pred)
    values = original(loss, y_true, y_pred)
    if not one_value(replica, loss, values, (y_true, y_pred), lambda p: original(loss, *p)):
        return values
    value = on_the_batch(replica, original, loss, y_true, y_pred)
    replica.results.append(value)  # the batch's already
    return value


# Keras's loss functions whose value for a row depends on every row of the batch: `circle`
# compares each row's embedding with every other row's.
_PAIRING = tuple(f for f in (getattr(keras.losses, "circle", None),) if f is not None)


def _rows_of_the_batch(replica, original, loss, y_true, y_pred):
    """A `_PAIRING` loss: its values for the gathered batch (`on_the_batch`), of which each
    replica keeps its own rows' and their mask (the gather's gradient hands each replica
    its rows' part of the others')."""
    values = on_the_batch(replica, original, loss, y_true, y_pred)
    mine, mask = own_rows(replica, values), backend.get_keras_mask(values)
    if mask is not None:  # circle masks its rows of no loss: Keras's mean leaves them out
        backend.set_keras_mask(mine, own_rows(replica, mask))
    return mine


def _on_two_rows(again, parts):
    """`again(parts)` on `parts` with their one row twice, the rules suspended, no gradient."""
    from keras_multigpu.rules import suspended

    twice = keras.tree.map_structure(lambda x: x if x is None or len(x.shape) == 0 else (
        keras.ops.stop_gradient(keras.ops.concatenate([x, x], axis=0))), parts)
    with suspended():
        return again(twice)


def one_value(replica, holder, values, parts, again):
    """Whether `values`, which `holder` (a Loss, a metric) computed from `parts` (its
    `y_true` and `y_pred`), is one value for the batch, not one per row: every replica
    answers alike, and every replica must ask.

    A traced step knows the value's rank, the same on every replica. An eager one (torch)
    sees a replica of one row squeeze a per-row value to one (`ops.squeeze`): where the
    batch leaves some replica fewer than two rows, every replica joins one all-reduce
    where those of two rows or more, and those of none (a per-row value has a row
    dimension of 0 there), decide. Where every replica has one row, `holder` keeps what
    its earlier batches decided (the same on every replica); before any, `again(parts)`
    computes the values once more on each row twice, whose rank tells (every replica alike).
    """
    from keras_multigpu.rules import _rank

    # None where a traced rank is unknown: Keras's own case.
    found = _rank(values) == 0 and all(rows_of(replica, x) for x in keras.tree.flatten(parts))
    if replica.traced:
        return found
    n, k, replicas = int(replica.n), int(replica.k), replica.replicas  # k: n // R or one more
    if n == replicas:
        if not hasattr(holder, "_keras_multigpu_one_value"):
            holder._keras_multigpu_one_value = _rank(_on_two_rows(again, parts)) == 0
        return holder._keras_multigpu_one_value
    if n < 2 * replicas:
        voter = k >= 2 or k == 0
        votes = replica.all_reduce([keras.ops.convert_to_tensor(float(found and voter))],
                                   f"all-reduce of {holder.name}'s rank")[0]
        found = bool(keras.ops.convert_to_numpy(votes) > 0)
    holder._keras_multigpu_one_value = found
    return found
