"""Each exactness rule of `keras_multigpu.rules`, in one process.

R replicas are simulated by R threads, each holding its contiguous share of a global batch
of n rows (uneven shares, and shares of no rows), and an all-reduce that sums across the
threads. A rule holds when one device's value is the replicas' values weighed by k_r / n
(sums and gradients), or when every replica computes one device's value (moments, draws,
metric results). The rules run on every backend; the gradient rules need a backend
gradient, which these tests take on TensorFlow and torch (the engines that use the rules).
"""

import threading

import keras
import numpy as np
import pytest

from keras_multigpu import rules, rules_mixing, rules_random, rules_rows
from keras_multigpu._keras import backend, base_trainer, loss_module

# Rows per replica: even, uneven, and replicas left without rows (a batch smaller than the
# replica count, or a last batch that runs out).
SPLITS = [(4, 4), (3, 2), (2, 2, 1), (3, 0), (1, 1, 1, 0)]
BACKEND = keras.backend.backend()


def _starts(split):
    return [sum(split[:r]) for r in range(len(split))]


class _Replicas:
    """R threads, each with its `rules.Replica`, and an all-reduce that sums across them."""

    def __init__(self, split):
        self.split, self.n = split, sum(split)
        self.barrier = threading.Barrier(len(split), timeout=60)
        self.slots = [None] * len(split)
        self.calls = [0] * len(split)  # all-reduces per replica
        self.local = threading.local()

    def _all_reduce(self, r):
        def all_reduce(values, what):
            self.calls[r] += 1
            self.slots[r] = [keras.ops.convert_to_numpy(v) for v in values]
            self.barrier.wait()
            summed = [sum(parts) for parts in zip(*self.slots)]
            self.barrier.wait()  # every replica has read the sums before the next
            return [keras.ops.convert_to_tensor(np.asarray(s)) for s in summed]

        return all_reduce

    def guard(self):
        return getattr(self.local, "replica", None)

    def index(self):
        """The calling thread's replica index."""
        return self.local.index

    def run(self, function):
        """`function(replica, rows)` in every replica's thread (`rows`: a slice of the
        global batch); returns their results in replica order."""
        results, errors = [None] * len(self.split), []

        def body(r, k, start):
            self.local.index = r
            self.local.replica = rules.Replica(k, self.n, start, len(self.split),
                                               self._all_reduce(r), index=r)
            try:
                results[r] = function(self.local.replica, slice(start, start + k))
            except BaseException as error:  # noqa: BLE001 (raised in the test's thread)
                errors.append(error)
                self.barrier.abort()

        threads = [threading.Thread(target=body, args=(r, k, start))
                   for r, (k, start) in enumerate(zip(self.split, _starts(self.split)))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return results


def _weighed_sum(split, parts):
    """Sum over replicas of (k_r / n) * part_r, over the replicas with rows."""
    n = sum(split)
    return sum((k / n) * np.asarray(keras.ops.convert_to_numpy(part), "float64")
               for k, part in zip(split, parts) if k)


def _numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(x))


@pytest.mark.parametrize("split", SPLITS, ids=str)
@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum", "mean_with_sample_weight",
                                       "masked", "masked_weighted"])
def test_a_loss_reduction_weighed_by_rows_is_one_devices(split, reduction):
    n = sum(split)
    rng = np.random.default_rng(0)
    values = rng.uniform(0.5, 2.0, (n,)).astype("float32")  # a loss per row
    weights = rng.uniform(0.1, 1.0, (n,)).astype("float32")
    mask = rng.uniform(size=(n,)) > 0.3
    mask[0] = True  # at least one valid entry
    if reduction.startswith("masked"):
        kind, sample_weight = "sum_over_batch_size", (weights if "weighted" in reduction
                                                      else None)
    else:
        kind, sample_weight, mask = reduction, (
            weights if reduction == "mean_with_sample_weight" else None), None

    def reduce(rows=slice(None)):
        return loss_module.reduce_weighted_values(
            values[rows], None if sample_weight is None else sample_weight[rows],
            None if mask is None else mask[rows], kind)

    one = _numpy(reduce())
    replicas = _Replicas(split)
    with rules.installed([(loss_module, "reduce_values", rules.reduce_values, replicas.guard),
                          (loss_module, "apply_mask", rules.apply_mask, replicas.guard)]):
        parts = replicas.run(lambda replica, rows: reduce(rows))
    assert all(np.isfinite(_numpy(p)) for p in parts)
    np.testing.assert_allclose(_weighed_sum(split, parts), one, rtol=1e-6)


_ONE_VALUE_RULES = [
    (loss_module, "reduce_weighted_values", rules.weighted_scalar),
    (loss_module, "reduce_values", rules.reduce_values),
    (loss_module, "apply_mask", rules.apply_mask),
]


# An eager replica of one row cannot tell one value for the batch from a per-row loss
# squeezed to one value; the replicas of two rows or more decide (a split with none of them
# takes it for a per-row loss): those splits are `test_a_per_row_loss_squeezed_...`'s.
@pytest.mark.parametrize("split", [s for s in SPLITS if max(s) >= 2], ids=str)
@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum", "mean_with_sample_weight",
                                       "masked", "masked_unweighted"])
def test_a_one_value_loss_with_sample_weights_is_one_devices(split, reduction):
    """A custom loss that returns its own mean (one value for the batch): Keras multiplies
    it by the sample weights (or the mask) and reduces the products, so one device's loss is
    the mean times a reduction of the whole batch's weights, which no replica has alone."""
    n = sum(split)
    rng = np.random.default_rng(2)
    per_row = rng.uniform(0.5, 2.0, (n,)).astype("float32")
    weights = rng.uniform(0.1, 1.0, (n,)).astype("float32")
    mask = None
    if reduction.startswith("masked"):
        weights = None if reduction == "masked_unweighted" else weights
        reduction, mask = "sum_over_batch_size", rng.uniform(size=(n,)) > 0.3
        mask[0] = True

    def reduce(rows=slice(0, n)):
        value = per_row[rows].mean() if rows.stop > rows.start else np.float32("nan")
        return loss_module.reduce_weighted_values(
            keras.ops.convert_to_tensor(value), None if weights is None else weights[rows],
            None if mask is None else mask[rows], reduction)

    one = _numpy(reduce())
    replicas = _Replicas(split)
    with rules.installed([(*rule, replicas.guard) for rule in _ONE_VALUE_RULES]):
        parts = replicas.run(lambda replica, rows: reduce(rows))
    assert all(np.isfinite(_numpy(p)) for p, k in zip(parts, split) if k)
    np.testing.assert_allclose(_weighed_sum(split, parts), one, rtol=1e-6)


@pytest.mark.parametrize("split", [(2, 1), (3, 1, 1), (1, 1, 1, 0)], ids=str)
def test_a_per_row_loss_squeezed_on_a_replica_of_one_row_is_one_devices(split):
    """`ops.squeeze` makes a one-row replica's per-row loss one value: every replica still
    joins the same all-reduce (none waits alone), and the loss is reduced per row."""
    n = sum(split)
    rng = np.random.default_rng(3)
    per_row = rng.uniform(0.5, 2.0, (n, 1)).astype("float32")
    weights = rng.uniform(0.1, 1.0, (n,)).astype("float32")

    def reduce(rows=slice(0, n)):
        values = keras.ops.squeeze(keras.ops.convert_to_tensor(per_row[rows]))
        return loss_module.reduce_weighted_values(values, weights[rows])

    one = _numpy(reduce())
    replicas = _Replicas(split)
    with rules.installed([(*rule, replicas.guard) for rule in _ONE_VALUE_RULES]):
        parts = replicas.run(lambda replica, rows: reduce(rows))
    assert len(set(replicas.calls)) == 1  # the same collectives on every replica
    np.testing.assert_allclose(_weighed_sum(split, parts), one, rtol=1e-6)


class _OwnMean(keras.losses.Loss):
    def call(self, y_true, y_pred):
        return keras.ops.mean(keras.ops.square(y_true - y_pred))


class _SqueezedPerRow(keras.losses.Loss):
    """A per-row loss, squeezed: one value where a replica holds one row."""

    def call(self, y_true, y_pred):
        return keras.ops.squeeze(keras.ops.mean(y_true * y_pred, axis=-1, keepdims=True))


class _DiceAndVariance(keras.losses.Loss):
    """A custom loss over the batch that calls another (a Dice, itself over the batch)."""

    def call(self, y_true, y_pred):
        return keras.losses.Dice()(y_true, y_pred) + keras.ops.var(y_pred)


class _ContrastiveCall(keras.losses.Loss):
    """keras-io's supervised contrastive loss: a `__call__` of its own, which compares every
    row with every other."""

    def __call__(self, y_true, y_pred, sample_weight=None):
        logits = keras.ops.matmul(y_pred, keras.ops.transpose(y_pred))
        same = keras.ops.matmul(y_true, keras.ops.transpose(y_true))
        return keras.ops.mean(keras.ops.square(logits - same))


_LOSSES = {
    "dice": keras.losses.Dice,  # 1 - 2 * a sum over the batch / a sum
    "contrastive_call": _ContrastiveCall,
    "dice_and_variance": _DiceAndVariance,
    "tversky": lambda: keras.losses.Tversky(alpha=0.3, beta=0.7),
    "own_mean": _OwnMean,
    "squeezed_per_row": _SqueezedPerRow,
    "mse": keras.losses.MeanSquaredError,
}


def _loss_rules(guard):
    return [(*rule, guard) for rule in _ONE_VALUE_RULES] + [
        (base_trainer.CompileLoss, "call", rules.compiled_loss, guard),
        *((cls, "call", rules.one_value_loss, guard) for cls in rules.loss_classes()),
        *((cls, "__call__", rules.own_call_loss, guard) for cls in rules.loss_calls())]


def _compiled(loss, y_true, y_pred):
    """`loss` as a model compiles it: Keras's CompileLoss, whose Losses see the batch,
    built (as a model's is before its first step: the replicas' threads share it)."""
    compiled = base_trainer.CompileLoss(loss)
    compiled.build(y_true, y_pred)
    return compiled


def _decided(loss, y_true, y_pred, split):
    """`loss` (compiled), after a step of two rows on every replica where `split` gives
    every replica one row: nothing there tells one value from a squeezed row, and the loss
    keeps what its steps of a full batch decided."""
    if sum(split) == len(split):
        full = _Replicas((2,) * len(split))
        wide_true, wide_pred = np.tile(y_true, (2, 1)), np.tile(y_pred, (2, 1))
        with rules.installed(_loss_rules(full.guard)):
            full.run(lambda replica, rows: loss(wide_true[rows], wide_pred[rows]))
    return loss


def _labels_and_predictions(n, seed):
    rng = np.random.default_rng(seed)
    return ((rng.uniform(size=(n, 3)) > 0.5).astype("float32"),
            rng.uniform(0.05, 0.95, (n, 3)).astype("float32"))


@pytest.mark.parametrize("split", SPLITS + [(1, 1, 0), (2, 1, 1), (1, 1, 1)], ids=str)
@pytest.mark.parametrize("name", list(_LOSSES))
def test_a_loss_of_one_value_for_the_batch_is_computed_on_the_whole_batch(split, name):
    """Dice and Tversky divide sums over the whole batch: no weighing of the replicas'
    values gives one device's. A compiled loss that returns one value is computed on the
    gathered batch, on every replica; a per-row loss (squeezed to one value on a replica
    of one row, too) is left to the reductions, and every replica runs the same
    collectives."""
    y_true, y_pred = _labels_and_predictions(sum(split), 7)
    one = _numpy(_compiled(_LOSSES[name](), y_true, y_pred)(y_true, y_pred))  # no rule
    loss = _decided(_compiled(_LOSSES[name](), y_true, y_pred), y_true, y_pred, split)
    replicas = _Replicas(split)
    with rules.installed(_loss_rules(replicas.guard)):
        parts = replicas.run(lambda replica, rows: loss(y_true[rows], y_pred[rows]))
    assert len(set(replicas.calls)) == 1  # the same collectives on every replica
    np.testing.assert_allclose(_weighed_sum(split, parts), one, rtol=1e-6)
    if name in ("dice", "tversky", "dice_and_variance", "contrastive_call"):
        for part in parts:  # every replica holds one device's value
            np.testing.assert_allclose(_numpy(part), one, rtol=1e-6)


@pytest.mark.parametrize("split", SPLITS + [(1, 1, 1), (2, 1, 1)], ids=str)
def test_a_loss_whose_rows_compare_with_every_row_is_one_devices(split):
    """Keras's Circle loss gives each row a value from its similarities with every row of
    the batch, and masks its rows of no loss (Keras's mean leaves them out): each replica
    takes its rows of the values computed on the gathered batch, with their mask."""
    rng = np.random.default_rng(11)
    labels = rng.integers(0, 3, sum(split)).astype("int32")
    embeddings = rng.normal(size=(sum(split), 4)).astype("float32")
    one = _numpy(_compiled(keras.losses.Circle(), labels, embeddings)(labels, embeddings))
    loss = _compiled(keras.losses.Circle(), labels, embeddings)
    replicas = _Replicas(split)
    with rules.installed(_loss_rules(replicas.guard)):
        parts = replicas.run(lambda replica, rows: loss(labels[rows], embeddings[rows]))
    assert len(set(replicas.calls)) == 1
    np.testing.assert_allclose(_weighed_sum(split, parts), one, rtol=1e-5)


@pytest.mark.parametrize("split", [(1, 1, 1), (1, 1)], ids=str)
@pytest.mark.parametrize("name", ["dice", "mse"])
def test_a_loss_first_met_with_one_row_on_every_replica_is_told_by_its_rank(split, name):
    """Where every replica has one row (a batch as large as the device count) before any
    batch has told the loss's kind, its values once more on each row twice tell it."""
    y_true, y_pred = _labels_and_predictions(sum(split), 9)
    make = {"dice": keras.losses.Dice, "mse": keras.losses.MeanSquaredError}[name]
    one = _numpy(_compiled(make(), y_true, y_pred)(y_true, y_pred))
    loss = _compiled(make(), y_true, y_pred)
    replicas = _Replicas(split)
    with rules.installed(_loss_rules(replicas.guard)):
        parts = replicas.run(lambda replica, rows: loss(y_true[rows], y_pred[rows]))
    np.testing.assert_allclose(_weighed_sum(split, parts), one, rtol=1e-6)


class _SumOverRows(keras.losses.Loss):
    """A custom loss of one value that calls a Loss summed over the rows."""

    def call(self, y_true, y_pred):
        return keras.losses.MeanSquaredError(reduction="sum")(y_true, y_pred) / 10


@pytest.mark.parametrize("split", [(3, 2), (2, 1, 1), (3, 0)], ids=str)
def test_a_loss_inside_a_gathered_loss_runs_as_on_one_device(split):
    """The Losses a gathered loss calls see the whole batch, with no rule: a sum over the
    rows inside it is one device's sum, not a replica's rescaled by n / k."""
    y_true, y_pred = _labels_and_predictions(sum(split), 10)
    one = _numpy(_compiled(_SumOverRows(), y_true, y_pred)(y_true, y_pred))
    loss = _compiled(_SumOverRows(), y_true, y_pred)
    replicas = _Replicas(split)
    with rules.installed(_loss_rules(replicas.guard)):
        parts = replicas.run(lambda replica, rows: loss(y_true[rows], y_pred[rows]))
    for part in parts:
        np.testing.assert_allclose(_numpy(part), one, rtol=1e-6)


@pytest.mark.parametrize("split", [(3, 2), (2, 1, 1), (1, 1, 0)], ids=str)
def test_a_loss_a_custom_step_calls_itself_is_the_replicas_own(split):
    """A Loss a custom step calls itself may see rows that are not the replica's (real and
    generated rows, concatenated: 2k): it is left to the reductions, and no replica joins
    a collective the others skip."""
    y_true, y_pred = _labels_and_predictions(2 * sum(split), 9)
    starts = _starts(split)
    own = [_numpy(keras.losses.Dice()(np.r_[y_true[s:s + k], y_true[s:s + k]],
                                      np.r_[y_pred[s:s + k], y_pred[s:s + k]]))
           for k, s in zip(split, starts)]  # no rule installed
    loss = keras.losses.Dice()
    replicas = _Replicas(split)
    with rules.installed(_loss_rules(replicas.guard)):
        parts = replicas.run(lambda replica, rows: _numpy(loss(
            np.r_[y_true[rows], y_true[rows]], np.r_[y_pred[rows], y_pred[rows]])))
    assert len(set(replicas.calls)) == 1
    for ours, expected, k in zip(parts, own, split):
        if k:  # Dice of no rows: 1 - 0 / epsilon, the same either way
            np.testing.assert_allclose(ours, expected, rtol=1e-6)


@pytest.mark.parametrize("split", SPLITS, ids=str)
@pytest.mark.parametrize("name", ["dice", "contrastive_call"])
def test_a_one_value_losss_gradient_reaches_each_replicas_rows(split, name):
    """Each replica's gradient of the batch's Dice loss (or a Loss's own `__call__`) with
    respect to its own rows, weighed by k / n as the engines weigh a replica's gradients,
    is one device's."""
    y_true, y_pred = _labels_and_predictions(sum(split), 8)
    one = _input_gradient(lambda p: _compiled(_LOSSES[name](), y_true, p)(y_true, p), y_pred)
    loss = _decided(_compiled(_LOSSES[name](), y_true, y_pred), y_true, y_pred, split)
    replicas = _Replicas(split)
    with rules.installed(_loss_rules(replicas.guard)):
        parts = replicas.run(lambda replica, rows: _input_gradient(
            lambda p: loss(y_true[rows], p), y_pred[rows]))
    weighed = np.concatenate([(k / sum(split)) * part for k, part in zip(split, parts)])
    np.testing.assert_allclose(weighed, one, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("split", SPLITS, ids=str)
def test_an_added_loss_summed_over_rows_or_a_mean_is_one_devices(split):
    n = sum(split)
    per_row = np.random.default_rng(1).uniform(size=(n,)).astype("float32")
    aggregate = base_trainer.Trainer._aggregate_additional_loss
    parts = _Replicas(split).run(lambda replica, rows: rules.additional_loss(
        replica, aggregate, None, keras.ops.convert_to_tensor(per_row[rows])))
    np.testing.assert_allclose(_weighed_sum(split, parts), per_row.sum(), rtol=1e-6)
    # A scalar (a mean over the replica's rows, a regulariser) is weighed as a mean.
    replicas = _Replicas(split)
    parts = replicas.run(lambda replica, rows: rules.additional_loss(
        replica, aggregate, None, keras.ops.convert_to_tensor(
            per_row[rows].mean() if rows.stop > rows.start else np.float32("nan"))))
    assert all(np.isfinite(_numpy(p)) for p in parts)
    np.testing.assert_allclose(_weighed_sum(split, parts), per_row.mean(), rtol=1e-6)


class _Trainer:
    """A model's stand-in, which `additional_loss` remembers its findings for."""


@pytest.mark.parametrize("split", SPLITS, ids=str)
def test_a_scalar_added_loss_that_sums_the_rows_is_one_devices_sum(split):
    """A scalar `add_loss` value the engine finds to sum the replica's rows (`Replica.sums`:
    `add_loss(ops.sum(x))`) adds up to one device's sum, and so it does in a later step
    where the engine cannot tell (torch's evaluation, under no_grad), as the first found;
    the second value of each step, a mean, is weighed as a mean in both."""
    n, trainer = sum(split), _Trainer()
    per_row = np.random.default_rng(1).uniform(size=(n,)).astype("float32")
    aggregate = base_trainer.Trainer._aggregate_additional_loss

    def step(told):
        def added(replica, rows):
            replica.sums = lambda replica, x: told and x is first
            first = keras.ops.convert_to_tensor(per_row[rows].sum())
            mean = per_row[rows].mean() if rows.stop > rows.start else np.float32("nan")
            return [rules.additional_loss(replica, aggregate, trainer, value)
                    for value in (first, keras.ops.convert_to_tensor(mean))]
        return _Replicas(split).run(added)

    # Before any finding, a value no graph tells of is weighed as a mean.
    starts = np.cumsum((0,) + split)
    as_means = sum(k / n * per_row[s:s + k].sum() for k, s in zip(split, starts))
    np.testing.assert_allclose(_weighed_sum(split, [p[0] for p in step(None)]), as_means,
                               rtol=1e-6)
    for told in (True, None):
        parts = step(told)
        np.testing.assert_allclose(_weighed_sum(split, [p[0] for p in parts]),
                                   per_row.sum(), rtol=1e-6)
        np.testing.assert_allclose(_weighed_sum(split, [p[1] for p in parts]),
                                   per_row.mean(), rtol=1e-6)


@pytest.mark.parametrize("split", SPLITS, ids=str)
def test_a_ctc_loss_on_a_replica_without_rows_is_empty(split):
    """Keras's `ctc_loss` refuses zero rows on TensorFlow and torch: the replicas' losses,
    in order, are one device's (the rows' losses), an empty one where a replica has none."""
    n, rng = sum(split), np.random.default_rng(2)
    labels = rng.integers(1, 4, (n, 3)).astype("int32")
    output = keras.ops.softmax(rng.normal(size=(n, 6, 4)).astype("float32"))
    lengths = [np.full((n,), 3, "int32"), np.full((n,), 6, "int32")]
    parts = _Replicas(split).run(lambda replica, rows: rules_rows.ctc_loss(
        replica, backend.nn.ctc_loss, labels[rows], output[rows], lengths[0][rows],
        lengths[1][rows]))
    assert [_numpy(p).shape for p in parts] == [(k,) for k in split]
    np.testing.assert_allclose(np.concatenate([_numpy(p) for p in parts]),
                               _numpy(backend.nn.ctc_loss(labels, output, *lengths)), rtol=1e-5)


@pytest.mark.parametrize("split", SPLITS, ids=str)
@pytest.mark.parametrize("name", ["fft2", "rfft", "stft"])
def test_a_transform_on_a_replica_without_rows_is_empty(split, name):
    """torch's FFTs refuse zero rows, and so does `stft`'s reflection padding on TensorFlow
    and torch: the replicas' transforms, in order, are one device's."""
    n, rng = sum(split), np.random.default_rng(3)
    signals = rng.normal(size=(n, 4, 16)).astype("float32")
    call = {"fft2": lambda x: backend.math.fft2((x, x * 0.5)),
            "rfft": lambda x: backend.math.rfft(x),
            "stft": lambda x: backend.math.stft(x[:, 0], 8, 4, 8)}[name]
    parts = _Replicas(split).run(
        lambda replica, rows: rules_rows.transform(replica, call, signals[rows]))
    one = call(signals)
    for index in range(len(one)):
        got = np.concatenate([_numpy(p[index]) for p in parts])
        np.testing.assert_allclose(got, _numpy(one[index]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("split", SPLITS, ids=str)
def test_a_scalar_mean_tracker_holds_one_devices_mean(split):
    """A custom step's loss tracker: each replica updates with its own mean (NaN without
    rows); the trackers' summed state holds one device's mean."""
    per_row = np.random.default_rng(2).uniform(size=(sum(split),)).astype("float32")
    replicas = _Replicas(split)
    trackers = [keras.metrics.Mean() for _ in split]
    with rules.installed([(keras.metrics.Mean, "update_state", rules.mean_update,
                           replicas.guard)]):
        def update(replica, rows):
            mean = per_row[rows].mean() if rows.stop > rows.start else np.float32("nan")
            trackers[replicas.index()].update_state(mean)

        replicas.run(update)
    total = sum(_numpy(t.total) for t in trackers)
    count = sum(_numpy(t.count) for t in trackers)
    np.testing.assert_allclose(total / count, per_row.mean(), rtol=1e-6)


def _masked_accuracy(label, pred):
    """The TensorFlow transformer tutorial's metric: a ratio of sums over the batch."""
    pred = keras.ops.argmax(pred, axis=2)
    label = keras.ops.cast(label, pred.dtype)
    mask = label != 0
    match = keras.ops.cast((label == pred) & mask, "float32")
    return keras.ops.sum(match) / keras.ops.sum(keras.ops.cast(mask, "float32"))


def _squeezed_error(label, pred):
    """One value per row, squeezed to one value where there is one row."""
    wrong = keras.ops.not_equal(keras.ops.argmax(pred, axis=2), label)
    return keras.ops.squeeze(keras.ops.mean(keras.ops.cast(wrong, "float32"), axis=-1))


@pytest.mark.parametrize("split", SPLITS + [(1, 1, 0), (2, 1, 1), (1, 1, 1)], ids=str)
@pytest.mark.parametrize("fn", [_masked_accuracy, _squeezed_error], ids=lambda fn: fn.__name__)
def test_a_metric_function_of_one_value_for_the_batch_is_one_devices(split, fn):
    """A metric made from a function (`metrics=[fn]`): where it returns one value for the
    batch, every replica adds the value of the gathered batch, weighed by k / n, so that
    the replicas' summed state holds one device's mean over batches. Each replica would
    otherwise add its own ratio (0 / 0 without rows). A per-row function (squeezed to one
    value on a replica of one row, too) is left to `mean_update`."""
    n = sum(split)
    rng = np.random.default_rng(4)
    batches = [(rng.integers(0, 4, (n, 5)), rng.normal(size=(n, 5, 4)).astype("float32"))
               for _ in range(2)]
    one = keras.metrics.MeanMetricWrapper(fn)
    for label, pred in batches:
        one.update_state(label, pred)
    replicas = _Replicas(split)
    metrics = [keras.metrics.MeanMetricWrapper(fn) for _ in split]
    with rules.installed([
            (keras.metrics.Mean, "update_state", rules.mean_update, replicas.guard),
            (keras.metrics.MeanMetricWrapper, "update_state", rules.wrapped_update,
             replicas.guard)]):
        def update(replica, rows):
            for label, pred in batches:
                metrics[replicas.index()].update_state(label[rows], pred[rows])

        replicas.run(update)
    assert len(set(replicas.calls)) == 1  # the same collectives on every replica
    total = sum(_numpy(m.variables[0]) for m in metrics)
    count = sum(_numpy(m.variables[1]) for m in metrics)
    np.testing.assert_allclose(total / count, _numpy(one.result()), rtol=1e-6)


@pytest.mark.parametrize("split", SPLITS, ids=str)
@pytest.mark.parametrize("metric", ["accuracy", "auc", "precision", "mae"])
def test_a_metric_result_read_by_a_replica_is_one_devices(split, metric):
    n = sum(split)
    rng = np.random.default_rng(3)
    y_true = (rng.uniform(size=(n, 1)) > 0.5).astype("float32")
    y_pred = rng.uniform(size=(n, 1)).astype("float32")
    make = {"accuracy": lambda: keras.metrics.BinaryAccuracy(),
            "auc": lambda: keras.metrics.AUC(num_thresholds=20),
            "precision": lambda: keras.metrics.Precision(),
            "mae": lambda: keras.metrics.MeanAbsoluteError()}[metric]
    one = make()
    one.update_state(y_true, y_pred)
    replicas = _Replicas(split)
    metrics = [make() for _ in split]

    def read(replica, rows):
        r = replicas.index()
        if rows.stop > rows.start:
            metrics[r].update_state(y_true[rows], y_pred[rows])
        return rules.global_result(replica, type(metrics[r]).result, metrics[r])

    results = replicas.run(read)
    for result in results:
        np.testing.assert_allclose(_numpy(result), _numpy(one.result()), rtol=1e-6)


@pytest.mark.parametrize("split", SPLITS, ids=str)
def test_a_value_a_step_returns_is_weighed_as_a_mean_unless_a_metric_read_it(split):
    """`own_logs`: a float tensor a step returned from its rows is weighed by k / n across
    the replicas (one device's mean); a metric's result (recorded by the rules that read
    it) and an int are left as they are; without such a value, no all-reduce."""
    x = np.random.default_rng(12).normal(size=(sum(split),)).astype("float32")
    replicas = _Replicas(split)

    def step(replica, rows, raw=True):
        metric = keras.ops.convert_to_tensor(np.float32(7.0))
        replica.results.append(metric)
        logs = {"metric": metric, "count": keras.ops.convert_to_tensor(3)}
        if raw:
            logs["raw"] = keras.ops.mean(keras.ops.convert_to_tensor(x[rows]))
        return logs, rules.own_logs(replica, logs)

    for returned, logs in replicas.run(step):
        np.testing.assert_allclose(_numpy(logs["raw"]), x.mean(), rtol=1e-6)
        assert logs["metric"] is returned["metric"] and logs["count"] is returned["count"]
    assert replicas.calls == [1] * len(split)
    replicas.run(lambda replica, rows: step(replica, rows, raw=False))
    assert replicas.calls == [1] * len(split)  # none more


class _Trainer:
    """What Keras's `get_metrics_result` reads of a trainer: its metrics."""

    get_metrics_result = base_trainer.Trainer.get_metrics_result

    def __init__(self):
        self.metrics = [keras.metrics.Mean(name="loss"), keras.metrics.BinaryAccuracy(),
                        keras.metrics.AUC(num_thresholds=20, name="auc")]

    def update(self, losses, y_true, y_pred):
        self.metrics[0].update_state(losses)
        for metric in self.metrics[1:]:
            metric.update_state(y_true, y_pred)


@pytest.mark.parametrize("split", SPLITS, ids=str)
def test_a_steps_logs_are_one_devices_from_one_all_reduce(split):
    """Every metric's result in a step's logs, as one device reads them, from a single
    all-reduce per replica (each metric's own `result()` rule stands aside)."""
    n = sum(split)
    rng = np.random.default_rng(8)
    losses = rng.uniform(size=(n,)).astype("float32")
    y_true = (rng.uniform(size=(n, 1)) > 0.5).astype("float32")
    y_pred = rng.uniform(size=(n, 1)).astype("float32")
    one = _Trainer()
    one.update(losses, y_true, y_pred)
    expected = {name: _numpy(value) for name, value in one.get_metrics_result().items()}
    replicas = _Replicas(split)
    trainers = [_Trainer() for _ in split]

    def logs(replica, rows):
        trainer = trainers[replicas.index()]
        if rows.stop > rows.start:
            trainer.update(losses[rows], y_true[rows], y_pred[rows])
        return rules.metrics_result(replica, base_trainer.Trainer.get_metrics_result, trainer)

    with rules.installed([(cls, "result", rules.global_result, replicas.guard)
                          for cls in (keras.metrics.Mean, keras.metrics.BinaryAccuracy,
                                      keras.metrics.AUC)]):
        results = replicas.run(logs)
    assert replicas.calls == [1] * len(split)
    for result in results:
        assert set(result) == set(expected)
        for name, value in result.items():
            np.testing.assert_allclose(_numpy(value), expected[name], rtol=1e-6, err_msg=name)


@pytest.mark.parametrize("split", SPLITS, ids=str)
@pytest.mark.parametrize("masked", [False, True], ids=["rows", "masked-steps"])
def test_batchnorm_moments_are_the_global_batchs(split, masked):
    n = sum(split)
    rng = np.random.default_rng(4)
    if masked:  # a sequence (rows, steps, channels) with a mask over its steps
        x = rng.normal(size=(n, 5, 3)).astype("float32")
        mask = rng.uniform(size=(n, 5)) > 0.3
        mask[:, 0] = True
    else:
        x, mask = rng.normal(size=(n, 4, 3)).astype("float32"), None
    layer = keras.layers.BatchNormalization()
    layer.build(x.shape)
    original = keras.layers.BatchNormalization._moments
    one = [_numpy(m) for m in original(layer, keras.ops.convert_to_tensor(x),
                                       None if mask is None else
                                       keras.ops.convert_to_tensor(mask))]
    replicas = _Replicas(split)
    results = replicas.run(lambda replica, rows: rules.moments(
        replica, original, layer, keras.ops.convert_to_tensor(x[rows]),
        None if mask is None else keras.ops.convert_to_tensor(mask[rows])))
    for mean, variance in results:
        np.testing.assert_allclose(_numpy(mean), one[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(_numpy(variance), one[1], rtol=1e-5, atol=1e-6)
    assert replicas.calls == [1] * len(split)  # one all-reduce of the moments per replica


def _input_gradient(function, x):
    """d function(x) / dx, with the backend's own autodiff."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        x = tf.convert_to_tensor(x)
        with tf.GradientTape() as tape:
            tape.watch(x)
            value = function(x)
        return tape.gradient(value, x).numpy()
    if BACKEND == "torch":
        import torch

        x = torch.tensor(x, requires_grad=True)
        function(x).backward()
        return x.grad.numpy()
    pytest.skip("JAX traces a custom gradient's backward function to a jaxpr, where the "
                "simulated all-reduce (host values across threads) cannot run; the JAX "
                "engine has a global view of the batch and installs no rule")


@pytest.mark.parametrize("split", SPLITS, ids=str)
@pytest.mark.parametrize("scaled", [False, True], ids=["weighed-after", "loss-scaled"])
def test_batchnorm_gradients_weighed_by_rows_are_one_devices(split, scaled):
    """The gradient crosses replicas through the moments' all-reduce: each row's gradient,
    weighed by its replica's k / n, is one device's. A loss scaler's loss (`scaled_loss`,
    mixed_float16's) is weighed by k / n before the backward pass instead: the gradients
    (`weigh_gradient`) are then one device's as they come."""
    n = sum(split)
    rng = np.random.default_rng(5)
    x = rng.normal(size=(n, 3)).astype("float32")
    projection = keras.ops.convert_to_tensor(rng.normal(size=(3,)).astype("float32"))
    original = keras.layers.BatchNormalization._moments
    layer = keras.layers.BatchNormalization()
    layer.build(x.shape)

    def loss(moments, rows, scale=lambda value: value):
        def function(x):
            mean, variance = moments(x)
            normalised = (x - mean) / keras.ops.sqrt(variance + 1e-3)
            return scale(keras.ops.sum(keras.ops.tanh(normalised) * projection) / max(rows, 1))
        return function

    def part(replica, rows):
        k = rows.stop - rows.start
        moments = lambda x: rules.moments(replica, original, layer, x, None)  # noqa: E731
        if not scaled:
            return (k / n) * _input_gradient(loss(moments, k), x[rows])
        replica.own_step = True  # in Keras's own step, as a loss scaler's is anywhere
        scale = lambda value: rules.scaled_loss(  # noqa: E731
            replica, lambda optimizer, value: value * 1024.0, None, value)
        gradient = _input_gradient(loss(moments, k, scale), x[rows])
        return _numpy(rules.weigh_gradient(replica, keras.ops.convert_to_tensor(gradient)))

    one = _input_gradient(loss(lambda x: original(layer, x, None), n), x)
    parts = _Replicas(split).run(part)
    np.testing.assert_allclose(np.concatenate(parts), one * (1024.0 if scaled else 1.0),
                               rtol=1e-4, atol=1e-6 * (1024.0 if scaled else 1.0))


@keras.ops.custom_gradient
def _clipped_on_the_way_back(x):
    """The identity, whose gradient is clipped to [-1, 1] as it flows back (as
    `keras.ops.custom_gradient`'s documentation clips one): not linear in its upstream."""
    def grad(*args, upstream=None):
        if upstream is None:
            (upstream,) = args
        return keras.ops.clip(upstream, -1.0, 1.0)

    return x, grad


@pytest.mark.parametrize("split", SPLITS, ids=str)
def test_a_gradient_the_model_clips_on_its_way_back_is_one_devices(split):
    """Keras's own steps hand their loss to the backward pass through
    `Optimizer.scale_loss`, where `scaled_loss` weighs a mean by k / n: every gradient
    inside the pass is then one device's, and a custom gradient that clips it clips one
    device's values. Weighed after the pass instead, a replica of k rows in n clipped
    n / k times one device's gradient."""
    n = sum(split)
    x = np.random.default_rng(7).normal(size=(n, 3)).astype("float32")

    def loss(x):  # each row's gradient at the clip is 18 x / rows: some clipped, some not
        return keras.ops.mean(keras.ops.sum(keras.ops.square(3.0 * _clipped_on_the_way_back(x)),
                                            axis=1))

    def part(replica, rows):
        replica.own_step = True  # Keras's own step hands its loss over so
        scaled = lambda value: rules.scaled_loss(  # noqa: E731 (no loss scale of its own)
            replica, lambda optimizer, value: value, None, value)
        gradient = _input_gradient(lambda x: scaled(loss(x)), x[rows])
        return _numpy(rules.weigh_gradient(replica, keras.ops.convert_to_tensor(gradient)))

    one = _input_gradient(loss, x)
    assert 0 < np.mean(np.abs(one) >= 1.0) < 1  # the clip bites on some rows
    np.testing.assert_allclose(np.concatenate(_Replicas(split).run(part)), one,
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("split", SPLITS, ids=str)
def test_gradients_weighed_by_rows_sum_to_one_devices(split):
    """A mean squared error's gradient per replica, weighed (`rules.weigh`), summed: one
    device's. A replica without rows (a NaN mean) adds zero."""
    n = sum(split)
    rng = np.random.default_rng(6)
    x, y = rng.normal(size=(n, 3)), rng.normal(size=(n,))
    w = rng.normal(size=(3,))

    def gradient(rows):
        xs, ys = x[rows], y[rows]
        with np.errstate(invalid="ignore"):
            return (2 * xs.T @ (xs @ w - ys) / len(ys)).astype("float32")

    replicas = _Replicas(split)
    parts = replicas.run(lambda replica, rows: rules.weigh(
        replica, keras.ops.convert_to_tensor(gradient(rows))))
    np.testing.assert_allclose(sum(_numpy(p) for p in parts), gradient(slice(None)),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("split", SPLITS, ids=str)
@pytest.mark.parametrize("blocks", [1, 2])
def test_a_draw_shaped_by_the_rows_is_one_devices(split, blocks):
    """keras.random.normal((c * rows, 2)): each replica's rows of every block are the ones
    one device draws for them (a GAN's noise for its real and generated rows)."""
    n = sum(split)
    one = _numpy(keras.random.normal((blocks * n, 2), seed=keras.random.SeedGenerator(7)))
    replicas = _Replicas(split)
    parts = replicas.run(lambda replica, rows: rules.random_draw(
        replica, keras.random.normal, (blocks * (rows.stop - rows.start), 2),
        seed=keras.random.SeedGenerator(7)))
    for (k, start), part in zip(zip(split, _starts(split)), parts):
        expected = np.concatenate([one[b * n + start:b * n + start + k] for b in range(blocks)])
        np.testing.assert_array_equal(_numpy(part)[:blocks * k], expected)


_DRAWS = {
    "gamma": lambda shape, seed, alpha=2.0: keras.random.gamma(shape, alpha, seed=seed),
    "binomial": lambda shape, seed: keras.random.binomial(shape, 3, 0.4, seed=seed),
    "beta": lambda shape, seed: keras.random.beta(shape, 2.0, 3.0, seed=seed),
}


@pytest.mark.parametrize("split", SPLITS, ids=str)
@pytest.mark.parametrize("name", list(_DRAWS))
def test_gamma_binomial_and_beta_draws_shaped_by_the_rows_are_one_devices(split, name):
    """Keras's other draws with a shape (a layer's per-row mask, MixUp's weights) are
    drawn for the batch and sliced, as `normal` is."""
    if BACKEND == "torch":
        pytest.skip("Keras's torch gamma, binomial and beta seed torch's global generator, "
                    "which these threads share; test_engines checks them across processes")
    n, draw = sum(split), _DRAWS[name]
    one = _numpy(draw((n, 2), keras.random.SeedGenerator(7)))
    parts = _Replicas(split).run(lambda replica, rows: rules.random_draw(
        replica, draw, (rows.stop - rows.start, 2), keras.random.SeedGenerator(7)))
    for (k, start), part in zip(zip(split, _starts(split)), parts):
        np.testing.assert_allclose(_numpy(part), one[start:start + k], rtol=1e-6)


@pytest.mark.parametrize("split", [(3, 2), (2, 2, 1)], ids=str)
def test_a_draw_with_a_parameter_per_row_is_the_replicas_own(split):
    """A `gamma` whose `alpha` holds a value per row cannot be drawn for the batch (the
    replica holds its rows' alphas alone): it is drawn as the replica asks."""
    if BACKEND == "torch":
        pytest.skip("Keras's torch gamma seeds torch's global generator, which these "
                    "threads share")
    n = sum(split)
    alphas = np.linspace(1.0, 3.0, n, dtype="float32")[:, None]
    parts = _Replicas(split).run(lambda replica, rows: rules.random_draw(
        replica, _DRAWS["gamma"], (rows.stop - rows.start, 1), keras.random.SeedGenerator(7),
        alpha=alphas[rows]))
    for (k, start), part in zip(zip(split, _starts(split)), parts):
        own = _DRAWS["gamma"]((k, 1), keras.random.SeedGenerator(7), alpha=alphas[start:start + k])
        np.testing.assert_allclose(_numpy(part), _numpy(own), rtol=1e-6)


@pytest.mark.parametrize("split", SPLITS, ids=str)
def test_a_categorical_draw_of_per_row_logits_is_one_devices(split):
    """`keras.random.categorical` of logits with a row per row of the batch: each
    replica's rows get one device's samples (each replica drew the first rows' numbers for
    its own logits); logits that are the same on every replica are drawn as one device
    draws them."""
    n = sum(split)
    logits = np.random.default_rng(5).normal(size=(n, 6)).astype("float32")
    shared = logits[:2]
    one = _numpy(keras.random.categorical(logits, 4, seed=keras.random.SeedGenerator(7)))
    one_shared = _numpy(keras.random.categorical(shared, 4, seed=keras.random.SeedGenerator(8)))

    def draw(replica, rows):
        mine = rules.categorical(replica, keras.random.categorical, logits[rows], 4,
                                 seed=keras.random.SeedGenerator(7))
        return mine, rules.categorical(replica, keras.random.categorical, shared, 4,
                                       seed=keras.random.SeedGenerator(8))

    parts = _Replicas(split).run(draw)
    for (k, start), (mine, theirs) in zip(zip(split, _starts(split)), parts):
        np.testing.assert_array_equal(_numpy(mine), one[start:start + k])
        np.testing.assert_array_equal(_numpy(theirs), one_shared)


@pytest.mark.parametrize("split", SPLITS, ids=str)
def test_a_dropout_mask_is_one_devices(split):
    n = sum(split)
    inputs = np.arange(1, 1 + n * 6, dtype="float32").reshape(n, 6)
    one = _numpy(keras.random.dropout(keras.ops.convert_to_tensor(inputs), 0.5,
                                      seed=keras.random.SeedGenerator(3)))
    replicas = _Replicas(split)
    parts = replicas.run(lambda replica, rows: rules.dropout(
        replica, keras.random.dropout, keras.ops.convert_to_tensor(inputs[rows]), 0.5,
        seed=keras.random.SeedGenerator(3)))
    for (k, start), part in zip(zip(split, _starts(split)), parts):
        np.testing.assert_allclose(_numpy(part), one[start:start + k], rtol=1e-6)


@pytest.mark.skipif(BACKEND == "torch", reason=(
    "Keras's torch `beta` reseeds torch's process-wide generator, which these threads share; "
    "the torch engine's replicas are processes, and tests/test_engines.py::"
    "test_layers_that_mix_rows_of_the_batch_equal_one_device runs them there"))
@pytest.mark.parametrize("split", SPLITS, ids=str)
@pytest.mark.parametrize("layer", ["MixUp", "CutMix"])
def test_a_layer_that_mixes_rows_across_the_batch_gives_one_devices_rows(split, layer):
    """MixUp and CutMix mix each image with another image of the batch, on one device
    often one of another replica's rows: each replica runs the layer on the gathered batch
    (every replica's layer from the same seed, as every replica's copy of a model is)."""
    n = sum(split)
    images = np.random.default_rng(4).uniform(0, 255, (n, 5, 5, 3)).astype("float32")
    build = getattr(keras.layers, layer)
    one = _numpy(build(seed=7)(images, training=True))
    parts = _Replicas(split).run(lambda replica, rows: rules.mixing_layer(
        replica, build.call, build(seed=7), keras.ops.convert_to_tensor(images[rows]),
        training=True))
    for (k, start), part in zip(zip(split, _starts(split)), parts):
        np.testing.assert_allclose(_numpy(part), one[start:start + k], rtol=1e-6)


def _tensordot():
    from keras_multigpu._keras import backend

    return backend.numpy.tensordot  # Keras's own: no rule is installed in these tests


def _embeddings(n, seed):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 4)).astype("float32"), rng.normal(size=(n, 3)).astype("float32")


@pytest.mark.parametrize("split", SPLITS, ids=str)
@pytest.mark.parametrize("axes", [2, ([0], [0]), ((0, 1), (0, 1))], ids=str)
def test_a_contraction_over_the_batch_axis_is_one_devices(split, axes):
    """keras-io's collaborative filtering adds `ops.tensordot(users, movies, 2)` of two
    (rows, d) embeddings, one value for the batch, to every row: each replica computes one
    device's value from the gathered rows."""
    x1, x2 = _embeddings(sum(split), 9)
    if axes != ([0], [0]):
        x2 = x2[:, :1] + x1  # the same shape as x1's
    tensordot = _tensordot()
    one = _numpy(tensordot(x1, x2, axes=axes))
    replicas = _Replicas(split)
    parts = replicas.run(lambda replica, rows: rules.batch_contraction(
        replica, tensordot, keras.ops.convert_to_tensor(x1[rows]),
        keras.ops.convert_to_tensor(x2[rows]), axes=axes))
    for part in parts:
        np.testing.assert_allclose(_numpy(part), one, rtol=1e-5, atol=1e-5)
    assert len(set(replicas.calls)) == 1  # every replica joined the same collectives


@pytest.mark.parametrize("split", SPLITS, ids=str)
def test_a_contractions_gradient_reaches_each_replicas_rows(split):
    """Each replica's gradient with respect to its own rows, weighed by k / n as the
    engines weigh a replica's gradients, is one device's."""
    n = sum(split)
    x1, x2 = _embeddings(n, 10)
    x2 = x2[:, :1] * x1
    tensordot = _tensordot()
    one = _input_gradient(lambda a: keras.ops.tanh(tensordot(a, x2, axes=2)), x1)
    parts = _Replicas(split).run(lambda replica, rows: _input_gradient(
        lambda a: keras.ops.tanh(rules.batch_contraction(
            replica, tensordot, a, keras.ops.convert_to_tensor(x2[rows]), axes=2)), x1[rows]))
    weighed = np.concatenate([(k / n) * part for k, part in zip(split, parts)])
    np.testing.assert_allclose(weighed, one, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("split", SPLITS, ids=str)
def test_a_tensordot_that_pairs_the_rows_keeps_each_replicas(split):
    """keras-io's PointNet sums `ops.tensordot(x, x, axes=(2, 2))` over every pair of the
    batch's rows (an activity regularizer, which Keras divides by the rows): each replica
    pairs its own rows with every replica's, so its result is one device's rows of its own,
    and its gradient, weighed by k / n, is one device's."""
    n = sum(split)
    x = np.random.default_rng(12).normal(size=(n, 2, 2)).astype("float32")
    tensordot, axes = _tensordot(), ([2], [2])
    one = _numpy(tensordot(x, x, axes=axes))
    parts = _Replicas(split).run(lambda replica, rows: rules.batch_contraction(
        replica, tensordot, *[keras.ops.convert_to_tensor(x[rows])] * 2, axes=axes))
    for (k, start), part in zip(zip(split, _starts(split)), parts):
        assert _numpy(part).shape == (k, 2, n, 2)
        np.testing.assert_allclose(_numpy(part), one[start:start + k], rtol=1e-5, atol=1e-6)

    def regularizer(pairs, rows):
        return keras.ops.sum(keras.ops.square(pairs)) / max(rows, 1)

    one = _input_gradient(lambda a: regularizer(tensordot(a, a, axes=axes), n), x)
    parts = _Replicas(split).run(lambda replica, rows: _input_gradient(
        lambda a: regularizer(rules.batch_contraction(replica, tensordot, a, a, axes=axes),
                              len(x[rows])), x[rows]))
    weighed = np.concatenate([(k / n) * part for k, part in zip(split, parts)])
    np.testing.assert_allclose(weighed, one, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("split", [(2, 2), (2, 1), (2, 0)], ids=str)
@pytest.mark.parametrize("axes", [2, ([1], [1])], ids=str)
def test_a_weight_contracted_with_itself_is_not_gathered(split, axes):
    """A weight of as many rows as a replica's share (a Frobenius norm, `tensordot(w, w,
    2)`, or its rows' products, `axes=([1], [1])`) is the same on every replica: each
    computes it alone, as one device does."""
    w = np.random.default_rng(11).normal(size=(2, 3)).astype("float32")
    tensordot = _tensordot()
    one = _numpy(tensordot(w, w, axes=axes))
    replicas = _Replicas(split)
    parts = replicas.run(lambda replica, rows: rules.batch_contraction(
        replica, tensordot, keras.ops.convert_to_tensor(w), keras.ops.convert_to_tensor(w),
        axes=axes))
    for part in parts:
        np.testing.assert_allclose(_numpy(part), one, rtol=1e-6)
    assert replicas.calls == [1] * len(split)  # the vote, and no gather


def _contrastive(z1, z2, temperature):
    """SimCLR's loss, in small: each row's projection compared with every row's of the
    other view; one value per row, and their mean."""
    z1, z2 = keras.ops.normalize(z1, axis=1), keras.ops.normalize(z2, axis=1)
    similarities = keras.ops.matmul(z1, keras.ops.transpose(z2)) / temperature
    labels = keras.ops.arange(keras.ops.shape(z1)[0])
    values = keras.losses.sparse_categorical_crossentropy(labels, similarities,
                                                          from_logits=True)
    return {"rows": values, "mean": keras.ops.mean(values)}


def _marked(replicas):
    return rules.installed([(rules_mixing._Marked, "call", rules.mixing_function,
                             replicas.guard)])


@pytest.mark.parametrize("split", SPLITS, ids=str)
def test_a_function_marked_mixes_rows_gives_one_devices_rows(split):
    """A custom step's function marked `mixes_rows` (a contrastive loss) runs on the batch
    gathered from every replica: each keeps its own rows of a per-row result, and a result
    of one value is one device's on every replica. A tensor of other rows (the temperature)
    passes as it is."""
    n = sum(split)
    z1, z2 = np.random.default_rng(13).normal(size=(2, n, 4)).astype("float32")
    temperature = keras.ops.convert_to_tensor(0.5)
    one = {key: _numpy(v) for key, v in _contrastive(z1, z2, temperature).items()}
    function = rules_mixing.mixes_rows(_contrastive)
    replicas = _Replicas(split)
    with _marked(replicas):
        parts = replicas.run(lambda replica, rows: function(
            keras.ops.convert_to_tensor(z1[rows]), keras.ops.convert_to_tensor(z2[rows]),
            temperature=temperature))
    for (k, start), part in zip(zip(split, _starts(split)), parts):
        assert _numpy(part["rows"]).shape == (k,)
        np.testing.assert_allclose(_numpy(part["rows"]), one["rows"][start:start + k],
                                   rtol=1e-5)
        np.testing.assert_allclose(_numpy(part["mean"]), one["mean"], rtol=1e-5)
    assert len(set(replicas.calls)) == 1  # every replica joined the same collectives
    # Outside a step, it runs as it is.
    np.testing.assert_allclose(_numpy(function(z1, z2, temperature)["mean"]), one["mean"])


@pytest.mark.parametrize("split", SPLITS, ids=str)
@pytest.mark.parametrize("target", ["mean", "sum"])
def test_a_marked_functions_gradient_reaches_each_replicas_rows(split, target):
    """The gradient of a marked function's result crosses replicas through the gather.
    Of the mean over each replica's rows, weighed by k / n, and of their sum, weighed as
    the engines weigh a sum (n / k, then k / n), it is one device's for each row."""
    n = sum(split)
    z1, z2 = np.random.default_rng(14).normal(size=(2, n, 4)).astype("float32")
    function = rules_mixing.mixes_rows(_contrastive)

    def loss(values, rows):
        return (keras.ops.mean(values) if target == "mean"
                else keras.ops.sum(values) * (n / max(rows, 1)))

    one = _input_gradient(lambda a: loss(_contrastive(a, z2, 0.5)["rows"], n), z1)
    replicas = _Replicas(split)
    with _marked(replicas):
        parts = replicas.run(lambda replica, rows: _input_gradient(
            lambda a: loss(function(a, keras.ops.convert_to_tensor(z2[rows]), 0.5)["rows"],
                           len(z1[rows])), z1[rows]))
    weighed = np.concatenate([(k / n) * part for k, part in zip(split, parts)])
    np.testing.assert_allclose(weighed, one, rtol=1e-5, atol=1e-6)


def test_a_draw_not_shaped_by_the_rows_is_the_replicas_own():
    """A draw whose first dimension is no multiple of the rows (a weight's noise) is what
    one device draws, on every replica."""
    one = _numpy(keras.random.uniform((5, 2), seed=keras.random.SeedGenerator(9)))
    parts = _Replicas((2, 2)).run(lambda replica, rows: rules.random_draw(
        replica, keras.random.uniform, (5, 2), seed=keras.random.SeedGenerator(9)))
    for part in parts:
        np.testing.assert_array_equal(_numpy(part), one)


class _SharedGenerator:
    """A replica's copy of a generator every replica holds in the same state (torch's
    global one, on every process): it hands out consecutive integers."""

    def __init__(self):
        self.position = 0

    def draw(self, shape, seed):
        assert seed is None
        size = int(np.prod(shape))
        self.position += size
        return keras.ops.convert_to_tensor(
            np.arange(self.position - size, self.position, dtype="float32").reshape(shape))


@pytest.mark.parametrize("split", SPLITS, ids=str)
def test_unseeded_draws_keep_a_shared_generator_as_one_device_moves_it(split):
    """Draws from a generator every replica shares: of the rows, of two blocks of them,
    and of a constant size, which on an uneven split (a replica with none among them) no
    replica could tell from a draw of the rows alone. Every replica takes one device's
    numbers and moves its copy as one device moves it."""
    n = sum(split)
    one = _SharedGenerator()
    expected = [_numpy(one.draw((n, 2), None)), _numpy(one.draw((2 * n, 1), None)),
                _numpy(one.draw((3,), None))]
    generators = [_SharedGenerator() for _ in split]

    def draws(replica, rows):
        k, generator = rows.stop - rows.start, generators[replica.index]
        return [_numpy(rules_random.batch_draw(replica, generator.draw, shape, None))
                for shape in ((k, 2), (2 * k, 1), (3,))]

    parts = _Replicas(split).run(draws)
    for (k, start), generator, (rows, blocks, constant) in zip(
            zip(split, _starts(split)), generators, parts):
        assert generator.position == one.position
        np.testing.assert_array_equal(rows, expected[0][start:start + k])
        np.testing.assert_array_equal(blocks, np.concatenate(
            [expected[1][start:start + k], expected[1][n + start:n + start + k]]))
        np.testing.assert_array_equal(constant, expected[2])


@pytest.mark.skipif(BACKEND != "tensorflow", reason="the traced path: TensorFlow's replicas "
                    "run a traced step whose batch dimension is dynamic")
@pytest.mark.parametrize("split", SPLITS, ids=str)
def test_a_traced_draw_shaped_by_the_rows_is_one_devices(split):
    import tensorflow as tf

    n = sum(split)
    one = _numpy(keras.random.normal((2 * n, 2), seed=keras.random.SeedGenerator(7)))
    for k, start in zip(split, _starts(split)):
        seed = keras.random.SeedGenerator(7)

        @tf.function(input_signature=[tf.TensorSpec([None, 2])])
        def draw(x, k=k, start=start, seed=seed):
            replica = rules.Replica(tf.constant(k), tf.constant(n), tf.constant(start),
                                    len(split), None, traced=True)
            return rules.random_draw(replica, keras.random.normal,
                                     (2 * tf.shape(x)[0], 2), seed=seed)

        part = draw(tf.zeros((k, 2))).numpy()
        expected = np.concatenate([one[b * n + start:b * n + start + k] for b in range(2)])
        np.testing.assert_array_equal(part[:2 * k], expected)


@pytest.mark.skipif(BACKEND != "torch", reason="torch's own batch norm: the torch engine's rule")
@pytest.mark.parametrize("split", SPLITS, ids=str)
def test_torchs_own_batch_norm_normalizes_by_the_global_batch(split):
    """`_torch_native.batch_norm` (torch's `F.batch_norm` in training, inside a
    TorchModuleWrapper): every replica's rows as one device normalizes them, and the
    running statistics moved as one device moves them (torch's unbiased variance over the
    global count)."""
    import torch

    from keras_multigpu.backends import _torch_native

    n = sum(split)
    x = torch.from_numpy(np.random.default_rng(5).normal(size=(n, 3, 4)).astype("float32"))
    weight, bias = torch.tensor([0.5, 1.0, 2.0]), torch.tensor([0.1, 0.0, -0.2])

    def running():
        return torch.full((3,), 0.3), torch.full((3,), 1.5)

    one_mean, one_var = running()
    one = torch.nn.functional.batch_norm(x, one_mean, one_var, weight, bias, True, 0.1, 1e-5)

    def replica_norm(replica, rows):
        mean, var = running()
        out = _torch_native.batch_norm(replica, torch.nn.functional.batch_norm, x[rows], mean,
                                       var, weight, bias, True, 0.1, 1e-5)
        return out, mean, var

    replicas = _Replicas(split)
    for (k, start), (out, mean, var) in zip(zip(split, _starts(split)), replicas.run(
            replica_norm)):
        np.testing.assert_allclose(_numpy(out), _numpy(one[start:start + k]), atol=1e-5)
        np.testing.assert_allclose(_numpy(mean), _numpy(one_mean), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(_numpy(var), _numpy(one_var), rtol=1e-5, atol=1e-6)
    assert replicas.calls == [1] * len(split)  # one all-reduce of the moments per replica


@pytest.mark.skipif(BACKEND != "torch", reason="torch's backward pass in a user's step: the "
                                               "torch engine's rule")
@pytest.mark.skipif(not hasattr(BaseException, "add_note"), reason="notes: Python 3.11 on")
def test_a_torch_error_on_a_process_of_one_row_says_why_one_device_has_none():
    """torch fails in some backward passes on a batch of one row (its Conv2D differentiated
    twice, a gradient penalty's, in plain torch too), which one device, with every row,
    never sees: the error then says so."""
    from keras_multigpu.backends import _torch_grads

    def failing(*args, **kwargs):
        raise RuntimeError("slow_conv2d: grad_weight must be contiguous")

    from keras_multigpu.processes import CollectiveError

    def lost(*args, **kwargs):  # another process's failure: not this one's rows
        raise CollectiveError("contiguous? no: a process stopped")

    for k, n, fail, noted in ((1, 4, failing, True), (0, 3, failing, True),
                              (2, 5, failing, False), (1, 1, failing, False),
                              (1, 4, lost, False)):
        replica = rules.Replica(k, n, 0, 3, all_reduce=None)
        with pytest.raises(RuntimeError, match="contiguous") as info:
            with _torch_grads._few_rows(replica):
                fail()
        notes = getattr(info.value, "__notes__", [])
        assert bool(notes) == noted, (k, n, notes)
        if noted:
            assert notes[0].startswith(f"keras_multigpu: this process trains on {k} row(s) of "
                                       f"this batch of {n}")


@pytest.mark.skipif(BACKEND != "torch", reason="Keras's torch segment_sum, in the torch "
                    "engine's step")
def test_an_error_in_a_step_on_a_process_of_no_rows_is_noted_once():
    """Keras's torch `segment_sum` fails on a batch of no rows (`num_segments=0` taken for
    one not given: `torch.max` of no ids), which one device never sees: the whole step is
    watched, not only its backward passes, and an error through both is noted once."""
    from keras_multigpu.backends import _torch_grads

    replica = rules.Replica(0, 2, 2, 3, all_reduce=None)
    with pytest.raises(RuntimeError, match="reduction dim") as info:
        with _torch_grads._few_rows(replica), _torch_grads._few_rows(replica):
            keras.ops.segment_sum(keras.ops.zeros((0, 4)), keras.ops.zeros((0,), "int32"),
                                  num_segments=0)
    notes = getattr(info.value, "__notes__", [])
    assert len(notes) == 1 and "Keras's segment_sum on none" in notes[0], notes
