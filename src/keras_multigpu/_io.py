"""Atomic writes: a file appears whole or not at all, and errors name it.

A save goes to a temporary file beside its target, then is renamed over it.
The temporary name records the target and the writing process
(`.model.keras.tmp-<pid>-<random>.keras`), so that a save which a SIGKILL cut
short leaves a file the next save to the same path recognises and removes.
"""

import contextlib
import errno
import glob
import json
import os
import re
import shutil
import tempfile


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _temporary_prefix(filepath):
    return f".{os.path.basename(filepath)}.tmp-"


def remove_leftovers(filepath, suffix=""):
    """Removes temporary files of earlier saves to `filepath` whose process is gone.

    Returns the paths removed.
    """
    directory = os.path.dirname(os.path.abspath(filepath))
    pattern = os.path.join(glob.escape(directory),
                           glob.escape(_temporary_prefix(filepath)) + "*" + glob.escape(suffix))
    removed = []
    for path in glob.glob(pattern):
        owner = os.path.basename(path)[len(_temporary_prefix(filepath)):].split("-", 1)[0]
        if owner.isdigit() and int(owner) != os.getpid() and not _alive(int(owner)):
            with contextlib.suppress(FileNotFoundError):
                if os.path.isdir(path):
                    shutil.rmtree(path)
                else:
                    os.remove(path)
                removed.append(path)
    return removed


def hint(error):
    if error.errno == errno.ENOSPC:
        return "The disk is full: free some space or save elsewhere."
    if error.errno == errno.EFBIG:
        return "The file is larger than this process may write (ulimit -f): raise the limit."
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "The folder is not writable: choose another path."
    return "Check the path and the disk."


def check_suffix(filepath, suffix):
    """`filepath` as a string, or a ValueError where it does not end with `suffix` (a
    string, or a tuple of the suffixes allowed)."""
    suffixes = (suffix,) if isinstance(suffix, str) else tuple(suffix)
    named = " or ".join(repr(s) for s in suffixes)
    if not isinstance(filepath, (str, os.PathLike)):
        raise TypeError(f"filepath must be a path ending in {named}. Received: "
                        f"filepath={filepath!r} of type {type(filepath).__name__}.")
    filepath = os.fspath(filepath)
    if not filepath.endswith(suffixes):
        raise ValueError(
            f"The filename must end in {named}. Received: filepath={filepath!r}."
        )
    return filepath


@contextlib.contextmanager
def atomic_path(filepath, suffix=""):
    """Yields a temporary path beside `filepath`; renames it over `filepath` on success.

    A failure (an exception in the block) leaves `filepath` as it was and no
    temporary file behind. The file gets the permissions of a plainly created
    one (0666 less the umask), not tempfile's private 0600. An `OSError`
    (full disk, file size limit, permissions) is raised again naming
    `filepath`.

    Raises:
        ValueError: `filepath` does not end with `suffix`.
    """
    filepath = check_suffix(filepath, suffix)
    directory = os.path.dirname(os.path.abspath(filepath))
    try:
        os.makedirs(directory, exist_ok=True)
        remove_leftovers(filepath, suffix)
        handle, tmp = tempfile.mkstemp(
            prefix=f"{_temporary_prefix(filepath)}{os.getpid()}-", suffix=suffix, dir=directory
        )
        os.close(handle)
    except OSError as error:
        raise type(error)(error.errno, f"Cannot write {filepath}: {error.strerror}. "
                                       f"{hint(error)}") from error
    try:
        try:
            yield tmp
            os.chmod(tmp, 0o666 & ~_umask())
            os.replace(tmp, filepath)
        except OSError as error:
            if error.errno is None:  # h5py's errors carry no errno
                raise OSError(f"Cannot write {filepath}: {error}. Check the path and the "
                              f"disk; {filepath} was left as it was.") from error
            raise type(error)(error.errno, f"Cannot write {filepath}: {error.strerror}. "
                                           f"{hint(error)} {filepath} was left as it was."
                              ) from error
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


@contextlib.contextmanager
def atomic_export(filepath):
    """Yields a path named as `filepath` in a temporary folder beside it; on success, moves
    what was written there (a SavedModel's folder, an ONNX file, OpenVINO's .xml and .bin)
    next to `filepath`, each whole: a folder of the same name is renamed aside, then the new
    one renamed in, so that a reader or a kill never meets a half-written export. A failure
    leaves everything as it was; a temporary folder a kill left is removed by the next
    export to the same path."""
    filepath = os.path.abspath(os.fspath(filepath))
    directory = os.path.dirname(filepath)
    prefix = f"{_temporary_prefix(filepath)}{os.getpid()}-"
    os.makedirs(directory, exist_ok=True)
    remove_leftovers(filepath)
    staging = tempfile.mkdtemp(prefix=prefix, dir=directory)
    try:
        yield os.path.join(staging, os.path.basename(filepath))
        for name in os.listdir(staging):
            written, target = os.path.join(staging, name), os.path.join(directory, name)
            if os.path.isdir(written) and os.path.isdir(target):
                aside = tempfile.mkdtemp(prefix=prefix, dir=directory)
                os.replace(target, aside)  # onto the empty folder: both names stay whole
                os.replace(written, target)
                shutil.rmtree(aside, ignore_errors=True)
            else:
                os.replace(written, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def writable_folder(folder, what, advice):
    """Creates `folder` if needed and checks that a file can be written in it, before any
    work depends on it. Raises `OSError` as `"{what}: {reason}. {advice}"`."""
    try:
        os.makedirs(folder, exist_ok=True)
        probe = os.path.join(folder, f".write-test-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as error:
        reason = error.strerror
        blocking = nearest_existing(folder)
        if error.errno in (errno.EEXIST, errno.ENOTDIR) and not os.path.isdir(blocking):
            reason = f"{blocking} is a file, not a folder"
        raise OSError(error.errno, f"{what}: {reason}. {advice}") from error


def nearest_existing(path):
    """`path` if it exists, else the nearest folder above it that does (as given, where
    its name has one)."""
    path = os.fspath(path)
    while not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent in ("", path):
            return os.path.abspath(parent or os.curdir)
        path = parent
    return path


def unreadable(filepath, error):
    """A clear error for a Keras file that exists but cannot be read."""
    size = os.path.getsize(filepath)
    return ValueError(
        f"{filepath} ({size:,} bytes) cannot be read as a Keras file: it is truncated or "
        f"damaged ({type(error).__name__}: {error}). Load an earlier checkpoint, or save the "
        "model again."
    )


def without_values(message):
    """Keras's error `message` without the values of the variables it names (its load
    errors print each whole: `<Variable path=dense/kernel, shape=(4, 16), ..., value=[[...]]>`)."""
    return re.sub(r", value=(?:\[.*?\]|[^>]*)>", ">", message, flags=re.DOTALL)


def write_json(filepath, payload):
    """Writes `payload` as indented JSON to `filepath`, atomically."""
    with atomic_path(filepath, ".json") as tmp, open(tmp, "w") as f:
        json.dump(payload, f, indent=2)
