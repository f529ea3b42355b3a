"""`keras-multigpu bench`: ours against plain Keras and the peers, on one machine.

    from keras_multigpu import bench
    results = bench.run(bench.default_setups(2), bench.spec(model="minigooglenet"))
"""

from keras_multigpu.bench.harness import format_table, run
from keras_multigpu.bench.setups import Setup, default_setups, parse


def spec(model="minigooglenet", width=0.25, samples=2048, epochs=3, batch_per_device=64,
         precision="float32", step_repeats=10):
    """The workload every setup runs (synthetic CIFAR-sized data)."""
    return {"model": model, "width": width, "samples": samples, "epochs": epochs,
            "batch_per_device": batch_per_device, "precision": precision,
            "step_repeats": step_repeats}


__all__ = ["Setup", "default_setups", "format_table", "parse", "run", "spec"]
