"""Finding devices without side effects, and choosing among them.

`list_devices()` answers "what could I train on?" without starting a
framework: GPUs are counted through NVML (nvidia-ml-py), which creates no
CUDA context and allocates no device memory, the mistake behind the old
`multi_gpu_model` tutorials whose GPU count started a TensorFlow session.
With no GPU it reports the CPU devices the engine will have, virtual ones
included (`KERAS_MULTIGPU_CPU_DEVICES=N`).

`select(gpus, available)` turns the user's `gpus=` argument into a list of
devices and is where every bad value is refused with a clear message.
"""

import dataclasses
import functools
import logging
import numbers
import os

logger = logging.getLogger(__name__)

CPU_DEVICES_ENV = "KERAS_MULTIGPU_CPU_DEVICES"
MAX_CPU_DEVICES = 1024


@dataclasses.dataclass(frozen=True)
class Device:
    """One device a replica can run on.

    Attributes:
        id: the index the engine knows it by (`gpu:1` has id 1).
        kind: `"gpu"` or `"cpu"` (or another platform name, e.g. `"tpu"`).
        name: a human-readable name, e.g. `"NVIDIA H100 80GB HBM3"`.
        memory_bytes: total device memory when known, else None.
    """

    id: int
    kind: str
    name: str
    memory_bytes: int | None = None

    def __str__(self):
        return f"{self.kind}:{self.id}"


def cpu_device_count():
    """Returns N from `KERAS_MULTIGPU_CPU_DEVICES`, or None when it is unset.

    Raises:
        ValueError: if the variable is set to something that is not a
            positive integer, or to more than `MAX_CPU_DEVICES`.
    """
    raw = os.environ.get(CPU_DEVICES_ENV)
    if raw is None or raw.strip() == "":
        return None
    try:
        count = int(raw)
    except ValueError:
        count = 0
    if count < 1:
        raise ValueError(
            f"{CPU_DEVICES_ENV} must be a positive integer. Received: "
            f"{CPU_DEVICES_ENV}={raw!r}. Set it to the number of virtual CPU "
            "devices you want, e.g. 4, or unset it."
        )
    if count > MAX_CPU_DEVICES:  # XLA took over 5 minutes to start 100,000 (512: 5 s)
        raise ValueError(
            f"{CPU_DEVICES_ENV} must be at most {MAX_CPU_DEVICES}: the virtual devices (or "
            f"torch's processes) share this machine's {os.cpu_count() or 'few'} cores, and the "
            f"frameworks take minutes to start many thousands. Received: "
            f"{CPU_DEVICES_ENV}={raw!r}."
        )
    return count


def _nvml_gpus():
    from keras_multigpu import nvml

    try:
        pynvml = nvml.open_nvml()
    except nvml.NvmlUnavailable:
        return []  # No driver or no nvidia-ml-py: a CPU-only machine.
    try:
        gpus = []
        count = pynvml.nvmlDeviceGetCount()
        for visible_id, index in enumerate(nvml.visible_indices(count)):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            if isinstance(name, bytes):
                name = name.decode()
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle).total
            gpus.append(Device(visible_id, "gpu", name, int(memory)))
        return gpus
    finally:
        pynvml.nvmlShutdown()


# The CPU devices the engine's framework has, where it had started before it could be
# given `KERAS_MULTIGPU_CPU_DEVICES`'s count (the engine's `configure_cpu_devices` says so).
_started_with = None


def framework_started_with(count):
    """The framework had already started with `count` CPU devices: `list_devices` lists
    those, not the count asked for, which it can no longer have."""
    global _started_with
    _started_with = count
    list_devices.cache_clear()


def _xla_cpu_device_count():
    """The count a user already asked XLA for in XLA_FLAGS, if any."""
    for flag in os.environ.get("XLA_FLAGS", "").split():
        name, _, value = flag.partition("=")
        if name == "--xla_force_host_platform_device_count" and value.isdigit():
            return int(value)
    return None


@functools.cache
def list_devices():
    """Lists the devices training can use, without starting any framework.

    GPUs come from NVML and honour `CUDA_VISIBLE_DEVICES` (ids are renumbered
    from 0, as the frameworks do). With no GPU the list holds the CPU devices
    the engine will create: `KERAS_MULTIGPU_CPU_DEVICES` of them, else the
    count already in `XLA_FLAGS`, else one.
    The answer is cached; nothing is allocated on any device.

    Returns:
        A list of `Device` records.

    Example:

    >>> [str(d) for d in list_devices()]  # doctest: +SKIP
    ['gpu:0', 'gpu:1', 'gpu:2', 'gpu:3']
    """
    gpus = _nvml_gpus()
    if gpus:
        return gpus
    count = _started_with or cpu_device_count() or _xla_cpu_device_count() or 1
    return [Device(i, "cpu", "CPU" if count == 1 else "virtual CPU") for i in range(count)]


TIMEOUT_ENV = "KERAS_MULTIGPU_TIMEOUT"
DEFAULT_TIMEOUT = 300


def collective_timeout():
    """Seconds a process waits for the others (to join, or in a collective): `KERAS_MULTIGPU_
    TIMEOUT`, else 300. Every engine with several processes reads it here."""
    raw = os.environ.get(TIMEOUT_ENV, str(DEFAULT_TIMEOUT))
    try:
        seconds = float(raw)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{TIMEOUT_ENV} must be a positive number of seconds. Received: "
                         f"{TIMEOUT_ENV}={raw!r}.")
    return seconds


def refuse_several_processes(engine):
    """Refuses a run started as several processes (WORLD_SIZE > 1) that the engine cannot
    join (TensorFlow without TF_CONFIG): each process would train its own copy of the model
    and write the same files."""
    world = os.environ.get("WORLD_SIZE", "1")
    if world.isdigit() and int(world) > 1:
        raise RuntimeError(
            f"This program runs as {world} processes (WORLD_SIZE={world}), but the {engine} "
            "engine was given no way to join them (TensorFlow's workers need TF_CONFIG): each "
            "process would train its own copy and write the same files. Start it with "
            "keras-multigpu launch, which sets TF_CONFIG for TensorFlow, or once (python "
            "script.py, or keras-multigpu launch -n 1)."
        )


def _cpu_hint(n):
    """How to have `n` CPU devices, for a count that asks for more than the CPU offers."""
    asked = os.environ.get(CPU_DEVICES_ENV, "").strip()
    if _started_with is not None and asked:
        return (f" {CPU_DEVICES_ENV}={asked} is set, but the framework had started before "
                f"keras_multigpu was imported, and keeps {_started_with}: import "
                "keras_multigpu before anything runs a JAX or TensorFlow operation (building "
                "or calling a model).")
    if asked:
        return (f" {CPU_DEVICES_ENV}={asked} is set in the environment, and sets the count: "
                f"set it to {n} (or unset it, where `keras-multigpu train --gpus {n}` sets it).")
    return (f" To try {n} devices without a GPU, start the script with {CPU_DEVICES_ENV}={n} "
            f"in its environment: {n} virtual CPU devices on JAX and TensorFlow, {n} "
            f"processes on torch (or run it under keras-multigpu launch -n {n}).")


def _as_int(value):
    """A NumPy integer (a count or an id read from an array) as an int; else `value`."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return value


def select(gpus, available):
    """Chooses devices from `available` as `multi_gpu_model(gpus=...)` does.

    Args:
        gpus: None for every device; an int k for the first k (0 and 1 both
            mean one device); a list or tuple of device ids.
        available: the engine's devices, a list of `Device`.

    Returns:
        A non-empty list of `Device`, in the order asked for.

    Raises:
        TypeError: `gpus` is of a type other than those above.
        ValueError: negative, too many, duplicated or unknown ids.
    """
    have = ", ".join(str(d.id) for d in available)
    kind = available[0].kind
    what = f"this machine has {len(available)} {kind.upper()} device(s) ({have})"
    if gpus is None:
        return list(available)
    gpus = _as_int(gpus)
    if isinstance(gpus, bool) or not isinstance(gpus, (int, list, tuple)):
        raise TypeError(
            "gpus must be None (every device), an int or a list of device ids. Received: "
            f"gpus={gpus!r} of type {type(gpus).__name__}."
        )
    if isinstance(gpus, int):
        if gpus < 0:
            raise ValueError(
                f"gpus must be >= 0. Received: gpus={gpus}. Pass gpus=None "
                "for every device, or a count such as gpus=2."
            )
        if gpus > len(available):
            raise ValueError(
                f"gpus={gpus} but {what}. Pass gpus=None for all of them, "
                "or a list of ids." + (_cpu_hint(gpus) if kind == "cpu" else "")
            )
        return list(available[: max(gpus, 1)])
    ids = [d.id if isinstance(d, Device) else _as_int(d) for d in gpus]
    if not ids:
        raise ValueError(
            "gpus is an empty list. Pass gpus=None for every device, or "
            f"list at least one id; {what}."
        )
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int):
            raise TypeError(
                f"Device ids must be ints. Received: gpus={gpus!r} (the "
                f"element {i!r} is a {type(i).__name__})."
            )
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise ValueError(
            f"gpus lists device(s) {duplicates} more than once. Received: "
            f"gpus={gpus!r}. Each device can hold one replica; list each id once."
        )
    by_id = {d.id: d for d in available}
    unknown = [i for i in ids if i not in by_id]
    if unknown:
        raise ValueError(
            f"gpus names unknown device id(s) {unknown}: {what}. Received: "
            f"gpus={gpus!r}."
        )
    return [by_id[i] for i in ids]
