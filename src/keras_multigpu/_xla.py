"""XLA_FLAGS for virtual CPU devices, without starting JAX (the bench's parent uses it too)."""

import functools
import importlib.util
import math
import mmap
import os

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"

# Virtual CPU devices are threads of one process. XLA ends the whole process
# when a collective waits longer than its own timeouts (40 s by default), which a
# thread starved on a loaded machine can reach: a 2-device fit died at epoch 21
# of 40 that way. They follow KERAS_MULTIGPU_TIMEOUT instead (default 300 s), plus
# a margin: the JAX engine's watchdog ends a step that waits longer than that
# with the library's message first (`backends.jax`), and XLA's is the backstop.
BACKSTOP_SECONDS = 60
CPU_COLLECTIVE_TIMEOUTS = (
    "--xla_cpu_collective_call_terminate_timeout_seconds",
    "--xla_cpu_collective_timeout_seconds",
)


@functools.cache
def knows(flag):
    """Whether the installed jaxlib has `flag`: XLA aborts on an unknown one.

    Looks for the flag's name in jaxlib's shared libraries (memory-mapped,
    without importing jaxlib).
    """
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        return False
    name = flag.lstrip("-").encode()
    for root in spec.submodule_search_locations:
        for directory, _, files in os.walk(root):
            for file in files:
                if not file.endswith(".so"):
                    continue
                with open(os.path.join(directory, file), "rb") as handle:
                    if os.fstat(handle.fileno()).st_size == 0:
                        continue
                    with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
                        if data.find(name) >= 0:
                            return True
    return False


def virtual_device_flags(count, xla_flags="", timeout=None):
    """`xla_flags` (a string) with `count` host devices and, for several, XLA's CPU
    collective timeouts at `timeout` seconds (default: KERAS_MULTIGPU_TIMEOUT, else 300)
    plus BACKSTOP_SECONDS.

    A timeout already in `xla_flags` is kept; one the installed jaxlib lacks is
    not added.
    """
    flags = [f for f in xla_flags.split() if not f.startswith(DEVICE_COUNT_FLAG)]
    flags.append(f"{DEVICE_COUNT_FLAG}={count}")
    if count > 1:
        if timeout is None:
            from keras_multigpu.devices import collective_timeout

            timeout = collective_timeout()
        seconds = math.ceil(timeout) + BACKSTOP_SECONDS
        for flag in CPU_COLLECTIVE_TIMEOUTS:
            if not any(f.split("=")[0] == flag for f in flags) and knows(flag):
                flags.append(f"{flag}={seconds}")
    return " ".join(flags)
