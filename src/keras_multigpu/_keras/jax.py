"""Keras's JAX internals the JAX engine and the bench use (see `keras_multigpu._keras`).

Patched with several processes: `distribution_lib.{distribute_data_input,
distribute_tensor}` (each process places the rows of the global batch that its devices
hold). The bench times `trainer._distribute_data` with the compiled step alone.
"""

from keras_multigpu._keras import load

TABLE = {
    "keras.src.backend.jax.distribution_lib": ("distribute_data_input", "distribute_tensor"),
    "keras.src.backend.jax.trainer": ("_distribute_data",),
}

distribution_lib, trainer = load(TABLE, "the JAX engine")
