"""One group of the GPU plan's records, measured inside one process (one backend).

Started by `plan.py` as `python benchmarks/gpu/worker.py TASK_JSON EVENTS_JSONL`,
with `KERAS_BACKEND` (and, for the torch group, torchrun's variables) already
set: the backend is fixed once the framework starts. It appends one JSON line
per event to EVENTS_JSONL as it goes (`start`, then `record` or `skipped`, per
record), so the parent keeps every finished record even when this process
crashes, hangs or is killed at its deadline.

Each record trains the reference experiment's model (`experiment.build_models`:
mean subtraction, on-device shifts and flips when `augment`, MiniGoogLeNet) with
Keras's own `fit`, plain or through `multi_gpu_model(model, gpus=1)`, on a
slice of the CIFAR-sized array set; the first epoch (compilation, data
placement) is a warm-up and the epochs after it are timed (`EpochStats`, which
waits for the last step). Models are kept per (engine, precision, augment): a
record that only changes `steps_per_execution` or the placement reuses the
model, and JAX's persistent compilation cache (a folder the parent gives)
serves a step program already compiled.
"""

import json
import math
import statistics
import sys
import time

import numpy as np

CIFAR_IMAGES = 50_000


def emit(path, event):
    with open(path, "a") as f:
        f.write(json.dumps(event) + "\n")


def forward_flops(model):
    """Multiply-adds (x2) of the model's Conv2D and Dense layers for one image.

    Normalization, BatchNormalization, activations, pooling and the
    augmentation's one-hot products are left out (elementwise or tiny).
    """
    import keras

    total = 0
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if isinstance(layer, keras.layers.Conv2D):
            _, height, width, channels = layer.output.shape
            kh, kw = layer.kernel_size
            total += 2 * height * width * channels * kh * kw * layer.input.shape[-1] // layer.groups
        elif isinstance(layer, keras.layers.Dense):
            total += 2 * layer.input.shape[-1] * layer.units
    return int(total)


def load_data(task):
    """`samples` CIFAR-sized images: the CIFAR-10 at `data_dir` tiled, else uniform noise."""
    import keras

    rng = np.random.default_rng(0)
    samples, source = task["samples"], "synthetic (uniform 0-255, random labels)"
    x = y = None
    if task.get("data_dir"):
        from keras_multigpu import data as data_lib

        try:
            (x, y), _ = data_lib.load_cifar10(task["data_dir"], download=False)
            source = f"CIFAR-10 at {task['data_dir']}: {len(x)} images tiled to {samples}"
        except (OSError, ValueError) as error:
            source = f"synthetic: CIFAR-10 at {task['data_dir']} unreadable ({error})"
            x = None
    if x is None:
        x = rng.integers(0, 256, (samples, 32, 32, 3), dtype=np.uint8)
        y = rng.integers(0, 10, samples)
    repeats = math.ceil(samples / len(x))
    x = np.tile(x, (repeats, 1, 1, 1))[:samples].astype("float32")
    y = keras.utils.to_categorical(np.tile(y, repeats)[:samples], 10).astype("float32")
    return x, y, source


def check_accelerator(task):
    """In GPU mode, refuses to measure on a CPU fallback (a missing CUDA plugin)."""
    import keras

    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        platform = jax.devices()[0].platform
        name = str(jax.devices()[0].device_kind)
    else:
        import torch

        platform = "gpu" if torch.cuda.is_available() else "cpu"
        name = torch.cuda.get_device_name(0) if platform == "gpu" else "cpu"
    if task["gpu"] and platform != "gpu":
        raise RuntimeError(f"GPU mode, but {backend} runs on {platform}: its CUDA build "
                           "is missing or failed to start")
    return {"backend": backend, "platform": platform, "device": name}


def matmul_ceiling(task):
    """TFLOP/s of a large bf16 matrix product on random data (JAX): the measured ceiling."""
    import jax
    import jax.numpy as jnp

    n = task["matmul_size"]
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    # Two operand pairs, alternated, so that no repeat reads what the last one left cached.
    pairs = [(jax.random.normal(keys[i], (n, n), jnp.bfloat16),
              jax.random.normal(keys[i + 2], (n, n), jnp.bfloat16)) for i in range(2)]
    product = jax.jit(lambda a, b: a @ b)
    for a, b in pairs:
        product(a, b).block_until_ready()
    times = []
    for r in range(task["matmul_repeats"]):
        a, b = pairs[r % 2]
        start = time.perf_counter()
        product(a, b).block_until_ready()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    return {"size": n, "repeats": len(times), "median_seconds": seconds,
            "tflops": 2 * n**3 / seconds / 1e12}


def deadline_callback(deadline, minimum):
    """Stops `fit` at an epoch's end once `deadline` (time.time()) has passed and
    `minimum` epochs have run."""
    import keras

    class Deadline(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch + 1 >= minimum and time.time() > deadline:
                self.model.stop_training = True

    return Deadline()


class Group:
    """The models of one process, kept per (engine, precision, augment, batchnorm)."""

    def __init__(self, task, x, y):
        self.task, self.x, self.y = task, x, y
        self.mean = x[: min(len(x), 10_000)].mean(axis=0)
        self.models = {}

    def model(self, record):
        import keras

        from keras_multigpu import experiment, multi_gpu_model

        batchnorm = record.get("batchnorm", True)
        key = (record["engine"], record["precision"], record["augment"], batchnorm)
        if key not in self.models:
            keras.config.set_dtype_policy(record["precision"])
            # (Not keras.utils.set_random_seed: it imports TensorFlow where installed.)
            template, _ = experiment.build_models(self.mean, self.task["width"],
                                                  record["augment"], seed=0,
                                                  batchnorm=batchnorm)
            model = multi_gpu_model(template, gpus=1) if record["engine"] == "ours" else template
            optimizer = keras.optimizers.SGD(5e-3, momentum=0.9)
            self.models[key] = {"model": model, "template": template, "optimizer": optimizer,
                                "spe": None, "flops": forward_flops(template)}
            keras.config.set_dtype_policy("float32")
        entry = self.models[key]
        if entry["spe"] != record["steps_per_execution"]:
            entry["model"].compile(optimizer=entry["optimizer"], loss="categorical_crossentropy",
                                   metrics=["accuracy"],
                                   steps_per_execution=record["steps_per_execution"])
            entry["spe"] = record["steps_per_execution"]
        return entry

    def measure(self, record, deadline):
        import keras

        from keras_multigpu import parallel as parallel_module
        from keras_multigpu.callbacks import EpochStats

        entry = self.model(record)
        if record["engine"] == "ours" and keras.backend.backend() == "jax":
            if record["placement"] == "host":
                parallel_module.RESIDENT_LIMIT_BYTES = 0
            else:  # resident, whatever the memory budget says
                parallel_module.RESIDENT_LIMIT_BYTES = float("inf")
                parallel_module.RESIDENT_FRACTION = float("inf")
        batch, steps = record["batch"], record["steps"]
        samples = batch * steps
        x, y = self.x[:samples], self.y[:samples]
        start = time.perf_counter()
        history = entry["model"].fit(
            x, y, batch_size=batch, epochs=1 + self.task["timed_epochs"], shuffle=True,
            verbose=0, callbacks=[EpochStats(samples), deadline_callback(deadline, 2)])
        wall = time.perf_counter() - start
        seconds = history.history["seconds"]
        timed = seconds[1:]
        steady = statistics.median(timed)
        step = steady / steps
        images_per_second = batch / step
        train_flops = 3 * entry["flops"]
        template = entry["template"]
        return {
            "batch": batch, "timed_steps_per_epoch": steps, "timed_epochs": len(timed),
            "timed_images": samples * len(timed), "epoch_seconds": seconds,
            "ms_per_step": 1000 * step, "images_per_second": images_per_second,
            "seconds_per_50k_epoch": CIFAR_IMAGES / images_per_second,
            "warmup_epoch_seconds": seconds[0],
            "compile_seconds_estimate": max(0.0, seconds[0] - steady),
            "forward_gflop_per_image": entry["flops"] / 1e9,
            "train_gflop_per_image": train_flops / 1e9,
            "achieved_tflops": images_per_second * train_flops / 1e12,
            "parameters": int(template.count_params()),
            "trainable_parameters": int(sum(math.prod(v.shape)
                                            for v in template.trainable_weights)),
            "fit_wall_seconds": wall,
            "final_loss": float(history.history["loss"][-1]),
        }


def main(task_path, events):
    with open(task_path) as f:
        task = json.load(f)
    if task.get("jax_cache"):
        import jax

        jax.config.update("jax_compilation_cache_dir", task["jax_cache"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    import keras  # noqa: F401  (the backend starts here)

    import keras_multigpu  # noqa: F401  (torch: joins its one-process group)

    device = check_accelerator(task)
    emit(events, {"event": "device", **device})
    group = None
    planned = time.time()
    for record in task["records"]:
        now = time.time()
        budget = record["budget_s"]
        planned += budget
        if task["deadline"] - now < 0.5 * budget:
            emit(events, {"event": "skipped", "id": record["id"],
                          "reason": f"the group's time ran out ({budget:.0f} s planned for it, "
                                    f"{max(0.0, task['deadline'] - now):.0f} s left)"})
            continue
        emit(events, {"event": "start", "id": record["id"], "time": now})
        # A record may use its own budget and whatever earlier records left unused.
        deadline = min(task["deadline"], max(now + budget, planned))
        try:
            if record["kind"] == "matmul":
                result = matmul_ceiling(task)
            else:
                if group is None:
                    x, y, source = load_data(task)
                    emit(events, {"event": "data", "source": source, "images": len(x)})
                    group = Group(task, x, y)
                result = group.measure(record, deadline)
        except Exception as error:  # one record's failure is a finding, not the end
            import traceback

            emit(events, {"event": "failed", "id": record["id"],
                          "error": f"{type(error).__name__}: {error}"[-1500:],
                          "traceback": traceback.format_exc()[-3000:]})
            continue
        emit(events, {"event": "record", "id": record["id"],
                      "seconds": time.time() - now, **device, **result})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
