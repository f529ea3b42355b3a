"""Keras's random draws made by XLA inside the TensorFlow engine's steps, where the model
asks for XLA, so that they are one device's.

One device runs a model compiled with `jit_compile=True` (Keras's choice for "auto" on a
machine with a GPU) as one XLA program, and XLA's stateless random ops draw other numbers
than TensorFlow's own kernels from the same seed. tf.distribute's replica steps run
without XLA (Keras turns it off under tf.distribute, and a replica sees batches of
varying size). So where the model asks for XLA, each of Keras's draws inside a replica's
step (`rules_random`'s) runs as a small XLA program of its own, which draws what the
same draw inside one device's XLA step draws.
"""

import contextlib
import functools
import inspect

import tensorflow as tf

from keras_multigpu._keras import seed_generator
from keras_multigpu.rules_random import Drawn


class _Wanted:
    on = False  # read in the replicas' threads: not a thread-local


_wanted = _Wanted()


@contextlib.contextmanager
def drawing(distribution):
    """`distribution`'s choice of XLA draws in force for the duration (a call's)."""
    before, _wanted.on = _wanted.on, getattr(distribution, "xla_draws", False)
    try:
        yield
    finally:
        _wanted.on = before


def by_xla(rule):
    """`rule` (a draw's, which calls Keras's draw `original`), handed Keras's draw made by
    XLA where the call's model asks for XLA."""

    @functools.wraps(rule)
    def xla_rule(replica, original, *args, **kwargs):
        return rule(replica, _compiled(original) if _wanted.on else original, *args, **kwargs)

    return xla_rule


@functools.cache
def _compiled(original):
    """Keras's draw `original` as an XLA program, its seed drawn first (a generator moves
    on once, outside it) and handed in as a tensor."""
    signature = inspect.signature(original)

    @tf.function(jit_compile=True, autograph=False)
    def run(seed, arguments):
        return original(**arguments, seed=Drawn(seed))

    @functools.wraps(original)
    def draw(*args, **kwargs):
        arguments = dict(signature.bind(*args, **kwargs).arguments)
        seed = seed_generator.draw_seed(arguments.pop("seed", None))
        return run(seed, arguments)

    return draw
