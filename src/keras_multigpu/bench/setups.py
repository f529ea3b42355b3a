"""The configurations `keras-multigpu bench` compares; one function each.

A setup is a name, an engine, a device count and the environment its worker
process needs. Its `train` function receives a model builder and the data,
and returns a fitted Keras model: adding a configuration is a few lines here.
"""

import dataclasses

from keras_multigpu import _xla
from keras_multigpu.devices import CPU_DEVICES_ENV

XLA_DEVICE_FLAG = _xla.DEVICE_COUNT_FLAG


@dataclasses.dataclass(frozen=True)
class Setup:
    """One benchmark configuration.

    Attributes:
        engine: "ours", "plain", "dataparallel" (keras.distribution, JAX),
            "mirrored" (tf.distribute.MirroredStrategy) or "independent":
            `devices` plain one-device trainings run at once, one process per
            device, with no communication between them. Their summed
            throughput is the ceiling for any data-parallel engine on these
            devices. "ours_tf", "plain_tf" and "independent_tf" are the same
            on the TensorFlow backend (as "mirrored" is).
        devices: replicas; the global batch is devices x batch per device.
    """

    engine: str
    devices: int

    @property
    def name(self):
        return f"{self.engine}-{self.devices}"

    @property
    def backend(self):
        return "tensorflow" if self.engine in TENSORFLOW_ENGINES else "jax"

    @property
    def processes(self):
        """How many worker processes the setup runs at once."""
        return self.devices if self.engine.startswith("independent") else 1

    @property
    def worker(self):
        """The setup each worker process measures."""
        if self.engine.startswith("independent"):
            return Setup(self.engine.replace("independent", "plain"), 1)
        return self

    def environment(self, base, virtual, process=0):
        """The worker's environment; `virtual` says devices are virtual CPUs."""
        env = {k: v for k, v in base.items() if not k.startswith("KERAS_MULTIGPU_")}
        env["KERAS_BACKEND"] = self.backend
        flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(XLA_DEVICE_FLAG)]
        env["XLA_FLAGS"] = " ".join(flags)
        if virtual and self.backend == "jax":  # every JAX setup gets the same flags as ours
            env["XLA_FLAGS"] = _xla.virtual_device_flags(self.worker.devices, env["XLA_FLAGS"])
        if virtual and self.engine == "ours_tf":  # logical CPU devices, as mirrored makes
            env[CPU_DEVICES_ENV] = str(self.devices)
        if self.processes > 1 and not virtual:  # one GPU for each process, of those visible
            visible = [d for d in base.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
            if visible and len(visible) < self.processes:
                raise ValueError(f"{self.name} needs {self.processes} GPUs; CUDA_VISIBLE_DEVICES "
                                 f"shows {len(visible)}: {','.join(visible)}.")
            env["CUDA_VISIBLE_DEVICES"] = visible[process] if visible else str(process)
        return env


def parse(name):
    engine, _, devices = name.rpartition("-")
    if engine not in TRAIN or not devices.isdigit() or int(devices) < 1:
        raise ValueError(
            f"Unknown setup {name!r}: expected ENGINE-DEVICES with ENGINE in "
            f"{sorted(TRAIN)}, e.g. ours-2."
        )
    if engine.startswith("plain") and devices != "1":
        raise ValueError(f"plain Keras runs on one device. Received: {name!r}.")
    return Setup(engine, int(devices))


def _compile(model):
    import keras

    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                  loss="categorical_crossentropy", metrics=["accuracy"])
    return model


def _train_plain(setup, build, fit):
    return fit(_compile(build()))


def _train_ours(setup, build, fit):
    import keras_multigpu as kmg

    return fit(_compile(kmg.multi_gpu_model(build(), gpus=setup.devices)))


def _train_dataparallel(setup, build, fit):
    import jax
    import keras

    distribution = keras.distribution.DataParallel(devices=jax.devices()[: setup.devices])
    with distribution.scope():  # as Keras's guide does: build, compile, fit inside
        return fit(_compile(build()))


def _train_mirrored(setup, build, fit):
    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        devices = [f"/gpu:{i}" for i in range(setup.devices)]
    else:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration()] * setup.devices
        )
        devices = [f"/cpu:{i}" for i in range(setup.devices)]
    strategy = tf.distribute.MirroredStrategy(devices=devices)
    with strategy.scope():
        model = _compile(build())
    return fit(model)


TRAIN = {
    "plain": _train_plain,
    "independent": _train_plain,  # each of its processes is plain-1
    "ours": _train_ours,
    "dataparallel": _train_dataparallel,
    "mirrored": _train_mirrored,
    "plain_tf": _train_plain,
    "independent_tf": _train_plain,  # each of its processes is plain_tf-1
    "ours_tf": _train_ours,
}
TENSORFLOW_ENGINES = ("mirrored", "plain_tf", "independent_tf", "ours_tf")


def available(setup):
    """None when the setup can run here, else the reason it cannot."""
    if setup.backend == "tensorflow":
        import importlib.util

        if importlib.util.find_spec("tensorflow") is None:
            return "tensorflow is not installed (pip install tensorflow-cpu)"
    return None


def default_setups(max_devices):
    """Ours at 1..N, plain Keras, the peers and the ceiling at the counts above 1, on
    JAX and on TensorFlow."""
    counts = sorted({1, *range(2, max_devices + 1)})
    setups = [Setup("plain", 1)] + [Setup("ours", n) for n in counts]
    setups += [Setup("plain_tf", 1)] + [Setup("ours_tf", n) for n in counts]
    for n in counts[1:]:
        setups += [Setup("dataparallel", n), Setup("mirrored", n), Setup("independent", n),
                   Setup("independent_tf", n)]
    return setups


def cpu_only():
    """True when NVML sees no GPU (then devices are virtual CPU devices)."""
    from keras_multigpu import devices

    return all(d.kind == "cpu" for d in devices.list_devices())


