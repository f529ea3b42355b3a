"""Ctrl-C or SIGTERM during `fit`, `evaluate` and `predict`: stop at a step boundary, or at once.

Python raises `KeyboardInterrupt` wherever the main thread happens to be when
the signal lands: inside a device wait, inside a half-written file, or inside
Keras's per-batch log conversion, whose bare `except` swallows it (so a
plain Keras `fit` often keeps running). Here the first Ctrl-C only asks for a
stop: the next step boundary raises `Interrupted` (a `KeyboardInterrupt`) from
the loop itself, after the step in flight and its callbacks have finished,
so no save is cut short. A second Ctrl-C ends the process at once, with
SIGINT's own exit status, whatever the main thread is doing.

SIGTERM, which a scheduler sends before it takes a machine back (SLURM's preemption and
`scancel`, Kubernetes's eviction, `kill`), does the same: the first stops at the next step
boundary (where `Checkpoint` saves), a second signal ends the process at once. Without
this, SIGTERM ends a Python process at once, and the steps since the last save are lost.
A handler of the script's own for SIGTERM (or SIGTERM ignored) is left as it is.

Only the process that called `fit` defers: a process forked during the call (a PyDataset's
`use_multiprocessing=True` workers, which Keras's pool ends with SIGTERM) gets the signals'
earlier handlers back, so it ends as it would without the library.
"""

import contextlib
import os
import signal
import sys
import threading

import keras


class Interrupted(KeyboardInterrupt):
    """Raised at the step boundary after a Ctrl-C or SIGTERM (a `KeyboardInterrupt`).

    `signum` is the signal this process received (`signal.SIGINT` or `signal.SIGTERM`),
    or None where another process asked for the stop."""

    def __init__(self, message, signum=None):
        super().__init__(message)
        self.signum = signum


_NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


class _State:
    signal = None  # the signal that asked this call to stop (None: none came)
    depth = 0
    # Processes that train together must stop at the same step: an engine with
    # several processes sets this to a function that tells whether any of them
    # was asked to stop (`set_agreement`).
    agree = staticmethod(lambda requested: requested)
    # A stop flag the processes already summed in a step's own collective (`agreed`),
    # which the next boundary takes instead of asking `agree`.
    agreed = None
    # While a call defers: the process that set the handlers, and the handlers they replaced.
    pid = None
    previous = {}

    def leave(self):
        """Out of any call: nothing deferred, no handler taken over."""
        self.depth, self.signal, self.pid, self.previous = 0, None, None, {}


_STATE = _State()


def set_agreement(agree):
    """Makes every step boundary ask `agree(requested)` whether to stop (every process
    calls it at the same boundaries, so they stop together)."""
    _STATE.agree = agree


def requested():
    """Whether this process was asked to stop during this call (a Ctrl-C or SIGTERM)."""
    return _STATE.signal is not None


def agreed(stop):
    """Tells the next step boundary what every process agreed: whether any of them was
    asked to stop, as an engine learns it from a collective that every process ran in the
    same step (the metrics' all-reduce). That boundary asks `agree` nothing. `stop` is
    read there (`bool(stop)`: a device tensor waits until then)."""
    _STATE.agreed = stop


_FORKING = threading.local()  # the forking thread's signal mask, while it forks in a call


def _before_fork():
    """Blocks the signals in the forking thread while it forks during a call: a child's
    Python drops a signal caught before its `_in_child` (Keras's pool may end a worker it
    has just forked), so the child must hold it pending until its handler is the earlier."""
    if _STATE.previous:
        _FORKING.mask = signal.pthread_sigmask(signal.SIG_BLOCK, set(_STATE.previous))


def _unblock():
    """The forking thread's mask as it was before the fork (`_before_fork`)."""
    mask = getattr(_FORKING, "mask", None)
    if mask is not None:
        _FORKING.mask = None
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _in_child():
    """After a fork during a call: the signals' earlier handlers, in the child only, which
    is in no call of its own (a `fit` it runs later defers afresh); then a signal held
    pending since the fork lands on them."""
    for signum, previous in _STATE.previous.items():
        try:
            signal.signal(signum, previous)
        except (ValueError, OSError):  # `_handler` then acts as `previous` would
            break
    else:
        _STATE.leave()
    _unblock()


os.register_at_fork(before=_before_fork, after_in_parent=_unblock, after_in_child=_in_child)


def _as_before(signum, frame):
    """A signal in a process forked during a call: what its earlier handler would do."""
    previous = _STATE.previous.get(signum, signal.SIG_DFL)
    if callable(previous):
        return previous(signum, frame)
    if previous == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)


def _handler(signum, frame):
    if os.getpid() != _STATE.pid:
        return _as_before(signum, frame)
    name = _NAMES[signum]
    if _STATE.signal is not None:  # the second signal: exit now, as an unhandled one does
        sys.stderr.write(f"\nSecond {name}: exiting now.\n")
        sys.stderr.flush()
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)
        return
    _STATE.signal = signum
    again = "press Ctrl-C" if signum == signal.SIGINT else "send it"
    sys.stderr.write(f"\n{name}: stopping after the current step ({again} again to exit at "
                     "once).\n")
    sys.stderr.flush()


@contextlib.contextmanager
def deferred():
    """Defers SIGINT, and SIGTERM at its default, to the next step boundary while the
    block runs.

    Nests (a validation `evaluate` inside `fit` shares the outer handler).
    Outside the main thread, where no signal handler can be set, it does
    nothing and both signals behave as Python's default. SIGINT ignored (a
    background job) or handled outside Python is left alone, and so is a SIGTERM
    that is not at its default.
    """
    if _STATE.depth or threading.current_thread() is not threading.main_thread():
        _STATE.depth += 1
        try:
            yield
        finally:
            _STATE.depth -= 1
        return
    previous = {signum: signal.getsignal(signum) for signum in _NAMES}
    if previous[signal.SIGINT] in (signal.SIG_IGN, None):
        del previous[signal.SIGINT]
    if previous[signal.SIGTERM] != signal.SIG_DFL:
        del previous[signal.SIGTERM]
    _STATE.signal, _STATE.depth = None, 1
    _STATE.pid, _STATE.previous = os.getpid(), previous  # the handlers taken over
    for signum in previous:
        signal.signal(signum, _handler)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _STATE.leave()


class StopOnInterrupt(keras.callbacks.Callback):
    """Raises `Interrupted` at the first boundary after a Ctrl-C or SIGTERM (in any of the
    processes that train together).

    Checked before each step (and each epoch), in the thread that runs the
    loop, so the exception leaves Keras's loop through its own `finally`,
    which writes the trained weights back to the model.
    """

    async_safe = True

    def _check(self, *args, **kwargs):
        stop, _STATE.agreed = _STATE.agreed, None
        if stop is None:
            stop = _STATE.agree(requested())
        if bool(stop):
            if _STATE.signal is None:
                raise Interrupted("Stopped at a step boundary: another process was asked to "
                                  "stop (Ctrl-C or SIGTERM).")
            raise Interrupted(f"Stopped by {_NAMES[_STATE.signal]} at a step boundary.",
                              _STATE.signal)

    on_epoch_begin = on_train_batch_begin = on_test_batch_begin = _check
    on_predict_batch_begin = _check

    def _forget(self, *args, **kwargs):
        # A flag agreed in a step belongs to that call: every process forgets it at the
        # same points (a validation run inside `fit` starts with a fresh exchange too).
        _STATE.agreed = None

    on_train_begin = on_test_begin = on_predict_begin = _forget
    on_train_end = on_test_end = on_predict_end = _forget


def end_training(callback_list, logs=None):
    """Runs the end-of-training hooks after an interruption.

    Callbacks with an `on_interrupt()` (`Checkpoint`) run it first. Every
    callback's `on_train_end` runs, except `BackupAndRestore`'s: it
    deletes its backup when training *finished*, and an interrupted run must
    keep it so that the next `fit` resumes, as after a crash.
    """
    for callback in callback_list.callbacks:
        on_interrupt = getattr(callback, "on_interrupt", None)
        if on_interrupt is not None:  # keras_multigpu.callbacks.Checkpoint saves here
            on_interrupt()
    for callback in callback_list.callbacks:
        if isinstance(callback, keras.callbacks.BackupAndRestore):
            continue
        callback.on_train_end(logs or {})


def with_stop(callbacks):
    """`callbacks` (None, a list or a `CallbackList`) with a `StopOnInterrupt` added."""
    stop = StopOnInterrupt()
    if isinstance(callbacks, keras.callbacks.CallbackList):
        if not any(isinstance(c, StopOnInterrupt) for c in callbacks.callbacks):
            callbacks.callbacks.append(stop)
        return callbacks
    callbacks = list(callbacks or [])
    return [*callbacks, stop]
