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

Importing this package changes no Keras setting: Keras picks its backend as it always
does (`KERAS_BACKEND`, else `~/.keras/keras.json`, else TensorFlow). It reads
`KERAS_MULTIGPU_CPU_DEVICES` and, when it is set and the framework has not started, asks
for that many virtual CPU devices: on JAX through `XLA_FLAGS` (the one environment
variable it sets, before JAX reads it; the processes it starts inherit it).
"""

import os as _os
import sys as _sys

from keras_multigpu import _extras
from keras_multigpu.devices import Device, list_devices
from keras_multigpu.devices import cpu_device_count as _cpu_device_count

__version__ = "0.1.0"

__all__ = [
    "Checkpoint", "CheckpointError", "CollectiveError", "Device", "ParallelModel",
    "ReplicaStateWarning", "callbacks", "list_devices", "mixes_rows", "multi_gpu_model",
    "schedules", "__version__",
]

# The names that need Keras: imported with the package, as any library's, but on first use
# in the `keras-multigpu` command (`_the_command`), whose devices, launch and argument
# errors then start no framework.
_NEEDS_KERAS = {
    "Checkpoint": "checkpoint", "CheckpointError": "checkpoint",
    "CollectiveError": "processes", "ParallelModel": "parallel",
    "multi_gpu_model": "parallel", "ReplicaStateWarning": "_replica_state",
    "mixes_rows": "rules_mixing", "callbacks": None, "schedules": None,
}
_FRAMEWORK_ERROR = None


def _load():
    """Imports the names that need Keras, or keeps why it cannot (Keras's backend is not
    installed, or this Keras moved an internal: `_extras.KerasVersionError`)."""
    global _FRAMEWORK_ERROR
    try:
        import keras  # noqa: F401 - fails when Keras's backend is not installed
    except Exception as error:  # ImportError, or what a broken framework install raises
        _FRAMEWORK_ERROR = error
        return False
    import importlib

    try:
        for name, module in _NEEDS_KERAS.items():
            loaded = importlib.import_module(f"keras_multigpu.{module or name}")
            globals()[name] = loaded if module is None else getattr(loaded, name)
    except _extras.KerasVersionError as error:
        _FRAMEWORK_ERROR = error
        return False
    return True


def __getattr__(name):
    if name not in _NEEDS_KERAS:
        raise AttributeError(f"module 'keras_multigpu' has no attribute {name!r}")
    if _FRAMEWORK_ERROR is None and _load():
        return globals()[name]
    # `keras-multigpu devices` and `launch` work without a usable framework; the rest
    # needs one, and says why in one line when it is first used.
    if isinstance(_FRAMEWORK_ERROR, _extras.KerasVersionError):
        raise _FRAMEWORK_ERROR
    raise _extras.no_framework(_FRAMEWORK_ERROR, f"keras_multigpu.{name}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


def _the_command():
    """Whether this process is the `keras-multigpu` command: its console script, or
    `python -m keras_multigpu.cli` (as the package is imported, before either runs)."""
    argv = _sys.orig_argv
    named = _os.path.basename(_sys.argv[0] if _sys.argv else "").removesuffix(".exe")
    return named == "keras-multigpu" or (
        "-m" in argv and argv[argv.index("-m") + 1:][:1] == ["keras_multigpu.cli"])


def _a_light_command():
    """Whether the command (`_the_command()`) is `devices` or `launch`, which start no
    framework (each of the launcher's processes imports the package itself)."""
    # The command's arguments, for its console script and for `python -m keras_multigpu.cli`
    # alike (whose `sys.argv[0]` is "-m" while the package imports).
    words = [a for a in _sys.argv[1:] if not a.startswith("-")]
    return words[:1] in (["devices"], ["launch"])


_LAUNCHED = "LOCAL_RANK" in _os.environ or "TF_CONFIG" in _os.environ
_COMMAND = _the_command()
try:
    _CPUS = _cpu_device_count()
except ValueError:
    if not _COMMAND:
        raise
    _CPUS = None  # the command says so in one line, as of a bad flag (`cli.main`)
if not _COMMAND or (_LAUNCHED or _CPUS) and not _a_light_command():
    # Started by `keras-multigpu launch` (or torchrun), or as one of several TensorFlow
    # workers: the engine picks this process's device, or joins the other workers, before
    # the user's model is built (TensorFlow joins them only as its runtime starts). With
    # KERAS_MULTIGPU_CPU_DEVICES, the engine asks for that many virtual CPU devices before
    # the framework starts. Loading also registers the package's Keras classes
    # (`LinearScaling`) for `keras.saving.load_model`.
    if _load() and (_LAUNCHED or _CPUS):
        from keras_multigpu import backends as _backends

        _backend = _backends.current()
        if _CPUS and _backends.has(_backend, "cpu_devices"):
            _backend.configure_cpu_devices(_CPUS)
