"""Atomic writes: a file appears whole or not at all."""

import contextlib
import json
import os
import tempfile


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(filepath, suffix=""):
    """Yields a temporary path beside `filepath`; renames it over `filepath` on success.

    A failure (an exception in the block) leaves `filepath` as it was and no
    temporary file behind. The file gets the permissions of a plainly created
    one (0666 less the umask), not tempfile's private 0600.

    Raises:
        ValueError: `filepath` does not end with `suffix`.
    """
    filepath = os.fspath(filepath)
    if not filepath.endswith(suffix):
        raise ValueError(
            f"The filename must end in {suffix!r}. Received: filepath={filepath!r}."
        )
    directory = os.path.dirname(os.path.abspath(filepath))
    os.makedirs(directory, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=suffix, dir=directory)
    os.close(handle)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, filepath)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_json(filepath, payload):
    """Writes `payload` as indented JSON to `filepath`, atomically."""
    with atomic_path(filepath, ".json") as tmp, open(tmp, "w") as f:
        json.dump(payload, f, indent=2)
