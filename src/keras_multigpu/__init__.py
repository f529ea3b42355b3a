"""keras_multigpu: train any Keras 3 model on every device, with one call.

```python
import os
os.environ["KERAS_BACKEND"] = "jax"     # or "tensorflow", "torch": your choice, as in Keras

import keras_multigpu as kmg

parallel = kmg.multi_gpu_model(model)   # every GPU, or every CPU device
parallel.compile(optimizer="sgd", loss="categorical_crossentropy")
parallel.fit(x, y, batch_size=64 * parallel.num_replicas, epochs=10)
model.save("trained.keras")             # a plain Keras file
```

Importing this package changes no environment variable and no Keras setting: Keras picks
its backend as it always does (`KERAS_BACKEND`, else `~/.keras/keras.json`, else
TensorFlow). It reads `KERAS_MULTIGPU_CPU_DEVICES` and, when it is set and the framework
has not started, asks for that many virtual CPU devices.
"""

import os as _os

from keras_multigpu import _extras
from keras_multigpu.devices import Device, list_devices
from keras_multigpu.devices import cpu_device_count as _cpu_device_count

__version__ = "0.1.0"

__all__ = [
    "Checkpoint", "CheckpointError", "Device", "ParallelModel", "ReplicaStateWarning",
    "callbacks", "list_devices", "mixes_rows", "multi_gpu_model", "schedules", "__version__",
]

_FRAMEWORK_ERROR = None
try:
    import keras as _keras  # noqa: F401 - fails when Keras's backend is not installed
except Exception as _error:  # ImportError, or what a broken framework install raises
    _FRAMEWORK_ERROR = _error
else:
    try:
        from keras import saving as _saving

        from keras_multigpu import backends as _backends
        from keras_multigpu import callbacks, schedules
        from keras_multigpu._replica_state import ReplicaStateWarning
        from keras_multigpu.checkpoint import Checkpoint, CheckpointError
        from keras_multigpu.parallel import ParallelModel, multi_gpu_model
        from keras_multigpu.rules_mixing import mixes_rows

        # Found by name where Keras rebuilds a ParallelModel from its config (clone_model).
        _saving.register_keras_serializable("keras_multigpu")(ParallelModel)
    except _extras.KerasVersionError as _error:
        _FRAMEWORK_ERROR = _error  # a Keras outside the tested range: said on first use

if _FRAMEWORK_ERROR is not None:
    # `keras-multigpu devices` and `launch` work without a usable framework; the rest
    # needs one, and says why in one line when it is first used.
    def __getattr__(name):
        if name in __all__:
            if isinstance(_FRAMEWORK_ERROR, _extras.KerasVersionError):
                raise _FRAMEWORK_ERROR
            raise _extras.no_framework(_FRAMEWORK_ERROR, f"keras_multigpu.{name}")
        raise AttributeError(f"module 'keras_multigpu' has no attribute {name!r}")
else:
    if "LOCAL_RANK" in _os.environ or "TF_CONFIG" in _os.environ:
        # Started by `keras-multigpu launch` (or torchrun), or as one of several TensorFlow
        # workers: the engine picks this process's device, or joins the other workers,
        # before the user's model is built (TensorFlow joins them only as its runtime
        # starts).
        _backends.current()

    if _cpu_device_count() and _backends.has(_backends.current(), "cpu_devices"):
        _backends.current().configure_cpu_devices(_cpu_device_count())
