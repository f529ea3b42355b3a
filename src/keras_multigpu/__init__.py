"""keras_multigpu: train any Keras 3 model on every device, with one call.

```python
import keras_multigpu as kmg

parallel = kmg.multi_gpu_model(model)   # every GPU, or every CPU device
parallel.compile(optimizer="sgd", loss="categorical_crossentropy")
parallel.fit(x, y, batch_size=64 * parallel.num_replicas, epochs=10)
model.save("trained.keras")             # a plain Keras file
```

Importing this package reads `KERAS_MULTIGPU_CPU_DEVICES` and, when it is
set and the framework has not started, asks for that many virtual CPU
devices.
"""

import os as _os

# JAX is the exact engine (see the README's backend table); Keras would otherwise pick
# TensorFlow. An explicit KERAS_BACKEND, or a Keras already imported, wins.
_GIVEN_BACKEND = _os.environ.get("KERAS_BACKEND")  # `launch` passes the user's own on
_os.environ.setdefault("KERAS_BACKEND", "jax")

from keras_multigpu import backends as _backends  # noqa: E402
from keras_multigpu import callbacks, schedules  # noqa: E402
from keras_multigpu.devices import Device, list_devices  # noqa: E402
from keras_multigpu.devices import cpu_device_count as _cpu_device_count  # noqa: E402
from keras_multigpu.parallel import ParallelModel, multi_gpu_model  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "Device", "ParallelModel", "callbacks", "list_devices", "multi_gpu_model", "schedules",
    "__version__",
]

if "LOCAL_RANK" in _os.environ or "TF_CONFIG" in _os.environ:
    # Started by `keras-multigpu launch` (or torchrun), or as one of several TensorFlow
    # workers: the engine picks this process's device, or joins the other workers, before
    # the user's model is built (TensorFlow joins them only as its runtime starts).
    _backends.current()

if _cpu_device_count():
    _backends.current().configure_cpu_devices(_cpu_device_count())
