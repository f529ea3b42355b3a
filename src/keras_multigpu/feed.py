"""`Feed`: a Keras data adapter around Keras's own adapter for the user's data, which pads
each batch it yields (see `batching`). The order is Keras's: nothing here re-draws a
shuffle; a `Feed` keeps the generators each pass drew from, for an exact resume."""

import concurrent.futures
import warnings
import weakref

import numpy as np
from keras import tree

from keras_multigpu._keras import data_adapters
from keras_multigpu.batching import (
    _to_numpy,
    check_batched,
    global_generators,
    is_text,
    set_global_generators,
)


class Feed(data_adapters.data_adapter.DataAdapter):
    """Keras's own data adapter for the user's data (`inner`), its batches padded.

    Keras's epoch iterator drives this adapter as it would drive `inner`, and
    every call reaches `inner` when Keras would make it: `inner`'s iterators are
    made when Keras makes this adapter's, `on_epoch_begin`/`on_epoch_end` pass
    through. So the order of the batches, and each random draw Keras's adapters
    make for it (NumPy's or Python's generators, a `DataLoader`'s seeds, a
    tf.data reshuffle, per-epoch seeds on newer Keras), is Keras's own, on
    whichever Keras is installed. Each batch `inner` yields then goes through
    `serve`, which pads it for the replicas and tags it (see `pad_batch`).

    Array inputs go through Keras's array adapter as their row indices
    (`np.arange(n)`, batched and shuffled by Keras): `serve` then gathers those
    rows, on the devices (`take`) or from the host (`put` places them, while a
    thread prepares the next batch).

    A checkpoint (`callbacks.Checkpoint`) keeps where an epoch is: the global
    generators as its pass began (`position`), the batches served, and the
    epoch ends `inner` has seen; `resume` makes the next pass draw the same
    order again and serve only its batches from `skip` on.

    Args:
        inner: Keras's adapter for the data (`data_adapters.get_data_adapter`).
        serve: a host batch from `inner` (NumPy) -> the batch handed to Keras.
        replicas: the device count.
        num_batches: batches per epoch (None: `inner`'s).
        arrays: `(x, y, sample_weight)` when `inner` yields their row indices.
        resident: `serve` gathers them on the devices.
        prefetch: `serve` may prepare the next batch in a thread (its input
            is pulled from `inner` beside the current one: only where that
            draws nothing).
        engine_state, set_engine_state: the engine's global generator (torch's).
        to_backend: turns a served batch into the tensors the backend's
            trainer takes from a `DataLoader` (torch).
    """

    def __init__(self, inner, serve, *, replicas, num_batches=None, arrays=None, resident=False,
                 prefetch=False, engine_state=None, set_engine_state=None, to_backend=None):
        self.inner = inner
        self.serve = serve
        self.replicas = replicas
        self.arrays = arrays
        # Arrays gathered on the devices: serving a batch is device work, not the host's
        # (DeviceMonitor times `pad`, the host's part).
        self.resident = resident
        self._num_batches = num_batches
        self._prefetch = prefetch
        self._engine_state, self._set_engine_state = engine_state, set_engine_state
        self._to_backend = to_backend
        self._executor = None
        self.skip = 0  # a resumed epoch: its first `skip` batches are not served
        self.ends = 0  # `on_epoch_end` calls `inner` has had
        self._pass_state = None  # the global generators as the current epoch began
        self._served = []  # the current pass's batches as read (array inputs: row indices)
        self._resume = None  # what the next epoch's pass restores (see `resume`)
        self._restore_now = None  # the generators to set once a resumed pass has drawn
        self._not_an_end = False  # the next on_epoch_end is a new Keras call's start
        self._signature = self._inner_tf = None
        self.failed = None  # the error `pad` raised on tf.data's threads
        self.source = None  # the user's data, where it is not arrays (`inputs.as_padded`)

    # -- Keras's DataAdapter ------------------------------------------------

    @property
    def num_batches(self):
        total = self._num_batches if self._num_batches is not None else self.inner.num_batches
        return None if total is None else total - self.skip

    @property
    def batch_size(self):
        return self.inner.batch_size

    @property
    def has_partial_batch(self):
        return self.inner.has_partial_batch

    @property
    def partial_batch_size(self):
        return self.inner.partial_batch_size

    def on_epoch_begin(self):
        self._not_an_end = False  # (only an end before the next epoch begins is skipped)
        resume, self._resume = self._resume, None
        if resume is not None:
            # The resumed epoch draws its order from the generators as they were when it
            # began (and from `inner` at the same epoch count: newer Keras seeds by it);
            # once its skipped batches are drawn, they are set as at the checkpoint.
            self._replay_ends(resume.get("ends"))
            set_global_generators(resume["generators"], self._set_engine_state)
            self._restore_now = resume.get("now")
        self._pass_state = global_generators(self._engine_state)
        self._pass_state["ends"] = self.ends
        self._served = []
        self.inner.on_epoch_begin()

    def on_epoch_end(self):
        if self._not_an_end:
            self._not_an_end = False
            return
        self.ends += 1
        self.inner.on_epoch_end()

    def continue_epochs(self):
        """After a resumed epoch's Keras call, the next call trains the epochs after it.

        Its batches are whole again, and the `on_epoch_end` Keras's new epoch iterator
        calls as it starts is not passed on: in one uninterrupted call, one epoch end
        separates two epochs (Keras's adapters count them: newer Keras seeds its orders by
        that count)."""
        self.skip = 0
        self._not_an_end = True

    def get_numpy_iterator(self):
        return self._pass(self.inner.get_numpy_iterator)

    def get_jax_iterator(self):
        # NumPy from `inner` (its draws are those of its JAX iterator): the batch is padded,
        # and placed (`serve`), on the host.
        return self._pass(self.inner.get_numpy_iterator)

    def get_torch_dataloader(self):
        loader = self.inner.get_torch_dataloader()  # made when Keras would make it
        return _Passes(self, loader)

    def get_tf_dataset(self):
        import tensorflow as tf

        if self._inner_tf is None:
            # Made once, as in one Keras call: a resumed fit makes one call for the rest of
            # its epoch and another for the epochs after it (newer Keras seeds the array
            # order by the epoch count when the pipeline is made).
            self._inner_tf = self.inner.get_tf_dataset()
        dataset = self._inner_tf
        if self.skip:
            dataset = dataset.skip(self.skip)
        spec = dataset.element_spec
        if self._signature is None:
            self._signature = self._output_signature(spec)
        out_spec, flat_out = self._signature, tree.flatten(self._signature)

        # tf.numpy_function keeps its function as long as TensorFlow's global graph (the
        # process): it reaches the feed, and so the model, through a weak reference alone.
        feed = weakref.ref(self)

        def mapped(*element):
            # tf.data passes a tuple's parts as arguments, each whole: the step takes leaves.
            out = tf.numpy_function(lambda *flat: feed()._serve_flat(spec, flat_out, flat),
                                    tree.flatten(element), [s.dtype for s in flat_out],
                                    stateful=True)
            for tensor, s in zip(out, flat_out):
                tensor.set_shape(s.shape)
            return tree.pack_sequence_as(out_spec, out)

        dataset = dataset.map(mapped)
        if not isinstance(self.inner, data_adapters.TFDatasetAdapter):
            # A pipeline Keras made (arrays, PyDataset, a generator), whose options no user
            # set: without autotuning, dropping its iterator each epoch does not wait for
            # the autotuning thread (see `_tf_rules.without_autotune`). A user's tf.data
            # dataset keeps its own options.
            options = tf.data.Options()
            options.autotune.enabled = False
            dataset = dataset.with_options(options)
        return dataset

    def _serve_flat(self, spec, flat_out, flat):
        """`get_tf_dataset`'s step on tf.data's threads: one batch of `inner`'s leaves, padded."""
        batch = tree.pack_sequence_as(spec, [np.asarray(a) for a in flat])
        if self._restore_now is not None:  # the resumed pass has drawn its order
            set_global_generators(self._restore_now, self._set_engine_state)
            self._restore_now = None
        self._served.append(np.asarray(tree.flatten(batch)[0]) if self.arrays else None)
        try:
            out = tree.flatten(self.pad(batch))
        except Exception as error:  # TensorFlow re-raises it as its own (`raise_failed`)
            self.failed = error
            raise
        return [np.asarray(leaf, s.dtype.as_numpy_dtype) for leaf, s in zip(out, flat_out)]

    # -- the passes -----------------------------------------------------------

    def next_from(self, iterator):
        """The next batch of `inner`'s (one place for the fetch, which DeviceMonitor times)."""
        return next(iterator)

    def pad(self, batch):
        return self.serve(batch)

    def host_parts(self, future):
        """Waits for a batch prepared in the background (the wait DeviceMonitor times)."""
        return future.result()

    def _pass(self, make):
        """One pass: `inner`'s batches from `make()`, served (a generator: nothing is made
        until Keras asks for the first batch, as with `inner`'s own)."""
        return self._served_from(iter(make()))

    def _served_from(self, iterator):
        total = self.num_batches
        count = 0
        for _ in range(self.skip):  # a resumed epoch: the batches done are drawn, not served
            self._served.append(self._read(self.next_from(iterator)))
        if self._restore_now is not None:
            set_global_generators(self._restore_now, self._set_engine_state)
            self._restore_now = None
        self._check_order()
        pending = None
        while total is None or count < total:
            if pending is not None:
                read, future = pending
                pending = None
                batch = self.host_parts(future)
            else:
                try:
                    read = self._read(self.next_from(iterator))
                except StopIteration:
                    return
                batch = self.serve(read) if self.resident else self.pad(read)
            self._served.append(read if self.arrays is not None else None)
            count += 1
            if self._prefetch and (total is None or count < total):
                try:
                    following = self._read(self.next_from(iterator))
                except StopIteration:
                    following = None
                if following is not None:
                    pending = (following, self._background(following))
            yield batch

    def _read(self, batch):
        batch = _to_numpy(batch)
        if self.arrays is not None:  # Keras's array adapter yields `(indices,)`
            return np.asarray(tree.flatten(batch)[0]).astype("int64")
        return batch

    def _background(self, read):
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="keras_multigpu-prefetch")
        return self._executor.submit(self.serve, read)

    def _check_order(self):
        """A resumed pass must draw the checkpoint's order again (arrays: the rows)."""
        expected, self._expected = getattr(self, "_expected", None), None
        if expected is None or self.arrays is None:
            return
        drawn = self._served[:len(expected)]
        if not all(np.array_equal(a, b) for a, b in zip(drawn, expected)):
            warnings.warn(
                "The resumed epoch's data order differs from the checkpoint's: its data or "
                "`shuffle` differ from the run that wrote it, or the generators it was drawn "
                "from could not be restored (set a seed, e.g. keras.utils.set_random_seed, "
                "before building the model). Its remaining batches come in this run's order.",
                stacklevel=4,
            )

    def _replay_ends(self, ends):
        while ends is not None and self.ends < ends:
            self.on_epoch_end()

    def _output_signature(self, spec):
        """The TF signature of served batches: `serve` on two made-up batches (1 and 2
        rows) of `inner`'s spec, which draws nothing and reads no data."""
        check_batched([tuple(s.shape.as_list()) if getattr(s, "shape", None) is not None
                       and s.shape.rank is not None else None for s in tree.flatten(spec)])

        def made_up(rows):
            def leaf(s):
                if not hasattr(s, "shape"):  # None in the batch (tf.data's OptionalSpec)
                    return None
                shape = [rows if d is None else d for d in s.shape.as_list()]
                shape[0] = rows
                if s.dtype.name == "string":
                    return np.full(shape, b"", object)
                if self.arrays is not None:
                    return np.zeros(shape, s.dtype.as_numpy_dtype)
                return np.ones(shape, s.dtype.as_numpy_dtype)
            return tree.map_structure(leaf, spec)

        served = [tree.map_structure(np.asarray, self.serve(made_up(rows)))
                  for rows in (1, self.replicas + 1)]  # padded sizes that differ
        # Keras's spec reads numbers: text (a TensorFlow model may take it) is stood in for.
        text = [is_text(leaf) for leaf in tree.flatten(served[0])]
        served = [tree.pack_sequence_as(batch, [
            np.zeros(np.shape(leaf), "float32") if t else leaf
            for leaf, t in zip(tree.flatten(batch), text)]) for batch in served]
        signature = data_adapters.data_adapter_utils.get_tensor_spec(served)
        if any(text):
            import tensorflow as tf

            signature = tree.pack_sequence_as(signature, [
                tf.TensorSpec(s.shape, tf.string) if t else s
                for s, t in zip(tree.flatten(signature), text)])
        # tf.data reads a list as one tensor: lists become tuples, as Keras's adapters do.
        return tree.lists_to_tuples(signature)

    # -- exact resume (see `keras_multigpu.callbacks.Checkpoint`) ----------------

    @property
    def resumable(self):
        """Whether an epoch can resume in its middle: its batches are drawn again in the
        same order (arrays, and a PyDataset of known length)."""
        if self.arrays is not None:
            return True
        return isinstance(self.inner, data_adapters.PyDatasetAdapter) and (
            self.inner.py_dataset.num_batches is not None)

    def position(self):
        """Where the current epoch is: the generators as it began, and (arrays) the rows of
        each batch read."""
        if self._pass_state is None:
            return None
        order = [b for b in self._served if b is not None] if self.arrays is not None else None
        return {"generators": self._pass_state, "order": order}

    def _generators(self):
        """The generators as they are now (what the next pass draws from), and the epoch
        ends `inner` has seen."""
        state = global_generators(self._engine_state)
        state["ends"] = self.ends
        return state

    def resume(self, state, skip):
        """Makes the next epoch's pass resume from `state` (`position()` and `_generators()`
        of a checkpoint): drawn from the same generators, serving batches from `skip` on."""
        self.skip = int(skip)
        if skip and not self.resumable:
            raise ValueError(
                f"This input ({type(self.inner).__name__}) cannot resume in the middle of an "
                "epoch (its batches are not drawn again in the same order). Checkpoint at "
                "epoch ends only (Checkpoint(save_freq='epoch')), or pass arrays or a "
                "keras.utils.PyDataset.")
        self._expected = state.get("order")
        if skip:
            self._resume = {"generators": state["generators"], "now": state.get("now"),
                            "ends": (state["generators"] or {}).get("ends")}
        else:  # an epoch's end: the next pass draws from the generators as they were
            self._replay_ends((state.get("now") or {}).get("ends"))
            if state.get("now") is not None:
                set_global_generators(state["now"], self._set_engine_state)

    def close(self):
        """Ends the prefetch thread, if any (a later pass starts it again), and drops the
        error a batch raised (its frames hold the call's tf.data iterators)."""
        self.failed = None
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    @property
    def leaves_iterators(self):
        """Whether Keras's TensorFlow call over this feed left its tf.data iterators alive.

        Over a generator, Keras's TensorFlow epoch iterator and its Python generator hold
        each other: the call's tf.data iterators outlive it, in a reference cycle. Freed by
        a later collection, which may run mid-trace in any thread, each one's destructor
        waits out its autotuning thread's period (which grows to a minute) while holding
        the GIL: the whole process stood still for 2-3 minutes. The call's end frees them
        (`_calls._close`), while those periods are short (0.2 s here, measured).
        """
        return (self._inner_tf is not None
                and isinstance(self.inner, data_adapters.GeneratorDataAdapter))


class _Passes:
    """What a `Feed` hands Keras's torch trainer for a `DataLoader`: each iteration starts
    `inner`'s loader's own iteration at once (its seeds are drawn when Keras would draw
    them) and serves its batches as torch tensors."""

    def __init__(self, feed, loader):
        self.feed, self.loader = feed, loader

    def __iter__(self):
        iterator = iter(self.loader)
        convert = self.feed._to_backend or (lambda batch: batch)
        return (convert(batch) for batch in self.feed._served_from(iterator))

    def __len__(self):
        return len(self.loader)
