"""`keras-multigpu bench`: ours against plain Keras and the peers, on one machine.

    from keras_multigpu import bench
    results = bench.run(bench.default_setups(2), bench.spec(model="minigooglenet"))
"""

from keras_multigpu.bench.harness import format_table, run
from keras_multigpu.bench.setups import Setup, default_setups, parse


def spec(model="minigooglenet", width=0.25, samples=2048, epochs=3, batch_per_device=64,
         precision="float32", step_repeats=10, fit_calls=3, fit_epochs=1, placement="auto"):
    """The workload every setup runs (synthetic CIFAR-sized data).

    `epochs` steady epochs are timed inside one `fit`; then `fit_calls`
    whole `fit` calls of `fit_epochs` epochs each are timed (0 skips them).
    `placement` ("auto", "resident" or "host") forces where our setups keep
    the array data: on every device, or on the host with each batch placed
    (and the next prefetched) while a step runs.
    """
    if placement not in ("auto", "resident", "host"):
        raise ValueError(
            f"placement must be 'auto', 'resident' or 'host'. Received: placement={placement!r}."
        )
    return {"model": model, "width": width, "samples": samples, "epochs": epochs,
            "batch_per_device": batch_per_device, "precision": precision,
            "step_repeats": step_repeats, "fit_calls": fit_calls, "fit_epochs": fit_epochs,
            "placement": placement}


__all__ = ["Setup", "default_setups", "format_table", "parse", "run", "spec"]
