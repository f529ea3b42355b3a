"""Keras's TensorFlow internals the TensorFlow engine uses (see `keras_multigpu._keras`).

Patched for a call: `TFOptimizer.{apply, _all_reduce_sum_gradients,
_backend_apply_gradients}` (TensorFlow's optimizer class, which `keras.optimizers.Optimizer`
is only while the backend is TensorFlow: this table is checked under any backend),
`random.{normal, uniform, truncated_normal, randint, dropout}`; with several workers,
`trainer.reduce_per_replica`. Called: `trainer.TFEpochIterator._get_iterator` (the
distributed dataset, whose spec describes a batch without making an iterator). And one of
TensorFlow's own, for speed only: `multi_device_iterator_ops._create_device_dataset`
(`_tf_rules.without_autotune`); where a TensorFlow release moved it, calls run without that
patch (`device_datasets` is None).
"""

from keras_multigpu._keras import load

DRAWS = ("normal", "uniform", "truncated_normal", "randint", "gamma", "binomial", "beta")

TABLE = {
    "keras.src.backend.tensorflow.optimizer": (
        "TFOptimizer.apply", "TFOptimizer._all_reduce_sum_gradients",
        "TFOptimizer._backend_apply_gradients"),
    "keras.src.backend.tensorflow.random": (*DRAWS, "dropout", "categorical",
                                            "_get_concrete_noise_shape"),
    "keras.src.backend.tensorflow.trainer": ("reduce_per_replica",
                                             "_collective_all_reduce_multi_worker",
                                             "TFEpochIterator._get_iterator"),
}

optimizer, random, trainer = load(TABLE, "the TensorFlow engine")

try:
    from tensorflow.python.data.ops import multi_device_iterator_ops as device_datasets
except ImportError:  # TensorFlow not installed (the table is checked under any backend)
    device_datasets = None
if not hasattr(device_datasets, "_create_device_dataset"):
    device_datasets = None
