"""Tests for keras_multigpu.batching: plans, padding, masks and input checks."""

import doctest

import keras
import numpy as np
import pytest

import keras_multigpu.batching
from keras_multigpu.backends import jax as engine
from keras_multigpu.batching import (
    pad_batch,
    pad_indices,
    padded_size,
    plan,
)
from keras_multigpu.feed import Feed
from keras_multigpu.inputs import as_padded

TAG = engine.tag

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


@pytest.mark.parametrize("flag", ["x", None, 1])
def test_plan_refuses_a_drop_remainder_that_is_not_a_bool(flag):
    """A string was taken for True: "drop_remainder=True with 3 samples" for 'x'."""
    with pytest.raises(TypeError, match=rf"True or False. Received: drop_remainder={flag!r}"):
        plan(3, 4, 2, drop_remainder=flag)


def test_plan_refuses_drop_remainder_leaving_nothing():
    with pytest.raises(ValueError, match=r"drop_remainder=True with 3 samples and batch_size=4"):
        plan(3, 4, 2, drop_remainder=True)


# -- pad_indices -----------------------------------------------------------------


def test_pad_indices_docstring_example():
    idx, real = pad_indices(rows=5, replicas=4)
    assert idx.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert real.tolist() == [True] * 5 + [False] * 3


def test_pad_indices_no_padding_when_divisible():
    idx, real = pad_indices(rows=6, replicas=3)
    assert idx.tolist() == list(range(6))
    assert real.all()


@pytest.mark.parametrize("rows, replicas", [(1, 8), (3, 8), (7, 8), (9, 8), (1, 2)])
def test_every_replica_gets_rows(rows, replicas):
    idx, real = pad_indices(rows, replicas)
    assert len(idx) == len(real) == padded_size(rows, replicas)
    assert len(idx) % replicas == 0
    assert len(idx) >= replicas  # no replica is empty
    assert idx.min() >= 0 and idx.max() < rows
    assert real.sum() == rows
    assert real[:rows].all()  # real rows first, in order
    assert idx[:rows].tolist() == list(range(rows))


def test_one_row_on_eight_replicas():
    idx, real = pad_indices(rows=1, replicas=8)
    assert idx.tolist() == [0] * 8
    assert real.tolist() == [True] + [False] * 7


# -- pad_batch and tags -----------------------------------------------------------


def _x(n, features=2):
    return np.arange(n * features, dtype="float32").reshape(n, features)


def _rows(tagged):
    """The real row count a tagged batch carries (the marker's shape)."""
    (inner,) = tagged
    return inner["keras_multigpu_rows"].shape[1]


def _padded_parts(tagged):
    (inner,) = tagged
    return inner["keras_multigpu_batch"]


def test_pad_batch_without_y():
    tagged, rows = pad_batch((_x(5),), 4, TAG)
    (x,) = _padded_parts(tagged)
    assert rows == _rows(tagged) == 5
    assert x.shape == (8, 2)
    np.testing.assert_array_equal(x, _x(5)[[0, 1, 2, 3, 4, 0, 1, 2]])
    (real,) = engine.untag(tagged)
    np.testing.assert_array_equal(real, _x(5))


def test_pad_batch_bare_array_without_y():
    # x alone stays x alone, as Keras hands one device's step x alone (not `(x,)`).
    tagged, rows = pad_batch(_x(3), 2, TAG)
    assert rows == 3
    assert _padded_parts(tagged).shape == (4, 2)
    np.testing.assert_array_equal(engine.untag(tagged), _x(3))


def test_pad_batch_with_y_and_sample_weight():
    y = np.array([10, 11, 12, 13, 14])
    sw = np.array([0.5, 2.0, 3.0, 1.0, 4.0])
    tagged, rows = pad_batch((_x(5), y, sw), 4, TAG)
    x_pad, y_pad, sw_pad = _padded_parts(tagged)
    assert rows == 5 and x_pad.shape == (8, 2)
    assert y_pad.tolist() == [10, 11, 12, 13, 14, 10, 11, 12]
    assert sw_pad.tolist() == [0.5, 2.0, 3.0, 1.0, 4.0, 0.5, 2.0, 3.0]  # padding's never read
    x_real, y_real, sw_real = engine.untag(tagged)
    assert y_real.tolist() == y.tolist() and sw_real.tolist() == sw.tolist()


def test_pad_batch_tags_a_batch_that_needs_no_padding():
    # Every batch is tagged, padded or not: Keras fixes a stream's layout from the first.
    tagged, _ = pad_batch((_x(4), np.arange(4)), 2, TAG)
    assert _rows(tagged) == 4
    assert len(engine.untag(tagged)) == 2


def test_pad_batch_with_per_timestep_sample_weight():
    sw = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    tagged, _ = pad_batch((_x(3), np.zeros((3, 2)), sw), 2, TAG)
    assert engine.untag(tagged)[2].tolist() == sw.tolist()


def test_pad_batch_class_weight_from_one_hot():
    y = keras.utils.to_categorical([0, 1, 2, 1, 0], 3)
    class_weight = {0: 1.0, 1: 2.0, 2: 3.0}
    tagged, rows = pad_batch((_x(5), y), 4, TAG, class_weight=class_weight)
    _, y_real, weights = engine.untag(tagged)
    assert rows == 5 and y_real.shape == (5, 3)
    assert weights.tolist() == [1.0, 2.0, 3.0, 2.0, 1.0]


def test_pad_batch_class_weight_from_integer_labels():
    y = np.array([2, 2, 0, 1, 0])
    class_weight = {0: 0.5, 1: 1.0, 2: 4.0}
    tagged, _ = pad_batch((_x(5), y), 4, TAG, class_weight=class_weight)
    assert engine.untag(tagged)[2].tolist() == [4.0, 4.0, 0.5, 1.0, 0.5]


def test_pad_batch_class_weight_and_sample_weight_is_refused():
    with pytest.raises(ValueError, match=r"either class_weight or sample_weight"):
        pad_batch((_x(3), np.array([0, 1, 0]), np.ones(3)), 2, TAG, class_weight={0: 1.0})


def test_pad_batch_class_weight_with_several_outputs_is_refused():
    y = {"a": np.array([0, 1, 0]), "b": np.array([1, 1, 0])}
    with pytest.raises(ValueError, match=r"class_weight works with a single target"):
        pad_batch((_x(3), y), 2, TAG, class_weight={0: 1.0, 1: 2.0})


def test_pad_batch_class_weight_without_targets_is_refused():
    with pytest.raises(ValueError, match=r"class_weight needs targets"):
        pad_batch((_x(3),), 2, TAG, class_weight={0: 1.0})


def test_pad_batch_dict_inputs():
    x = {"image": _x(3, 4), "meta": np.array([[1.0], [2.0], [3.0]])}
    tagged, rows = pad_batch((x, np.array([7, 8, 9])), 2, TAG)
    x_pad, y_pad = _padded_parts(tagged)
    assert rows == 3
    assert set(x_pad) == {"image", "meta"}
    assert x_pad["image"].shape == (4, 4)
    assert x_pad["meta"].ravel().tolist() == [1.0, 2.0, 3.0, 1.0]
    assert y_pad.tolist() == [7, 8, 9, 7]
    x_real, _ = engine.untag(tagged)
    assert x_real["meta"].ravel().tolist() == [1.0, 2.0, 3.0]


def test_pad_batch_refuses_mismatched_dict_inputs():
    x = {"a": _x(3), "b": _x(4)}
    with pytest.raises(ValueError, match=r"\[3, 4\]"):
        pad_batch((x, np.zeros(3)), 2, TAG)


def test_pad_batch_refuses_empty_batch():
    with pytest.raises(ValueError, match=r"0 rows"):
        pad_batch((np.zeros((0, 2)), np.zeros(0)), 2, TAG)


def test_untag_leaves_other_data_alone():
    batch = (_x(2), np.zeros(2))
    assert engine.untag(batch) is batch


# -- Feed: arrays --------------------------------------------------------------------


def _feed(x, y=None, sample_weight=None, *, batch_size, replicas, **kwargs):
    return as_padded(x, y, sample_weight, batch_size=batch_size, replicas=replicas, tag=TAG,
                     **kwargs)[1]


def _batches(feed):
    """One epoch of `feed`'s batches, driven as Keras's epoch iterator drives an adapter."""
    feed.on_epoch_begin()
    batches = list(feed.get_jax_iterator())
    feed.on_epoch_end()
    return batches


def _epoch(feed):
    """The real rows' x values (a column of sample ids), batch by batch."""
    seen = []
    for batch in _batches(feed):
        if isinstance(batch[0], dict):  # tagged
            x_pad = _padded_parts(batch)[0]
            assert x_pad.shape[0] % feed.replicas == 0
        x, y = engine.untag(batch)
        assert x.shape[0] % feed.replicas == 0 or isinstance(batch[0], dict)
        np.testing.assert_array_equal(x[:, 0], y)  # x and y rows stay paired
        seen.append(x[:, 0].astype(int))
    return np.concatenate(seen)


def _ids(n):
    return np.arange(n, dtype="float32").reshape(n, 1), np.arange(n, dtype="float32")


def test_arrays_cover_every_sample_once_with_shuffle():
    x, y = _ids(50)
    feed = _feed(x, y, batch_size=8, replicas=3, shuffle=True)
    first = _epoch(feed)
    assert sorted(first.tolist()) == list(range(50))
    assert first.tolist() != list(range(50))  # shuffled
    second = _epoch(feed)
    assert sorted(second.tolist()) == list(range(50))
    assert second.tolist() != first.tolist()


def test_arrays_without_shuffle_keep_the_order():
    x, y = _ids(11)
    feed = _feed(x, y, batch_size=4, replicas=3, shuffle=False)
    assert _epoch(feed).tolist() == list(range(11))
    assert _epoch(feed).tolist() == list(range(11))


def test_arrays_drop_remainder():
    x, y = _ids(10)
    feed = _feed(x, y, batch_size=4, replicas=3, shuffle=True, drop_remainder=True)
    assert feed.num_batches == 2
    seen = _epoch(feed)
    assert len(seen) == 8
    assert len(set(seen.tolist())) == 8


def _keras_epochs(x, y, batch_size, shuffle, epochs, between=None):
    """The row order Keras's own array adapter yields, epoch by epoch."""
    from keras.src.trainers.data_adapters.array_data_adapter import ArrayDataAdapter

    adapter = ArrayDataAdapter(x, y, batch_size=batch_size, shuffle=shuffle)
    orders = []
    for _ in range(epochs):
        adapter.on_epoch_begin()
        orders.append(np.concatenate(
            [np.asarray(bx)[:, 0] for bx, _ in adapter.get_jax_iterator()]).astype(int))
        adapter.on_epoch_end()
        if between is not None:
            between()
    return orders


@pytest.mark.parametrize("shuffle", [True, "batch"])
def test_arrays_come_in_the_order_keras_draws(shuffle):
    """The order is drawn by Keras's own array adapter (of the row indices), so it is
    Keras's on any version; the global generators move on as after Keras's draws."""
    x, y = _ids(23)
    keras.utils.set_random_seed(7)
    expected = _keras_epochs(x, y, 5, shuffle, epochs=3)
    after_keras = np.random.random()
    keras.utils.set_random_seed(7)
    feed = _feed(x, y, batch_size=5, replicas=2, shuffle=shuffle)
    got = [_epoch(feed) for _ in range(3)]
    for e, g in zip(expected, got):
        assert e.tolist() == g.tolist()
    if shuffle == "batch":  # batches stay in order, rows shuffle within them
        assert sorted(got[0][:5].tolist()) == list(range(5))
    assert np.random.random() == after_keras


def test_a_draw_between_epochs_moves_the_order_as_in_keras():
    """A callback drawing from NumPy between epochs changes the next order in Keras: here
    too (the order is Keras's draw, from the same generator)."""
    x, y = _ids(30)
    keras.utils.set_random_seed(3)
    expected = _keras_epochs(x, y, 8, True, epochs=3, between=lambda: np.random.permutation(9))
    keras.utils.set_random_seed(3)
    feed = _feed(x, y, batch_size=8, replicas=2, shuffle=True)
    got = []
    for _ in range(3):
        got.append(_epoch(feed).tolist())
        np.random.permutation(9)
    assert got == [e.tolist() for e in expected]


def test_arrays_carry_sample_weights():
    x, y = _ids(6)
    sw = np.arange(1, 7, dtype="float32")
    [batch] = _batches(_feed(x, y, sw, batch_size=6, replicas=4))
    _, _, weights = engine.untag(batch)
    assert weights.tolist() == [1, 2, 3, 4, 5, 6]


def test_arrays_without_padding_are_not_tagged():
    x, y = _ids(12)
    assert len(_batches(_feed(x, y, batch_size=4, replicas=2))[0]) == 2  # (x, y)
    assert len(_batches(_feed(x, y, np.ones(12), batch_size=4, replicas=2))[0]) == 3
    # One padded batch anywhere tags every batch: Keras fixes the layout from the first.
    assert isinstance(_batches(_feed(x, y, batch_size=5, replicas=2))[0][0], dict)


# -- Feed: streams ---------------------------------------------------------------------


class _Numbered(keras.utils.PyDataset):
    """Batch i holds rows whose x and y are i."""

    def __init__(self, batches=6, rows=3, **kwargs):
        super().__init__(**kwargs)
        self.batches, self.rows_per_batch = batches, rows
        self.begun = self.ended = 0

    def __len__(self):
        return self.batches

    def __getitem__(self, index):
        return (np.full((self.rows_per_batch, 1), index, "float32"),
                np.full(self.rows_per_batch, index, "float32"))

    def on_epoch_begin(self):
        self.begun += 1

    def on_epoch_end(self):
        self.ended += 1


def test_a_py_dataset_comes_in_the_order_keras_draws():
    from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter

    keras.utils.set_random_seed(11)
    adapter = PyDatasetAdapter(_Numbered(), shuffle=True)
    expected = []
    for _ in range(3):
        adapter.on_epoch_begin()
        expected.append([int(bx[0, 0]) for bx, _ in adapter.get_jax_iterator()])
        adapter.on_epoch_end()
    keras.utils.set_random_seed(11)
    feed = _feed(_Numbered(), batch_size=None, replicas=2, shuffle=True)
    got = [[int(engine.untag(batch)[0][0, 0]) for batch in _batches(feed)] for _ in range(3)]
    assert got == expected
    assert sorted(got[0]) == list(range(6)) and got[0] != got[1]


def test_a_py_datasets_epoch_hooks_reach_it():
    inner = _Numbered()
    feed = _feed(inner, batch_size=None, replicas=2)
    feed.on_epoch_begin()
    feed.on_epoch_end()
    assert (inner.begun, inner.ended) == (1, 1)


def test_a_torch_data_loader_comes_in_the_order_it_draws():
    """A DataLoader that shuffles draws its seeds from torch's generator when its iteration
    starts: the Feed starts it when Keras would, so the order is one device's."""
    torch = pytest.importorskip("torch")
    data = torch.utils.data.TensorDataset(torch.arange(12.0).reshape(12, 1), torch.arange(12.0))

    def loader():
        return torch.utils.data.DataLoader(data, batch_size=5, shuffle=True)

    torch.manual_seed(5)
    expected = [[int(v) for v in by] for _, by in loader()]
    torch.manual_seed(5)
    feed = _feed(loader(), batch_size=None, replicas=2)
    feed.on_epoch_begin()
    got = [[int(v) for v in engine.untag(batch)[1]] for batch in feed.get_torch_dataloader()]
    assert got == expected


# -- as_padded --------------------------------------------------------------------------


def test_as_padded_arrays():
    x, y = _ids(10)
    data, feed = as_padded(x, y, batch_size=4, replicas=3, tag=TAG)
    assert data is feed
    assert isinstance(feed, Feed) and feed.num_batches == 3


def test_as_padded_default_batch_size_is_32():
    x, y = _ids(40)
    _, feed = as_padded(x, y, replicas=2, tag=TAG)
    assert feed.batch_size == 32


def test_as_padded_passes_a_feed_through():
    x, y = _ids(4)
    feed = _feed(x, y, batch_size=4, replicas=2)
    assert as_padded(feed, replicas=2, tag=TAG) == (feed, feed)


def test_as_padded_refuses_none():
    with pytest.raises(ValueError, match=r"x=None"):
        as_padded(None, replicas=2, tag=TAG)


def test_as_padded_refuses_a_bad_shuffle():
    with pytest.raises(ValueError, match=r"shuffle must be True, False or 'batch'.*'yes'"):
        as_padded(*_ids(4), replicas=2, tag=TAG, shuffle="yes")


def test_as_padded_refuses_row_mismatch():
    with pytest.raises(ValueError, match=r"x has 5 rows but y has 4") as info:
        as_padded(np.zeros((5, 2)), np.zeros(4), replicas=2, tag=TAG)
    assert type(info.value) is ValueError


def test_as_padded_refuses_sample_weight_mismatch():
    with pytest.raises(ValueError, match=r"x has 5 rows but sample_weight has 6"):
        as_padded(np.zeros((5, 2)), np.zeros(5), np.ones(6), replicas=2, tag=TAG)


def test_as_padded_refuses_y_with_a_generator():
    def batches():
        yield np.zeros((2, 2)), np.zeros(2)

    with pytest.raises(ValueError, match=r"y must be None") as info:
        as_padded(batches(), np.zeros(2), replicas=2, tag=TAG)
    assert "generator" in str(info.value)


def test_as_padded_refuses_drop_remainder_with_a_py_dataset():
    with pytest.raises(ValueError, match=r"drop_remainder=True") as info:
        as_padded(_Numbered(), replicas=2, tag=TAG, drop_remainder=True)
    assert "_Numbered" in str(info.value)


def test_as_padded_wraps_a_py_dataset():
    data, feed = as_padded(_Numbered(rows=3), replicas=2, tag=TAG)
    assert data is feed
    tagged = _batches(feed)[1]
    assert _padded_parts(tagged)[0].shape == (4, 1)
    x, y = engine.untag(tagged)
    assert x.shape == (3, 1) and y.tolist() == [1, 1, 1]


@pytest.mark.parametrize("x", [5, 2.5, "abc", b"abc"], ids=["int", "float", "str", "bytes"])
def test_as_padded_refuses_unsupported_types(x):
    with pytest.raises(TypeError, match=rf"Received: x of type {type(x).__name__}\."):
        as_padded(x, replicas=2, tag=TAG)


def test_as_padded_refuses_a_list_of_python_numbers():
    with pytest.raises(TypeError, match=r"x of type list"):
        as_padded([1, 2, 3], replicas=2, tag=TAG)


# -- doctests --------------------------------------------------------------------------


def test_module_doctests():
    results = doctest.testmod(keras_multigpu.batching, verbose=False)
    assert results.attempted > 0
    assert results.failed == 0
