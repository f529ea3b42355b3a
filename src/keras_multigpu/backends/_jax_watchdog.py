"""Keras's compiled JAX steps, wrapped: the watchdog (a step stuck in a collective ends the
process with a message), and the model's state kept when a step raises (`kept`) or a call
raises between steps (`put_back`)."""

import atexit
import collections
import contextlib
import functools
import os
import sys
import threading
import time

import jax

from keras_multigpu import devices as devices_lib

TIMEOUT_ENV = devices_lib.TIMEOUT_ENV
_timeout = devices_lib.collective_timeout


# -- the watchdog ------------------------------------------------------------------
#
# A collective that never completes (XLA:CPU devices that deadlock, a process that hangs
# inside a step) blocks inside XLA, where no Python exception can reach it, and XLA's own
# CPU timeout is set past KERAS_MULTIGPU_TIMEOUT (`_xla`). So each step Keras dispatches is
# watched: when no step has finished for KERAS_MULTIGPU_TIMEOUT seconds while one is in
# flight, the process says which step waits and why, and exits (the launcher then stops
# the others). Compilation happens before a step is dispatched and does not count.


class _Watchdog:
    def __init__(self, timeout):
        self.timeout = timeout
        self.pending = collections.deque()  # (what, when dispatched, an output array)
        self.done = time.monotonic()
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="keras_multigpu-watchdog",
                                       daemon=True)
        self.thread.start()
        # Stopped before the interpreter finalizes: a daemon thread inside jaxlib then
        # would be unwound through C++ frames, which aborts the process.
        atexit.register(self.stop)

    def stop(self):
        self.stopped.set()
        self.thread.join(timeout=5)

    def dispatched(self, what, outputs):
        # The logs (or predictions), never the state, whose buffers the next step donates.
        logs = outputs[0] if isinstance(outputs, tuple) else outputs
        leaf = next((a for a in jax.tree.leaves(logs) if isinstance(a, jax.Array)), None)
        if leaf is not None:
            with self.lock:
                self.pending.append((what, time.monotonic(), leaf))

    @staticmethod
    def _ready(array):
        try:
            return array.is_ready()
        except Exception:  # noqa: BLE001 (a deleted array is done with)
            return True

    def _watch(self):
        while not self.stopped.wait(min(1.0, self.timeout / 10)):
            now = time.monotonic()
            with self.lock:
                while self.pending and self._ready(self.pending[0][2]):
                    self.pending.popleft()
                    self.done = now
                if not self.pending:
                    self.done = now
                    continue
                what, since, _ = self.pending[0]
                waited = now - max(since, self.done)
            if waited > self.timeout:
                _stuck(what, waited)


def _stuck(what, waited):
    devices = jax.devices()
    where = (f"the {jax.process_count()} processes" if jax.process_count() > 1
             else f"this process's {len(devices)} {devices[0].platform.upper()} devices")
    message = (
        f"keras_multigpu: {what} has waited {waited:.0f} s ({TIMEOUT_ENV}="
        f"{_timeout():g}) without finishing: a device waits in a collective across {where} "
        "for another that never joins it (a process that hangs or has stopped, or XLA's CPU "
        "devices deadlocked). Nothing can end that wait from Python: exiting. Raise "
        f"{TIMEOUT_ENV} if one step is this slow for good reason.\n")
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os.write(2, message.encode())
    os._exit(1)


@functools.cache
def _watchdog():
    return _Watchdog(_timeout())


def watch(function, distribution, what):
    """`function` (one of Keras's compiled steps), its dispatches watched (see `_Watchdog`)
    where a collective can wait for ever: across processes, or across CPU devices."""
    devices = distribution.device_mesh.backend_mesh.devices.flat
    several = jax.process_count() > 1 or (
        distribution.device_mesh.backend_mesh.devices.size > 1
        and any(d.platform == "cpu" for d in devices))
    if not several or getattr(function, "_keras_multigpu_watched", False):
        return function

    @functools.wraps(function)
    def watched(*args, **kwargs):
        outputs = function(*args, **kwargs)
        _watchdog().dispatched(what, outputs)
        return outputs

    watched._keras_multigpu_watched = True
    return watched


# -- the state a failed step was given ----------------------------------------------

# The variables of each part of a JAX step's state, in the order Keras's trainer passes them
# (`_get_jax_state`): train steps take all four, test steps the first two and the metrics',
# predict steps the first two.
_STATE = {4: ("trainable_variables", "non_trainable_variables", "optimizer", "metrics_variables"),
          3: ("trainable_variables", "non_trainable_variables", "metrics_variables"),
          2: ("trainable_variables", "non_trainable_variables")}


def kept(function, model):
    """`function` (one of Keras's compiled steps for `model`), which puts the state it was
    given back into the model's variables when it raises.

    Keras's JAX trainer takes the values out of the variables for a call's loop and puts
    them back as the call ends, but not when a step raises (a batch of the wrong shape):
    the model was left with empty variables, and every later call failed. A step that
    raised changed nothing, so the state it was given is the model's."""

    if getattr(function, "_keras_multigpu_kept", False):  # Keras's cached step, kept already
        return function

    @functools.wraps(function)
    def step(state, *args, **kwargs):
        try:
            return function(state, *args, **kwargs)
        except BaseException:
            _restore(model, state)
            raise

    step._keras_multigpu_kept = True
    return step


def put_back(model):
    """After one of Keras's calls on `model` raised between two steps (a Ctrl-C or SIGTERM
    at a step boundary, a callback that failed), puts the state its last step left back into
    the model's variables.

    Keras's JAX `evaluate` and `predict` put it back as their loop ends, but not when it
    raises (`fit` does, in a `finally`): the model was left with empty variables. Where the
    state is back already, this does nothing; where its arrays went to a step that then
    failed (donated), there is none to put back, and the call's own error stands."""
    with contextlib.suppress(RuntimeError):  # JAX's "Array has been deleted"
        model.jax_state_sync()


def _restore(model, state):
    parts = _STATE.get(len(state) if isinstance(state, (tuple, list)) else None)
    if parts is None:
        return
    arrays = [a for values in state for a in values if isinstance(a, jax.Array)]
    if any(a.is_deleted() for a in arrays):  # donated to a step that ran: nothing to restore
        return
    for part, values in zip(parts, state):
        variables = model.optimizer.variables if part == "optimizer" else getattr(model, part)
        for variable, value in zip(variables, values):
            variable.assign(value)  # as Keras's `jax_state_sync` puts a call's state back
