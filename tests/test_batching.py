"""Tests for keras_multigpu.batching: plans, padding, masks and input checks."""

import doctest

import keras
import numpy as np
import pytest

import keras_multigpu.batching
from keras_multigpu.batching import (
    ArrayBatches,
    PaddedBatches,
    as_padded,
    pad_batch,
    pad_indices,
    padded_size,
    plan,
)

# -- plan ----------------------------------------------------------------------


def test_plan_example():
    p = plan(num_samples=100, batch_size=30, replicas=3)
    assert p.num_batches == 4
    assert [p.rows(i) for i in range(p.num_batches)] == [30, 30, 30, 10]
    assert [p.padded_rows(i) for i in range(p.num_batches)] == [30, 30, 30, 12]


@pytest.mark.parametrize(
    "n, b, r, rows, padded",
    [
        (8, 8, 8, [8], [8]),
        (1, 32, 8, [1], [8]),
        (10, 4, 3, [4, 4, 2], [6, 6, 3]),
        (7, 7, 2, [7], [8]),
        (9, 3, 1, [3, 3, 3], [3, 3, 3]),
    ],
)
def test_plan_rows_and_padding(n, b, r, rows, padded):
    p = plan(n, b, r)
    assert [p.rows(i) for i in range(p.num_batches)] == rows
    assert [p.padded_rows(i) for i in range(p.num_batches)] == padded
    assert all(size % r == 0 for size in padded)
    assert sum(rows) == n


def test_plan_drop_remainder():
    p = plan(100, 30, 3, drop_remainder=True)
    assert p.num_batches == 3
    assert [p.rows(i) for i in range(p.num_batches)] == [30, 30, 30]
    exact = plan(90, 30, 3, drop_remainder=True)
    assert exact.num_batches == 3


def test_plan_accepts_numpy_ints():
    p = plan(np.int64(10), np.int64(4), np.int32(2))
    assert p.num_batches == 3
    assert type(p.batch_size) is int


@pytest.mark.parametrize("batch_size", [0, -1])
def test_plan_refuses_non_positive_batch_size(batch_size):
    with pytest.raises(ValueError, match=rf"Received: batch_size={batch_size}\."):
        plan(10, batch_size, 2)


@pytest.mark.parametrize(
    "batch_size, shown",
    [(2.5, "batch_size=2.5"), (True, "batch_size=True"), ("8", "batch_size='8'")],
)
def test_plan_refuses_non_int_batch_size(batch_size, shown):
    with pytest.raises(TypeError, match=rf"batch_size must be an int\. Received: {shown}\."):
        plan(10, batch_size, 2)


def test_plan_refuses_zero_replicas():
    with pytest.raises(ValueError, match=r"replicas=0"):
        plan(10, 4, 0)


def test_plan_refuses_no_samples():
    with pytest.raises(ValueError, match=r"no samples \(0 rows\)"):
        plan(0, 4, 2)


def test_plan_refuses_drop_remainder_leaving_nothing():
    with pytest.raises(ValueError, match=r"drop_remainder=True with 3 samples and batch_size=4"):
        plan(3, 4, 2, drop_remainder=True)


# -- pad_indices -----------------------------------------------------------------


def test_pad_indices_docstring_example():
    idx, mask = pad_indices(rows=5, replicas=4)
    assert idx.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert mask.tolist() == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert mask.dtype == np.float32


def test_pad_indices_no_padding_when_divisible():
    idx, mask = pad_indices(rows=6, replicas=3)
    assert idx.tolist() == list(range(6))
    assert mask.tolist() == [1.0] * 6


@pytest.mark.parametrize("rows, replicas", [(1, 8), (3, 8), (7, 8), (9, 8), (1, 2)])
def test_every_replica_gets_rows(rows, replicas):
    idx, mask = pad_indices(rows, replicas)
    assert len(idx) == len(mask) == padded_size(rows, replicas)
    assert len(idx) % replicas == 0
    assert len(idx) >= replicas  # no replica is empty
    assert idx.min() >= 0 and idx.max() < rows
    assert mask.sum() == rows
    assert mask[:rows].tolist() == [1.0] * rows  # real rows first, in order
    assert idx[:rows].tolist() == list(range(rows))


def test_one_row_on_eight_replicas():
    idx, mask = pad_indices(rows=1, replicas=8)
    assert idx.tolist() == [0] * 8
    assert mask.tolist() == [1.0] + [0.0] * 7


# -- pad_batch -------------------------------------------------------------------


def _x(n, features=2):
    return np.arange(n * features, dtype="float32").reshape(n, features)


def test_pad_batch_without_y():
    (x,), rows = pad_batch((_x(5),), replicas=4)
    assert rows == 5
    assert x.shape == (8, 2)
    np.testing.assert_array_equal(x, _x(5)[[0, 1, 2, 3, 4, 0, 1, 2]])


def test_pad_batch_bare_array_without_y():
    (x,), rows = pad_batch(_x(3), replicas=2)
    assert rows == 3
    assert x.shape == (4, 2)


def test_pad_batch_with_y():
    y = np.array([10, 11, 12, 13, 14])
    (x, y_pad, (weights, mask)), rows = pad_batch((_x(5), y), replicas=4)
    assert rows == 5
    assert x.shape == (8, 2)
    assert y_pad.tolist() == [10, 11, 12, 13, 14, 10, 11, 12]
    assert mask.tolist() == [1, 1, 1, 1, 1, 0, 0, 0]
    assert weights.tolist() == mask.tolist()


def test_pad_batch_with_sample_weight():
    sw = np.array([0.5, 2.0, 3.0, 1.0, 4.0])
    (_, _, (weights, mask)), rows = pad_batch((_x(5), np.zeros(5), sw), replicas=4)
    assert rows == 5
    assert weights.dtype == np.float32
    assert weights.tolist() == [0.5, 2.0, 3.0, 1.0, 4.0, 0.0, 0.0, 0.0]
    assert mask.tolist() == [1, 1, 1, 1, 1, 0, 0, 0]


def test_pad_batch_with_per_timestep_sample_weight():
    sw = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    (_, _, (weights, _)), _ = pad_batch((_x(3), np.zeros((3, 2)), sw), replicas=2)
    assert weights.tolist() == [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [0.0, 0.0]]


def test_pad_batch_class_weight_from_one_hot():
    y = keras.utils.to_categorical([0, 1, 2, 1, 0], 3)
    class_weight = {0: 1.0, 1: 2.0, 2: 3.0}
    (_, y_pad, (weights, mask)), rows = pad_batch((_x(5), y), 4, class_weight=class_weight)
    assert rows == 5
    assert y_pad.shape == (8, 3)
    assert weights.tolist() == [1.0, 2.0, 3.0, 2.0, 1.0, 0.0, 0.0, 0.0]
    assert mask.tolist() == [1, 1, 1, 1, 1, 0, 0, 0]


def test_pad_batch_class_weight_from_integer_labels():
    y = np.array([2, 2, 0, 1, 0])
    class_weight = {0: 0.5, 1: 1.0, 2: 4.0}
    (_, _, (weights, _)), _ = pad_batch((_x(5), y), 4, class_weight=class_weight)
    assert weights.tolist() == [4.0, 4.0, 0.5, 1.0, 0.5, 0.0, 0.0, 0.0]


def test_pad_batch_class_weight_and_sample_weight_is_refused():
    with pytest.raises(ValueError, match=r"either class_weight or sample_weight"):
        pad_batch((_x(3), np.array([0, 1, 0]), np.ones(3)), 2, class_weight={0: 1.0, 1: 2.0})


def test_pad_batch_class_weight_with_several_outputs_is_refused():
    y = {"a": np.array([0, 1, 0]), "b": np.array([1, 1, 0])}
    with pytest.raises(ValueError, match=r"class_weight works with a single target"):
        pad_batch((_x(3), y), 2, class_weight={0: 1.0, 1: 2.0})


def test_pad_batch_dict_inputs():
    x = {"image": _x(3, 4), "meta": np.array([[1.0], [2.0], [3.0]])}
    (x_pad, y_pad, (weights, mask)), rows = pad_batch((x, np.array([7, 8, 9])), replicas=2)
    assert rows == 3
    assert set(x_pad) == {"image", "meta"}
    assert x_pad["image"].shape == (4, 4)
    assert x_pad["meta"].ravel().tolist() == [1.0, 2.0, 3.0, 1.0]
    assert y_pad.tolist() == [7, 8, 9, 7]
    assert mask.tolist() == [1, 1, 1, 0]


def test_pad_batch_refuses_mismatched_dict_inputs():
    x = {"a": _x(3), "b": _x(4)}
    with pytest.raises(ValueError, match=r"\[3, 4\]"):
        pad_batch((x, np.zeros(3)), replicas=2)


def test_pad_batch_refuses_empty_batch():
    with pytest.raises(ValueError, match=r"0 rows"):
        pad_batch((np.zeros((0, 2)), np.zeros(0)), replicas=2)


# -- ArrayBatches ------------------------------------------------------------------


def _epoch(ds):
    """The real rows' x values (a column of sample ids), batch by batch."""
    seen = []
    for i in range(ds.num_batches):
        batch = ds[i]
        if len(batch) == 2:  # neither padding nor weights: every row is real
            (x, y), mask = batch, np.ones(len(batch[0]), "float32")
            weights = mask
        else:
            x, y, (weights, mask) = batch
        real = mask == 1.0
        assert x.shape[0] % ds.replicas == 0
        np.testing.assert_array_equal(x[:, 0], y)  # x and y rows stay paired
        np.testing.assert_array_equal(weights, mask)
        seen.append(x[real, 0].astype(int))
    return np.concatenate(seen)


def _ids(n):
    return np.arange(n, dtype="float32").reshape(n, 1), np.arange(n, dtype="float32")


def test_array_batches_cover_every_sample_once_with_shuffle():
    x, y = _ids(50)
    ds = ArrayBatches(x, y, None, plan(50, 8, 3), shuffle=True)
    first = _epoch(ds)
    assert sorted(first.tolist()) == list(range(50))
    assert first.tolist() != list(range(50))  # shuffled
    ds.on_epoch_end()
    second = _epoch(ds)
    assert sorted(second.tolist()) == list(range(50))
    assert second.tolist() != first.tolist()


def test_array_batches_without_shuffle_keep_the_order():
    x, y = _ids(11)
    ds = ArrayBatches(x, y, None, plan(11, 4, 3), shuffle=False)
    assert _epoch(ds).tolist() == list(range(11))
    ds.on_epoch_end()
    assert _epoch(ds).tolist() == list(range(11))
    assert ds.rows == {0: 4, 1: 4, 2: 3}


def test_array_batches_drop_remainder():
    x, y = _ids(10)
    ds = ArrayBatches(x, y, None, plan(10, 4, 3, drop_remainder=True), shuffle=True)
    assert ds.num_batches == 2
    seen = _epoch(ds)
    assert len(seen) == 8
    assert len(set(seen.tolist())) == 8


def test_array_batches_are_deterministic_under_the_keras_seed():
    x, y = _ids(40)

    def two_epochs():
        ds = ArrayBatches(x, y, None, plan(40, 16, 4), shuffle=True)
        first = _epoch(ds)
        ds.on_epoch_end()
        return first.tolist(), _epoch(ds).tolist()

    keras.utils.set_random_seed(1234)
    a = two_epochs()
    keras.utils.set_random_seed(1234)
    b = two_epochs()
    keras.utils.set_random_seed(4321)
    c = two_epochs()
    assert a == b
    assert a != c


def test_array_batches_index_out_of_range():
    x, y = _ids(5)
    ds = ArrayBatches(x, y, None, plan(5, 4, 2))
    with pytest.raises(IndexError):
        ds[2]
    with pytest.raises(IndexError):
        ds[-1]


def test_array_batches_carry_sample_weights():
    x, y = _ids(6)
    sw = np.arange(1, 7, dtype="float32")
    ds = ArrayBatches(x, y, sw, plan(6, 6, 4))
    _, _, (weights, mask) = ds[0]
    assert weights.tolist() == [1, 2, 3, 4, 5, 6, 0, 0]
    assert mask.tolist() == [1, 1, 1, 1, 1, 1, 0, 0]


# -- real_row_index ------------------------------------------------------------------


def test_real_row_index_docstring_example():
    ds = PaddedBatches(replicas=4)
    ds.rows = {0: 4, 1: 2}
    assert ds.real_row_index().tolist() == [0, 1, 2, 3, 4, 5]


def test_real_row_index_skips_padding():
    ds = PaddedBatches(replicas=3)
    ds.rows = {1: 4, 0: 4, 2: 2}  # insertion order must not matter
    assert ds.real_row_index().tolist() == [0, 1, 2, 3, 6, 7, 8, 9, 12, 13]


def test_real_row_index_empty():
    index = PaddedBatches(replicas=2).real_row_index()
    assert index.shape == (0,)


def test_real_row_index_recovers_the_inputs():
    x, y = _ids(10)
    ds = ArrayBatches(x, y, None, plan(10, 4, 3))
    padded = np.concatenate([ds[i][0] for i in range(ds.num_batches)])
    assert len(padded) == 6 + 6 + 3
    np.testing.assert_array_equal(padded[ds.real_row_index()], x)


# -- as_padded --------------------------------------------------------------------------


def test_as_padded_arrays():
    x, y = _ids(10)
    data, dataset = as_padded(x, y, batch_size=4, replicas=3)
    assert data is dataset
    assert isinstance(dataset, ArrayBatches)
    assert dataset.plan == plan(10, 4, 3)


def test_as_padded_default_batch_size_is_32():
    x, y = _ids(40)
    _, dataset = as_padded(x, y, replicas=2)
    assert dataset.plan.batch_size == 32


def test_as_padded_passes_padded_batches_through():
    x, y = _ids(4)
    ds = ArrayBatches(x, y, None, plan(4, 4, 2))
    assert as_padded(ds, replicas=2) == (ds, ds)


def test_as_padded_refuses_none():
    with pytest.raises(ValueError, match=r"x=None"):
        as_padded(None, replicas=2)


def test_as_padded_refuses_row_mismatch():
    with pytest.raises(ValueError, match=r"x has 5 rows but y has 4") as info:
        as_padded(np.zeros((5, 2)), np.zeros(4), replicas=2)
    assert type(info.value) is ValueError


def test_as_padded_refuses_sample_weight_mismatch():
    with pytest.raises(ValueError, match=r"x has 5 rows but sample_weight has 6"):
        as_padded(np.zeros((5, 2)), np.zeros(5), np.ones(6), replicas=2)


def test_as_padded_refuses_y_with_a_generator():
    def batches():
        yield np.zeros((2, 2)), np.zeros(2)

    with pytest.raises(ValueError, match=r"y must be None") as info:
        as_padded(batches(), np.zeros(2), replicas=2)
    assert "generator" in str(info.value)


class _Batches(keras.utils.PyDataset):
    def __init__(self):
        super().__init__()

    def __len__(self):
        return 2

    def __getitem__(self, index):
        return np.full((3, 2), index, "float32"), np.full(3, index, "float32")


def test_as_padded_refuses_drop_remainder_with_a_py_dataset():
    with pytest.raises(ValueError, match=r"drop_remainder=True") as info:
        as_padded(_Batches(), replicas=2, drop_remainder=True)
    assert "_Batches" in str(info.value)


def test_as_padded_wraps_a_py_dataset():
    data, dataset = as_padded(_Batches(), replicas=2)
    assert data is dataset
    x, y, (_, mask) = dataset[1]
    assert x.shape == (4, 2)
    assert mask.tolist() == [1, 1, 1, 0]
    assert dataset.rows == {1: 3}


@pytest.mark.parametrize("x", [5, 2.5, "abc", b"abc"], ids=["int", "float", "str", "bytes"])
def test_as_padded_refuses_unsupported_types(x):
    with pytest.raises(TypeError, match=rf"Received: x of type {type(x).__name__}\."):
        as_padded(x, replicas=2)


def test_as_padded_refuses_a_list_of_python_numbers():
    with pytest.raises(TypeError, match=r"x of type list"):
        as_padded([1, 2, 3], replicas=2)


# -- doctests --------------------------------------------------------------------------


def test_module_doctests():
    results = doctest.testmod(keras_multigpu.batching, verbose=False)
    assert results.attempted > 0
    assert results.failed == 0


def test_arrays_without_padding_or_weights_carry_no_mask():
    x, y = _ids(12)
    assert len(ArrayBatches(x, y, None, plan(12, 4, 2))[0]) == 2  # (x, y)
    # One padded batch anywhere (or weights) gives every batch the mask, since
    # Keras fixes the data layout from an epoch's first batch.
    assert len(ArrayBatches(x, y, None, plan(12, 5, 2))[0]) == 3
    assert len(ArrayBatches(x, y, np.ones(12), plan(12, 4, 2))[0]) == 3
    assert len(pad_batch((_x(6), np.arange(6)), replicas=3)[0]) == 3  # streams: always
