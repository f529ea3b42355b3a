"""Optional dependencies: a missing one is named in one line, with the extra that brings it.

The library itself needs Keras and NumPy. Keras needs one backend (JAX, TensorFlow or
torch) to import at all; the monitor and the experiment need matplotlib and nvidia-ml-py,
which come with the `monitor` and `experiment` extras.
"""

import importlib


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


class KerasVersionError(ImportError):
    """The installed Keras lacks an internal the library relies on (see `_keras`)."""


def require(module, extra, what):
    """Imports and returns `module`, or raises `MissingExtra` naming `extra`.

    Args:
        module: the module to import, e.g. "matplotlib".
        extra: the keras-multigpu extra that installs it, e.g. "monitor".
        what: the feature that needs it, e.g. "DeviceMonitor".
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise MissingExtra(
            f"{what} needs {module.split('.')[0]}, which is not installed ({error}). "
            f'Install it with: pip install "keras-multigpu[{extra}]"'
        ) from None


def no_framework(error, what):
    """The error for `what` when Keras cannot import because its backend is not installed."""
    return MissingExtra(
        f"{what} needs Keras with a backend, and `import keras` failed: {error}. Install "
        'one, e.g. pip install "keras-multigpu[jax]" (or [tensorflow], [torch]), and name '
        "it in KERAS_BACKEND or ~/.keras/keras.json."
    )
