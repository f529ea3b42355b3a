"""The configurations `keras-multigpu bench` compares; one function each.

A setup is a name, an engine, a device count and the environment its worker
process needs. Its `train` function receives a model builder and the data,
and returns a fitted Keras model: adding a configuration is a few lines here.
"""

import atexit
import dataclasses
import os

from keras_multigpu import _xla
from keras_multigpu.devices import CPU_DEVICES_ENV

XLA_DEVICE_FLAG = _xla.DEVICE_COUNT_FLAG
# A folder holding a Keras with a torch `DataParallel` (the next Keras: `pip install
# --no-deps --target DIR ../shared/keras-next/keras-*.whl`), for the setups on it.
NEXT_KERAS_ENV = "KERAS_MULTIGPU_NEXT_KERAS"
# The setups that run on the next Keras: its `DataParallel`, and ours, plain Keras and the
# ceiling on that Keras, which say how much of a gap to it is the Keras version's own.
NEXT_KERAS_ENGINES = ("keras_dp_torch", "ours_next_torch", "plain_next_torch",
                      "independent_next_torch")


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
            on the TensorFlow backend (as "mirrored" is); "ours_torch",
            "plain_torch" and "independent_torch" on PyTorch, beside
            "ddp_torch": a hand-written DistributedDataParallel loop over the
            Keras model (the keras-io guide's approach), and "keras_dp_torch":
            the next Keras's own torch `DataParallel` (DDP inside Keras's torch
            trainer), from the Keras that NEXT_KERAS_ENV names. ours_torch,
            ddp_torch, keras_dp_torch and ours_next_torch run one process per
            device (`RANKED`).
            "ours_next_torch", "plain_next_torch" and "independent_next_torch"
            are ours, plain Keras and the ceiling on that next Keras: the
            comparisons with keras_dp_torch on one Keras.
        devices: replicas; the global batch is devices x batch per device.
    """

    engine: str
    devices: int

    @property
    def name(self):
        return f"{self.engine}-{self.devices}"

    @property
    def backend(self):
        if self.engine in TORCH_ENGINES:
            return "torch"
        return "tensorflow" if self.engine in TENSORFLOW_ENGINES else "jax"

    @property
    def processes(self):
        """How many worker processes the setup runs at once."""
        if self.engine.startswith("independent") or self.engine in RANKED:
            return self.devices
        return 1

    @property
    def worker(self):
        """The setup each worker process measures."""
        if self.engine.startswith("independent"):
            return Setup(self.engine.replace("independent", "plain"), 1)
        return self

    def environment(self, base, virtual, process=0, port=None):
        """The worker's environment; `virtual` says devices are virtual CPUs.

        Ranked setups get torchrun's variables (`port`: where their processes meet).
        """
        env = {k: v for k, v in base.items() if not k.startswith("KERAS_MULTIGPU_")}
        if self.backend == "torch" and virtual and self.processes > 1:
            # The processes share the cores alike, ours, DDP's and the independent ones.
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.processes))
        if self.engine in NEXT_KERAS_ENGINES:
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (base[NEXT_KERAS_ENV], base.get("PYTHONPATH")) if p)
        if self.engine in RANKED:
            env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                        "RANK": str(process), "WORLD_SIZE": str(self.devices),
                        "LOCAL_RANK": str(process), "LOCAL_WORLD_SIZE": str(self.devices)})
            return {**env, "KERAS_BACKEND": "torch"}
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
    if engine in TRAIN and devices.isdigit() and int(devices) < 1:
        raise ValueError(f"A setup runs on 1 device or more. Received: {name!r}; pass "
                         f"{engine}-1 or more.")
    if engine not in TRAIN or not devices.isdigit():
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


class _DDPTrainer:
    """The keras-io guide's loop: the Keras model in DistributedDataParallel, a torch
    optimizer, a DistributedSampler; `fit` as the worker calls it, timing each epoch."""

    def __init__(self, model):
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
            # Left to the interpreter's exit, gloo's threads once ended the worker with
            # "terminate called without an active exception" after its results were out.
            atexit.register(dist.destroy_process_group)
        self.model = model
        self.device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}"
                                   if torch.cuda.is_available() else "cpu")
        self.ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[self.device] if self.device.type == "cuda" else None)
        self.optimizer = torch.optim.SGD(self.ddp.parameters(), lr=0.01, momentum=0.9)

    def count_params(self):
        return self.model.count_params()

    def fit(self, x, y, batch_size, epochs, **kwargs):
        import time

        import keras
        import torch
        import torch.distributed as dist

        dataset = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
        sampler = torch.utils.data.distributed.DistributedSampler(dataset, shuffle=False)
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=batch_size // dist.get_world_size(), sampler=sampler)
        seconds = []
        for _ in range(epochs):
            start = time.perf_counter()
            for inputs, targets in loader:
                inputs, targets = inputs.to(self.device), targets.to(self.device)
                predictions = self.ddp(inputs, training=True)
                loss = keras.ops.mean(keras.losses.categorical_crossentropy(targets, predictions))
                self.optimizer.zero_grad()
                loss.backward()
                self.optimizer.step()
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
        return type("History", (), {"history": {"seconds": seconds}})()


def _train_ddp(setup, build, fit):
    return fit(_DDPTrainer(build()))


class _Shard:
    """A Keras model that fits its process's contiguous shard of the data, with the
    per-process batch: how `DataParallel` is fed arrays when Keras does not shard them."""

    def __init__(self, model, rank, world):
        self.model, self.rank, self.world = model, rank, world

    def count_params(self):
        return self.model.count_params()

    def fit(self, x, y, batch_size, **kwargs):
        per = len(x) // self.world
        rows = slice(self.rank * per, (self.rank + 1) * per)
        return self.model.fit(x[rows], y[rows], batch_size=batch_size // self.world, **kwargs)


def _train_keras_dp(setup, build, fit):
    import keras
    import torch.distributed as dist

    keras.distribution.initialize()  # the process group, from torchrun's variables
    distribution = keras.distribution.DataParallel()
    distribution.auto_shard_dataset = False  # arrays: each process is given its shard
    keras.distribution.set_distribution(distribution)
    return fit(_Shard(_compile(build()), dist.get_rank(), dist.get_world_size()))


TRAIN = {
    "plain": _train_plain,
    "independent": _train_plain,  # each of its processes is plain-1
    "ours": _train_ours,
    "dataparallel": _train_dataparallel,
    "mirrored": _train_mirrored,
    "plain_tf": _train_plain,
    "independent_tf": _train_plain,  # each of its processes is plain_tf-1
    "ours_tf": _train_ours,
    "plain_torch": _train_plain,
    "independent_torch": _train_plain,  # each of its processes is plain_torch-1
    "ours_torch": _train_ours,
    "ddp_torch": _train_ddp,
    "keras_dp_torch": _train_keras_dp,
    "ours_next_torch": _train_ours,
    "plain_next_torch": _train_plain,
    "independent_next_torch": _train_plain,  # each of its processes is plain_next_torch-1
}
TENSORFLOW_ENGINES = ("mirrored", "plain_tf", "independent_tf", "ours_tf")
TORCH_ENGINES = ("plain_torch", "independent_torch", "ours_torch", "ddp_torch",
                 "keras_dp_torch", "ours_next_torch", "plain_next_torch",
                 "independent_next_torch")
# One process per device, joined by torch.distributed.
RANKED = ("ours_torch", "ddp_torch", "keras_dp_torch", "ours_next_torch")


def available(setup):
    """None when the setup can run here, else the reason it cannot."""
    import importlib.util

    if setup.backend == "tensorflow" and importlib.util.find_spec("tensorflow") is None:
        return "tensorflow is not installed (pip install tensorflow-cpu)"
    if setup.backend == "torch" and importlib.util.find_spec("torch") is None:
        return "torch is not installed (pip install torch)"
    if setup.engine in NEXT_KERAS_ENGINES:
        folder = os.environ.get(NEXT_KERAS_ENV)
        if not folder or not os.path.isfile(os.path.join(folder, "keras", "__init__.py")):
            return (f"needs the next Keras (one with a torch DataParallel): set {NEXT_KERAS_ENV} "
                    "to a folder made by `pip install --no-deps --target DIR "
                    f"../shared/keras-next/keras-*.whl` (received {folder!r})")
    return None


def default_setups(max_devices):
    """Ours at 1..N, plain Keras, the peers and the ceiling at the counts above 1, on
    JAX, TensorFlow and PyTorch."""
    counts = sorted({1, *range(2, max_devices + 1)})
    setups = [Setup("plain", 1)] + [Setup("ours", n) for n in counts]
    setups += [Setup("plain_tf", 1)] + [Setup("ours_tf", n) for n in counts]
    setups += [Setup("plain_torch", 1)] + [Setup("ours_torch", n) for n in counts]
    for n in counts[1:]:
        setups += [Setup("dataparallel", n), Setup("mirrored", n), Setup("independent", n),
                   Setup("independent_tf", n), Setup("ddp_torch", n),
                   Setup("keras_dp_torch", n), Setup("independent_torch", n)]
    return setups


def cpu_only():
    """True when NVML sees no GPU (then devices are virtual CPU devices)."""
    from keras_multigpu import devices

    return all(d.kind == "cpu" for d in devices.list_devices())


