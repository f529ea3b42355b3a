"""`--output` for `train` and `compare`: a folder claimed by one run at a time (a lock file),
refused with the fix when it holds another run's files."""

import contextlib
import os

from keras_multigpu._cli_args import UsageError
from keras_multigpu._io import nearest_existing, writable_folder

LOCK_NAME = ".keras-multigpu.lock"


def _held_files(path):
    return sorted(name for name in os.listdir(path) if name != LOCK_NAME)


def _check_output(path, overwrite):
    """Refuses an `--output` that is not a folder, cannot be created, or holds files."""
    if not path.strip():
        raise UsageError("--output is empty; name a folder for the results")
    if os.path.isdir(path):
        names = _held_files(path)
        if names and not overwrite:
            shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
            raise UsageError(
                f"--output {path} already holds files ({shown}); pass --overwrite to replace "
                "them, or choose another --output"
            )
        parent = path
    elif os.path.lexists(path):
        what = "a file" if os.path.isfile(path) else "not a folder"
        raise UsageError(f"--output {path} is {what}; choose another --output")
    else:
        parent = nearest_existing(os.path.dirname(os.path.abspath(path)))
        if not os.path.isdir(parent):
            raise UsageError(
                f"--output {path} cannot be created: {parent} is a file, not a folder"
            )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"--output {path}: {parent} is not writable; choose another --output")


@contextlib.contextmanager
def _no_empty_folders(path):
    """Removes the folders on the way to `path` that the block created and left empty.

    The experiment creates its folder with its first file; a run that fails
    before writing anything (or whose first write fails) leaves nothing behind.
    """
    missing = None
    probe = os.path.abspath(path)
    while not os.path.lexists(probe):
        missing, probe = probe, os.path.dirname(probe)
    try:
        yield
    finally:
        if missing is not None and os.path.isdir(missing):
            for folder, _, _ in os.walk(missing, topdown=False):
                with contextlib.suppress(OSError):
                    os.rmdir(folder)  # only an empty folder goes


@contextlib.contextmanager
def _claimed(path, overwrite):
    """Holds `path` for this run: a second run into the same --output at the same time is
    refused (its files would silently replace this run's), naming the process that holds it.

    The claim is an exclusive `flock` on a lock file in the folder, released when the
    process ends, however it ends (a kill leaves only the file, which claims nothing). The
    run removes the file when it ends.
    """
    import fcntl
    import time

    if int(os.environ.get("RANK") or 0) > 0:  # a launched group's: its process 0 holds it
        yield
        return
    writable_folder(path, f"--output {path} cannot be written",
                    "Choose an --output folder this user can write to.")
    lock = os.path.join(path, LOCK_NAME)
    handle = open(lock, "a+")  # noqa: SIM115 (held for the run)
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise UsageError(
            f"--output {path} is in use by another run ({holder}); wait for it to finish, "
            "or choose another --output") from None
    try:
        # Checked again under the claim: a run that started meanwhile may have written.
        names = _held_files(path)
        if names and not overwrite:
            raise UsageError(
                f"--output {path} already holds files ({', '.join(names[:4])}"
                f"{', ...' if len(names) > 4 else ''}); pass --overwrite to replace them, or "
                "choose another --output")
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        handle.flush()
        yield
    finally:
        with contextlib.suppress(OSError):
            os.remove(lock)
        handle.close()
