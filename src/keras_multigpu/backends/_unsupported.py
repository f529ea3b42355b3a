"""Placeholders for backends whose engine has not landed yet."""


def unsupported(backend, name, quiet=False):
    """Returns a function that raises a clear NotImplementedError.

    With `quiet=True` it returns False instead, for calls made at import time
    (`configure_cpu_devices`), so that importing the package never fails.
    """

    def function(*args, **kwargs):
        if quiet:
            return False
        raise NotImplementedError(
            f"keras_multigpu does not support the {backend!r} backend yet "
            f"({name} was called). Set KERAS_BACKEND=jax before importing "
            "keras to train on several devices today."
        )

    function.__name__ = name
    return function
