"""One benchmark configuration, measured inside its own process.

Run by the harness as `python -m keras_multigpu.bench.worker SPEC_JSON`; prints
one JSON line. The environment (backend, device count) is set by the parent
before this process starts, because both are fixed when the framework starts;
nothing else imports this module.

Two views of the same training are measured. *Steady epochs*: one `fit` of
1 + `epochs` epochs, the first (compiling) epoch left out. *Fit calls*: after
that `fit` (the warm-up), `fit_calls` complete `fit` calls of `fit_epochs`
epochs each, timed whole, as a user who calls `fit` repeatedly (or a harness
that times `fit`) sees them. What a call costs beyond its epochs is the
per-call work of the engine: data placement, state placement, building the
iterator, anything compiled anew.
"""

import atexit
import contextlib
import itertools
import json
import math
import os
import re
import resource
import shutil
import statistics
import sys
import tempfile
import time

# JAX setups: XLA writes each compiled training step's optimised HLO here (set before JAX
# starts, hence before Keras is imported), and `compiled_collectives` counts its
# collectives. The step is compiled in the warm-up epoch, which no figure times.
HLO_DIR = None
if os.environ.get("KERAS_BACKEND") == "jax" and "--xla_dump_to" not in os.environ.get(
        "XLA_FLAGS", ""):
    HLO_DIR = tempfile.mkdtemp(prefix="kmg-bench-hlo-")
    atexit.register(shutil.rmtree, HLO_DIR, True)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={HLO_DIR}"
                               " --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*train.*")

import keras  # noqa: E402

from keras_multigpu.bench.counters import CollectiveCounter, TracedCollectives  # noqa: E402
from keras_multigpu.callbacks import DeviceMonitor, EpochStats  # noqa: E402


def build_model(name, width):
    from keras_multigpu import models

    if name == "minigooglenet":
        return models.mini_googlenet(width=width)
    if name == "minigooglenet_nobn":  # the same convolutions, no statistics across the batch
        return models.mini_googlenet(width=width, batchnorm=False)
    if name == "dense":  # per-step overhead: almost no compute per step
        return keras.Sequential([keras.Input((32, 32, 3)), keras.layers.Flatten(),
                                 keras.layers.Dense(64, activation="relu"),
                                 keras.layers.Dense(10, activation="softmax")])
    raise ValueError("model must be minigooglenet, minigooglenet_nobn or dense. "
                     f"Received: model={name!r}.")


def compiled_step_seconds(model, x, y, repeats):
    """Seconds per call of the compiled training step alone, on placed data.

    The batch is placed on the devices once and the step is called on it
    repeatedly: no host data work, no callbacks. Wall time per step minus
    this is what happens outside the step. JAX engines only.
    """
    import jax

    from keras_multigpu import ParallelModel
    from keras_multigpu._keras.jax import trainer as jax_trainer

    scope = contextlib.nullcontext()
    batch = (x, y)
    if isinstance(model, ParallelModel):
        batch = model._pad_one(x, y)  # as its dataset would yield it
        scope = model._placed()
    with scope:
        data = jax_trainer._distribute_data(batch)
        state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                     optimizer_variables=True, metrics_variables=True)
        for _ in range(2):  # warm-up (compiled already by fit; the cache is hit)
            _, state = model.train_function(state, itertools.repeat(data))
        jax.block_until_ready(state)
        start = time.perf_counter()
        for _ in range(repeats):
            _, state = model.train_function(state, itertools.repeat(data))
        jax.block_until_ready(state)
    # The state was donated to the step: this model is not used again.
    return (time.perf_counter() - start) / repeats


_COLLECTIVE = re.compile(r"= (.+?) (all-reduce|all-reduce-start|all-gather|all-gather-start|"
                         r"reduce-scatter|all-to-all|collective-permute|"
                         r"collective-permute-start)\(")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f16": 2, "bf16": 2, "s16": 2, "u16": 2, "f32": 4,
          "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def compiled_collectives(folder):
    """(collectives, bytes) in one call of the compiled training step, from XLA's dump of
    its optimised HLO (after XLA combined them), or None when no step was dumped.

    Of several training modules (recompiled for another shape), the last compiled.
    """
    if folder is None or not os.path.isdir(folder):
        return None
    steps = sorted(f for f in os.listdir(folder)  # module_NNNN.<name>...: in compile order
                   if "train" in f and f.endswith("after_optimizations.txt"))
    if not steps:
        return None
    count = size = 0
    with open(os.path.join(folder, steps[-1])) as f:
        for line in f:
            found = _COLLECTIVE.search(line)
            if found is None:
                continue
            count += 1
            for dtype, dims in re.findall(r"([a-z]+\d*)\[([\d,]*)\]", found.group(1)):
                size += _BYTES.get(dtype, 4) * int(
                    math.prod(int(d) for d in dims.split(",") if d))
    return count, size


class CompileCounter:
    """Counts XLA compilations (JAX's backend-compile events) while it is on.

    JAX emits one `/jax/core/compile/backend_compile_duration` event per
    program compiled; a fit call of a warm model should emit none.
    """

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        from jax import monitoring

        self.count, self.seconds, self.on = 0, 0.0, False
        monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event, duration, **_):
        if self.on and event == self.EVENT:
            self.count += 1
            self.seconds += duration

    @contextlib.contextmanager
    def counting(self):
        self.count, self.seconds, self.on = 0, 0.0, True
        try:
            yield self
        finally:
            self.on = False


def time_fit_calls(model, x, y, batch, samples, calls, epochs, compiles=None):
    """Times `calls` complete `model.fit` calls of `epochs` epochs each.

    Returns one record per call: its wall seconds, the seconds inside its
    epochs (`EpochStats`, so what the call costs outside them is the
    difference) and the programs compiled during it (None when not counted).
    """
    records = []
    for _ in range(calls):
        stats = EpochStats(samples)
        scope = compiles.counting() if compiles is not None else contextlib.nullcontext()
        with scope:
            start = time.perf_counter()
            history = model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0,
                                callbacks=[stats])
            seconds = time.perf_counter() - start
        records.append({"seconds": seconds, "epoch_seconds": sum(history.history["seconds"]),
                        "compiles": None if compiles is None else compiles.count})
    return records


def fit_call_figures(calls, samples, epochs):
    """The per-call figures of `time_fit_calls` records (medians over calls)."""
    if not calls:
        return {"fit_call_ms": None, "fit_call_images_per_second": None,
                "fit_call_outside_epochs_ms": None, "fit_call_compiles": None}
    seconds = statistics.median(c["seconds"] for c in calls)
    counted = [c["compiles"] for c in calls if c["compiles"] is not None]
    return {
        "fit_call_ms": 1000 * seconds,
        "fit_call_images_per_second": samples * epochs / seconds,
        "fit_call_outside_epochs_ms": 1000 * statistics.median(
            c["seconds"] - c["epoch_seconds"] for c in calls),
        "fit_call_compiles": max(counted) if counted else None,
    }


def measure(spec):
    from keras_multigpu.bench import setups

    setup = setups.parse(spec["setup"])
    import numpy as np

    placement = spec.get("placement", "auto")
    if placement != "auto":
        from keras_multigpu import parallel as parallel_module

        if placement == "host":
            parallel_module.RESIDENT_LIMIT_BYTES = 0
        else:  # resident, whatever the budget says
            parallel_module.RESIDENT_LIMIT_BYTES = parallel_module.RESIDENT_FRACTION = float("inf")

    keras.config.set_dtype_policy(spec.get("precision", "float32"))
    keras.utils.set_random_seed(0)
    batch = spec["batch_per_device"] * setup.devices
    steps = max(spec["samples"] // batch, 1)
    samples = steps * batch
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 255, (samples, 32, 32, 3)).astype("float32")
    y = keras.utils.to_categorical(rng.integers(0, 10, samples), 10)
    fit_calls, fit_epochs = spec.get("fit_calls", 0), spec.get("fit_epochs", 1)
    compiles = CompileCounter() if setup.backend == "jax" else None
    collectives = CollectiveCounter() if setup.engine in setups.RANKED else None
    traced = TracedCollectives() if setup.backend == "tensorflow" else None

    def fit(model):
        counting = contextlib.nullcontext() if collectives is None else collectives.counting()
        with tempfile.TemporaryDirectory() as folder, counting:  # the verdict is kept
            watch = DeviceMonitor(folder)
            history = model.fit(x, y, batch_size=batch, epochs=1 + spec["epochs"],
                                shuffle=False, verbose=0, callbacks=[EpochStats(samples), watch])
        fit.seconds = history.history["seconds"]
        found = watch.verdict  # None for a loop of its own (ddp_torch), which calls no callback
        fit.monitor = None if found is None else {
            "bound": found["bound"], "input": found["input"], "lines": found["lines"],
            "data_share": found["evidence"]["data_share"]}
        # After the fit above (the warm-up), and before the compiled step below,
        # which consumes the model's state.
        fit.calls = time_fit_calls(model, x, y, batch, samples, fit_calls, fit_epochs, compiles)
        if setup.backend == "jax":
            fit.step = compiled_step_seconds(model, x[:batch], y[:batch], spec["step_repeats"])
        fit.params = model.count_params()
        return model

    fit.step = None
    setups.TRAIN[setup.engine](setup, lambda: build_model(spec["model"], spec["width"]), fit)
    steady = statistics.median(fit.seconds[1:])
    wall_step = steady / steps
    # Per step of the first fit call (its 1 + epochs epochs), what it starts and ends with
    # included; None where the setup runs no torch.distributed process group.
    fit_steps = (1 + spec["epochs"]) * steps
    per_step = {}
    compiled = compiled_collectives(HLO_DIR) if setup.backend == "jax" else None
    if compiled is not None:  # what the compiled step runs; no store on JAX
        per_step = {"collectives_per_step": compiled[0],
                    "collective_kb_per_step": compiled[1] / 1024}
    if collectives is not None:
        buckets, bucket_bytes = collectives.ddp_buckets()
        per_step = {
            "collectives_per_step": collectives.count / fit_steps + buckets,
            "collective_kb_per_step": (collectives.bytes / fit_steps + bucket_bytes) / 1024,
            "store_exchanges_per_step": collectives.store / fit_steps}
    if traced is not None:  # what the traced step runs; no store on TensorFlow
        count, size = traced.per_step()
        per_step = {"collectives_per_step": count, "collective_kb_per_step": size / 1024}
    return {
        "setup": setup.name, "engine": setup.engine, "devices": setup.devices,
        "global_batch": batch, "samples": samples, "steps_per_epoch": steps,
        "epoch_seconds": fit.seconds[1:], "images_per_second": samples / steady,
        "ms_per_step": 1000 * wall_step,
        "compiled_step_ms": None if fit.step is None else 1000 * fit.step,
        "outside_step_ms": None if fit.step is None else 1000 * (wall_step - fit.step),
        "compile_seconds": fit.seconds[0] - steady,
        "fit_calls": fit.calls,
        **fit_call_figures(fit.calls, samples, fit_epochs),
        "placement": placement,
        "data_mb": (x.nbytes + y.nbytes) / 2**20,
        "peak_host_memory_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "parameters": int(fit.params),
        "monitor": fit.monitor,
        "collectives_per_step": None, "collective_kb_per_step": None,
        "store_exchanges_per_step": None, **per_step,
    }


if __name__ == "__main__":
    print(json.dumps(measure(json.loads(sys.argv[1]))), flush=True)
