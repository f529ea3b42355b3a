"""Keras's torch internals the torch engine uses (see `keras_multigpu._keras`).

Patched for a call: `random.{normal, uniform, truncated_normal, randint, dropout}`.
"""

from keras_multigpu._keras import load

DRAWS = ("normal", "uniform", "truncated_normal", "randint")

TABLE = {
    "keras.src.backend.torch.random": (*DRAWS, "dropout", "_get_concrete_noise_shape"),
}

(random,) = load(TABLE, "the torch engine")
