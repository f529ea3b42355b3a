"""Keras's global seed generator inside TensorFlow's replicas: the draws of
`keras.random.normal(shape)` with no seed (keras-io's denoising diffusion model draws its
noise so in its `train_step`), as one device draws them.

Keras keeps that generator per thread (`global_state`), and tf.distribute traces each
replica in a thread of its own: each replica would make one inside the trace, a variable
TensorFlow refuses after the first. Here the main thread's generator exists before a call
replicates its variables (`generator`), and its state is replicated with them, a copy per
replica as a layer's seed state is, which every replica moves on alike. A replica asking
for the global generator gets that one (`global_generator`, a rule of the engine's table),
and so does the main thread during the call (a callback's draw). Its first use takes its
seed from Python's `random` then, as one device's making of it does; a call in which
nothing draws from it leaves none (`forget_unused`).
"""

import random

from keras_multigpu._keras import global_state, seed_generator

_NAME = "global_seed_generator"
_shared = []  # the main thread's generator, for the call


def generator():
    """The main thread's global generator, made now if Keras has made none, with Python's
    `random` left as it was: one device takes its seed from it when its step first draws."""
    made = global_state.get_global_attribute(_NAME)
    if made is None:  # as Keras's `global_seed_generator()` makes it
        state = random.getstate()
        made = seed_generator.SeedGenerator()
        random.setstate(state)
        made._keras_multigpu_unused = True
        global_state.set_global_attribute(_NAME, made)
    _shared[:] = [made]
    return made


def shared():
    """The call's generator (the guard of `global_generator`), else None."""
    return _shared[0] if _shared else None


def global_generator(made, original):
    """`global_seed_generator()` during a call, in a replica's step or in the main thread
    (a callback's draw): the main thread's, `made`. Its first use takes the number from
    Python's `random` that one device takes there, making it."""
    if getattr(made, "_keras_multigpu_unused", False):
        seed_generator.make_default_seed()
        made._keras_multigpu_unused = False
    return made


def forget_unused():
    """After a call: the call's generator, which is dropped where `generator` made it and
    nothing drew from it, so that the main thread has none, as on one device."""
    made = _shared.pop() if _shared else None
    if getattr(made, "_keras_multigpu_unused", False) \
            and global_state.get_global_attribute(_NAME) is made:
        global_state.set_global_attribute(_NAME, None)
    return made
