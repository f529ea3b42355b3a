"""Keras's TensorFlow internals the TensorFlow engine uses (see `keras_multigpu._keras`).

Patched for a call: `keras.optimizers.Optimizer.{apply, _all_reduce_sum_gradients,
_backend_apply_gradients}` (the last two are the TensorFlow optimizer's), `random.{normal,
uniform, truncated_normal, randint, dropout}`; with several workers,
`trainer.reduce_per_replica`.
"""

from keras_multigpu._keras import load

DRAWS = ("normal", "uniform", "truncated_normal", "randint")

TABLE = {
    "keras.optimizers": ("Optimizer._all_reduce_sum_gradients",
                         "Optimizer._backend_apply_gradients"),
    "keras.src.backend.tensorflow.random": (*DRAWS, "dropout", "_get_concrete_noise_shape"),
    "keras.src.backend.tensorflow.trainer": ("reduce_per_replica",
                                             "_collective_all_reduce_multi_worker"),
}

_, random, trainer = load(TABLE, "the TensorFlow engine")
