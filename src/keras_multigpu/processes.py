"""What the processes that train together agree on, written once for every engine.

Each engine joins its processes its own way (`jax.distributed`, `torch.distributed`,
TensorFlow's coordination service) and hands `join` the key-value store they then
share, as a `Store`: a few lines per engine over its own. On it this module keeps the
process rules:

- `exchange`: a small value from every process, in rank order, on every process, with a
  deadline (KERAS_MULTIGPU_TIMEOUT) that names the process that did not arrive;
  `all_gather_object` is the same for JSON-able values;
- `agree_on_random_state`: every process takes process 0's Python, NumPy and engine
  generators, so that shuffling, Keras's default seeds and dropout draw alike;
- `check_same_model`, `check_same_data`: at each call's start, every process holds a model
  of process 0's shapes and dtypes and was given batches of process 0's shapes, or every
  process says how they differ (process 0 warns where only the data's values differ);
- the saves: Keras's `save_model` and `save_weights` (a model's `save`, a
  `ModelCheckpoint`, a direct `keras.saving.save_model(...)`) are written by process 0
  alone, atomically; every other process returns once process 0 has written its
  matching save, or fails with process 0's error;
- the stop agreement: after a Ctrl-C on any process, every process stops at the same step
  boundary (see `interrupt`).

With one process none of it acts.
"""

import contextlib
import functools
import json
import os
import sys
import time
import warnings

from keras_multigpu import _keras, batching, interrupt
from keras_multigpu._io import atomic_path
from keras_multigpu.devices import TIMEOUT_ENV, collective_timeout

_CHUNK = 1 << 20  # characters per key: every engine's store keeps its messages small
_SUFFIXES = (".weights.h5", ".weights.json", ".keras", ".h5", ".hdf5")


class CollectiveError(RuntimeError):
    """The processes that train together lost one: it stopped, or did not arrive within
    KERAS_MULTIGPU_TIMEOUT (at a step boundary, in a step's collective, at a save). The
    message names the process and the wait. Every engine raises it, as
    `keras_multigpu.CollectiveError`."""


class Store:
    """The key-value store an engine's processes share.

    A subclass sets `rank` and `count` and defines `set`, `get` and `delete` over its
    engine's store. `generator` is the engine's own global random generator as a pair of
    functions `(state, set_state)` over JSON-able data, or None where it has none that
    Keras draws from. `alone(function, ...)` runs a save on process 0 alone (the
    TensorFlow engine moves it out of its strategy's scope).
    """

    rank = 0
    count = 1
    generator = None

    def set(self, key, value):
        """Stores the str `value` under `key`, for every process to read."""
        raise NotImplementedError

    def get(self, key, timeout):
        """The str under `key`, once some process has set it; raises past `timeout` s."""
        raise NotImplementedError

    def delete(self, key):
        """Removes `key` (every process that needed it has read it)."""
        raise NotImplementedError

    def alone(self, function, *args, **kwargs):
        return function(*args, **kwargs)


_store = None
_numbers = {}  # what -> how many of it this process did: every process counts alike


def _next(what):
    _numbers[what] = number = _numbers.get(what, 0) + 1
    return number


def join(store):
    """Makes the rules act among `store`'s processes (the engine has joined them).

    The first call installs the saves and the stop agreement; every call has each
    process take process 0's random state.
    """
    global _store
    if store.count <= 1:
        return
    first, _store = _store is None, store
    if first:
        _install_saves()
        interrupt.set_agreement(agree_to_stop)
        _record_failures()
    agree_on_random_state()


def leave():
    """At a process's exit: process 0, which hosts the store on some engines (torch's
    TCPStore, whose server goes with it), stays until every other process has left too, so
    that none loses what it has still to read, such as the outcome of the program's last
    save, which process 0 does not wait for. A process that leaves after an unhandled
    exception does not wait (the others are told by their next collective)."""
    if _store is None:
        return
    with contextlib.suppress(Exception):  # an exit goes on whatever the store says
        _store.set(f"keras_multigpu/left/{_store.rank}", "1")
        if _store.rank == 0 and failure() is None:
            for other in range(1, _store.count):
                _store.get(f"keras_multigpu/left/{other}", collective_timeout())


def failure():
    """The type of the unhandled exception this process is ending with, or None (for
    `leave`, and for the JAX engine, which then leaves at once)."""
    return _failed[0] if _failed else None


def _record_failures():
    previous = sys.excepthook

    def excepthook(kind, value, traceback):
        if not (hasattr(sys, "ps1") or sys.flags.interactive):  # a REPL goes on after one
            _failed.append(kind)
        previous(kind, value, traceback)

    sys.excepthook = excepthook


_failed = []


def rank():
    return _store.rank if _store is not None else 0


def count():
    return _store.count if _store is not None else 1


def _put(key, value):
    chunks = [value[i:i + _CHUNK] for i in range(0, len(value), _CHUNK)] or [""]
    for i, chunk in enumerate(chunks):
        _store.set(f"{key}/{i}", chunk)
    _store.set(f"{key}/count", str(len(chunks)))
    return [f"{key}/{i}" for i in range(len(chunks))] + [f"{key}/count"]


def _lost(what, error):
    """The `CollectiveError` of a store that failed before its timeout: a process has
    stopped (process 0, which holds it: torch's TCPStore, JAX's coordinator, TensorFlow's
    coordination service; or one the store reports)."""
    said = str(error).strip().splitlines()
    return CollectiveError(
        f"Process {_store.rank} of {_store.count}: the store the processes share (process 0 "
        f"holds it) failed at {what}, before {TIMEOUT_ENV}: a process has stopped (see the "
        f"others' output). The store said: {said[0] if said else type(error).__name__}")


def _take(key, what, writer):
    """The value `writer` put under `key`, or a `CollectiveError` naming the wait."""
    timeout = collective_timeout()
    start = time.monotonic()
    try:
        chunks = int(_store.get(f"{key}/count", timeout))
        return "".join(_store.get(f"{key}/{i}", timeout) for i in range(chunks))
    except Exception as error:  # noqa: BLE001 (each engine's store has its own errors)
        if time.monotonic() - start < 0.9 * timeout:
            raise _lost(what, error) from error
        raise CollectiveError(
            f"Process {_store.rank} of {_store.count} waited {timeout:g} s ({TIMEOUT_ENV}) for "
            f"process {writer} at {what}, and it did not get there: it hangs, is far behind, "
            "or has stopped (see its own output). Every process must run the same program; "
            f"raise {TIMEOUT_ENV} if one is slow for good reason."
        ) from error


_written = []  # this process's keys of its last exchange


def exchange(what, value):
    """`value` (a str) from every process, in rank order, on every process.

    Every process must call it at the same point (`what` names it in the error). One
    that does not arrive within KERAS_MULTIGPU_TIMEOUT is named in a `CollectiveError`.
    A process deletes its previous exchange's keys once it has read every process's
    keys of this one: each of them has read the previous ones by then.
    """
    if count() == 1:
        return [value]
    prefix = f"keras_multigpu/exchange/{_next('exchange')}"
    try:
        written = _put(f"{prefix}/{_store.rank}", value)
    except Exception as error:  # noqa: BLE001 (each engine's store has its own errors)
        raise _lost(what, error) from error
    values = [value if r == _store.rank else _take(f"{prefix}/{r}", what, r)
              for r in range(_store.count)]
    for key in _written:
        with contextlib.suppress(Exception):
            _store.delete(key)
    _written[:] = written
    return values


def all_gather_object(value, what="a gather of host figures"):
    """`value` (JSON-able) from every process, in rank order; every process calls it."""
    return [json.loads(v) for v in exchange(what, json.dumps(value))]


def check_same_model(variables):
    """Every process holds the same variables (shapes and dtypes, in order), or every
    process raises a ValueError naming the first that differs: before the collectives pair
    unlike buffers (gloo aborts the process; NCCL hangs or mixes them)."""
    if count() == 1:
        return
    mine = [[list(v.shape), str(v.dtype)] for v in variables]
    everyone = all_gather_object(
        mine, "the start of a call, where every process checks that it holds the same model")
    other = next((r for r, layout in enumerate(everyone) if layout != everyone[0]), None)
    if other is None:
        return
    theirs, first = everyone[other], everyone[0]
    n = min(len(theirs), len(first))
    at = next((i for i in range(n) if theirs[i] != first[i]), n)
    name = f" ({variables[at].path})" if at < len(variables) else ""
    said = (f"variable {at}{name} is {_shown(theirs[at])} on process {other} and "
            f"{_shown(first[at])} on process 0" if at < n else
            f"process {other} has {len(theirs)} variables and process 0 {len(first)}")
    raise ValueError(
        f"The {count()} processes hold different models: {said}. "
        "Every process must build the same model, from the same code and settings (a "
        "hyperparameter search must try the same trial on every process)."
    )


def check_same_data(summary):
    """Every process was handed the same data for a call (`summary`: `inputs.summary`'s).

    Where the batches would differ (rows, batch size, batch count, shapes or dtypes), every
    process raises a ValueError saying how: the processes would run other steps, or pair
    unlike buffers. Where only the values differ, process 0 warns and the call goes on, as
    each process trains on its devices' share of its own data: a shard per rank, or data
    drawn at random before the processes agreed on their random state.
    """
    if count() == 1:
        return
    everyone = all_gather_object(
        summary, "the start of a call, where every process checks that it has the same data")
    other = next((r for r, theirs in enumerate(everyone) if theirs != everyone[0]), None)
    if other is None:
        return
    theirs, first = everyone[other], everyone[0]
    for key, shown in (("rows", "{} rows"), ("batch_size", "batch_size={}"),
                       ("batches", "{} batches")):
        if theirs.get(key) != first.get(key):
            shown_as = [shown.format(v) if key != "rows" or v is not None else "a stream"
                        for v in (theirs.get(key), first.get(key))]
            said = f"{shown_as[0]} on process {other} and {shown_as[1]} on process 0"
            break
    else:
        if theirs["layout"] == first["layout"]:  # the values alone differ
            if rank() == 0:
                warnings.warn(
                    f"The {count()} processes were given different data: {first['rows']} rows "
                    f"on every process, with other values on process {other}. Each process "
                    "trains on its own devices' share of its own data, which one device would "
                    "not: pass the whole dataset, the same on each process, rather than a "
                    "shard per rank; seed data drawn at random "
                    "(keras.utils.set_random_seed(seed) before drawing it).", stacklevel=5)
            return
        arrays = [", ".join(f"{dtype} rows of shape {tuple(shape)}" for shape, dtype in layout)
                  for layout in (theirs["layout"], first["layout"])]
        said = f"arrays of {arrays[0]} on process {other} and of {arrays[1]} on process 0"
    raise ValueError(
        f"The {count()} processes were given different data: {said}. Every process must "
        "pass the whole dataset, the same on each: batch_size is the global batch, and each "
        "process takes its own devices' share of every batch. Do not shard the data by rank "
        "(as a Horovod program does)."
    )


def _shown(layout):
    shape, dtype = layout
    return f"{dtype} of shape {tuple(shape)}"


def agree_to_stop(requested):
    """Whether any process was asked to stop (Ctrl-C): all stop at the same step boundary.

    A process that stopped alone would leave the others waiting in the next step's
    collectives. One exchange of a flag per boundary (every process reaches the same
    boundaries, in the main thread).
    """
    flags = exchange("the step boundary where every process checks for Ctrl-C",
                     "1" if requested else "0")
    return "1" in flags


def agree_on_random_state():
    """Every process takes process 0's Python, NumPy and engine random state.

    Programs that seed nothing, or seed each process differently, still build the same
    model and draw the same batch order and dropout masks everywhere.
    """
    if count() == 1:
        return
    state, set_state = _store.generator or (None, None)
    key = f"keras_multigpu/random/{_next('random')}"
    if _store.rank == 0:
        _put(key, json.dumps(batching.global_generators(state)))
        return
    taken = json.loads(_take(key, "the agreement on process 0's random state", 0))
    batching.set_global_generators(taken, set_state)


# -- saves ----------------------------------------------------------------------


def zero_writes(function):
    """Keras's save `function`, written by process 0 alone (one file, not one per
    process, written atomically). Every process must call it, as an unchanged Keras
    script does: any other process returns once process 0 has written its matching save
    (the file is readable then, on a shared file system), or fails with process 0's error.

    Saves match by file name and count (the 3rd save of `model.keras` on each process),
    not by whole path: a path may hold the process id (the project's `Checkpoint` writes
    into a per-process temporary folder). Process 0 never waits for the others, so the
    saves it makes alone (a `BackupAndRestore`'s, which the other processes run as
    restore-only) cost nothing and shift no count.
    """

    signature = _keras.save_signature(function)

    @functools.wraps(function)
    def wrapper(model, filepath, *args, **kwargs):
        from keras_multigpu._face import TemplateFace  # (it imports this module)

        # The wrapper's own save (Keras's function hands it one) saves its template through
        # this on every process: counted there, once, and not here too on process 0 alone.
        if count() == 1 or isinstance(model, TemplateFace):
            return function(model, filepath, *args, **kwargs)
        named = _keras.by_name(signature, model, filepath, *args, **kwargs)
        if named is not None:
            args, kwargs = (), named
        try:
            path = os.path.abspath(os.fspath(filepath))
        except TypeError:  # a file object: only process 0 writes to it
            return _store.alone(function, model, filepath, *args, **kwargs) \
                if _store.rank == 0 else None
        name = os.path.basename(path)
        number = _next(f"save {name}")
        key = f"keras_multigpu/saved/{number}/{name}"
        if _store.rank == 0:
            suffix = next((s for s in _SUFFIXES if path.endswith(s)), "")
            try:
                if not kwargs.pop("overwrite", True) and os.path.exists(path):
                    raise FileExistsError(f"{path} exists and overwrite=False.")
                if kwargs.get("zipped") is False:  # Keras's unzipped folder, written in place
                    result = _store.alone(function, model, filepath, *args, **kwargs)
                else:
                    with atomic_path(path, suffix) as tmp:
                        result = _store.alone(function, model, tmp, *args, **kwargs)
            except BaseException as error:
                _put(key, json.dumps(f"{type(error).__name__}: {error}"))
                raise
            _put(key, json.dumps(None))
            return result
        what = (f"its save number {number} of {name} (as {path} here; process 0 writes "
                "the file, and every process must save at the same points of the program)")
        outcome = json.loads(_take(key, what, 0))
        if outcome is not None:
            raise RuntimeError(f"Process 0 could not write {name} (save number {number}): "
                               f"{outcome}")
        return None

    wrapper._keras_multigpu_original = function
    return wrapper


def _install_saves():
    """Keras's `save_model` and `save_weights`, wherever Keras offers them
    (`keras.saving.save_model`, `keras.models.save_model`, what `Model.save` calls)."""
    for name in ("save_model", "save_weights"):
        _keras.replace_saving(name, zero_writes, "_keras_multigpu_original")
