"""Runs setups in their own processes, interleaved over rounds, and reports.

Round r runs every setup once, in order (A, B, C, A, B, C, ...), so that a
slow moment of the machine touches every setup alike. Each figure reported is
the median over rounds, with min and max. Speed-up and efficiency are against
`ours-1` (ours on one device).

Throughput is reported twice (see `worker`): over steady epochs inside one
`fit`, and over whole `fit` calls of a warm model (`fit_call_*`), which adds
what each call costs beyond its epochs.
"""

import contextlib
import importlib.metadata
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile

from keras_multigpu import launch
from keras_multigpu._io import write_json
from keras_multigpu.bench import scaling
from keras_multigpu.bench import setups as setups_lib
from keras_multigpu.bench.report import (  # noqa: F401 (bench's API)
    FIGURES,
    format_projection,
    format_table,
)

logger = logging.getLogger(__name__)


def cpu_name():
    """The CPU's model name (Linux's /proc/cpuinfo), else what `platform` says."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def machine():
    cpu = cpu_name()
    from keras_multigpu import devices

    versions = {}
    for package in ("keras", "jax", "jaxlib", "tensorflow", "numpy"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {"platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count(),
            "devices": [f"{d} {d.name}" for d in devices.list_devices()],
            "python": platform.python_version(), "versions": versions}


def run_worker(setup, spec, virtual, timeout):
    """Runs the setup's worker processes at once and returns their one result."""
    payload = json.dumps({**spec, "setup": setup.worker.name})
    with contextlib.ExitStack() as stack:
        # Files, not pipes: a process waited on later must not block on a full pipe.
        logs = [(stack.enter_context(tempfile.TemporaryFile("w+")),
                 stack.enter_context(tempfile.TemporaryFile("w+")))
                for _ in range(setup.processes)]
        port = launch.free_port()  # where ranked setups' processes meet
        workers = [subprocess.Popen(
            [sys.executable, "-m", "keras_multigpu.bench.worker", payload],
            env=setup.environment(os.environ, virtual, process, port), stdout=out, stderr=err,
            text=True) for process, (out, err) in enumerate(logs)]
        try:
            for worker in workers:
                worker.wait(timeout=timeout)
        finally:
            for worker in workers:
                if worker.poll() is None:
                    worker.kill()
                    worker.wait()
        results = []
        for worker, (out, err) in zip(workers, logs):
            out.seek(0)
            err.seek(0)
            lines = [line for line in out.read().splitlines() if line.startswith("{")]
            if worker.returncode != 0 or not lines:
                raise RuntimeError(f"benchmark worker {setup.name} failed "
                                   f"(exit {worker.returncode}):\n{err.read()[-3000:]}")
            results.append(json.loads(lines[-1]))
    return results[0] if len(results) == 1 else combine(setup, results)


def combine(setup, results):
    """One result for processes that ran at once: throughputs add, times are the slowest.

    The processes of a ranked setup train one model together: rank 0's figures are its.
    """
    if setup.engine in setups_lib.RANKED:
        return {**results[0], "processes": results}
    slowest = max(results, key=lambda r: r["ms_per_step"])
    per_call = [r.get("fit_call_images_per_second") for r in results]
    return {**slowest, "setup": setup.name, "engine": setup.engine, "devices": setup.devices,
            "images_per_second": sum(r["images_per_second"] for r in results),
            "fit_call_images_per_second": None if None in per_call else sum(per_call),
            "peak_host_memory_mb": sum(r["peak_host_memory_mb"] for r in results),
            "processes": results}


def _spread(values):
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(runs, spec):
    """Medians, spreads, speed-ups and the ratios the targets are stated in."""
    table = {}
    for name, results in runs.items():
        first = results[0]
        table[name] = {"engine": first["engine"], "devices": first["devices"],
                       "parameters": first["parameters"],
                       **{k: _spread([r.get(k) for r in results]) for k in FIGURES}}
    base = table.get("ours-1") or table.get("plain-1")
    for row in table.values():
        if base:
            speedup = row["images_per_second"]["median"] / base["images_per_second"]["median"]
            row["speedup"] = speedup
            row["efficiency"] = speedup / row["devices"]
    return table, _ratios(table, "images_per_second")


def _ratios(table, figure):
    """Throughput ratios (`figure`'s medians) of ours against its references."""
    ratios = {}

    def ratio(a, b):
        if a in table and b in table and table[a][figure] and table[b][figure]:
            ratios[f"{a} / {b}"] = table[a][figure]["median"] / table[b][figure]["median"]

    ratio("ours-1", "plain-1")
    ratio("ours_tf-1", "plain_tf-1")
    ratio("ours_torch-1", "plain_torch-1")
    # The next Keras's own speed, and its DataParallel against its own ceiling: what part
    # of ours' ratio to that DataParallel is the Keras version's rather than the engine's.
    ratio("plain_next_torch-1", "plain_torch-1")
    ratio("ours_next_torch-1", "plain_next_torch-1")
    for name, row in table.items():
        if row["engine"] == "ours" and row["devices"] > 1:
            ratio(name, "ours-1")
            ratio(name, f"dataparallel-{row['devices']}")
            ratio(name, f"mirrored-{row['devices']}")
            ratio(name, f"independent-{row['devices']}")
        if row["engine"] == "ours_tf" and row["devices"] > 1:
            ratio(name, "ours_tf-1")
            ratio(name, f"mirrored-{row['devices']}")
            ratio(name, f"independent_tf-{row['devices']}")
        if row["engine"] == "ours_torch" and row["devices"] > 1:
            ratio(name, "ours_torch-1")
            ratio(name, f"ddp_torch-{row['devices']}")
            ratio(name, f"keras_dp_torch-{row['devices']}")
            ratio(name, f"independent_torch-{row['devices']}")
        if row["engine"] == "ours_next_torch" and row["devices"] > 1:
            ratio(name, f"keras_dp_torch-{row['devices']}")
            ratio(name, f"independent_next_torch-{row['devices']}")
        if row["engine"] == "keras_dp_torch":
            ratio(name, f"independent_next_torch-{row['devices']}")
    return ratios


def projection(table, step_ms=None, parameters=None, hosts=scaling.DEFAULT_HOSTS,
               gpus_per_host=scaling.DEFAULT_GPUS_PER_HOST):
    """The cost model from `ours-1`'s compiled step (or `step_ms`) and parameter count."""
    one = table.get("ours-1")
    if one is None or (step_ms is None and one["compiled_step_ms"] is None):
        return None
    compute_ms = step_ms if step_ms is not None else one["compiled_step_ms"]["median"]
    return project_step(compute_ms, parameters or one["parameters"],
                        "--step-ms" if step_ms is not None else "measured ours-1 compiled step",
                        hosts, gpus_per_host)


def project_step(compute_ms, parameters, source, hosts=scaling.DEFAULT_HOSTS,
                 gpus_per_host=scaling.DEFAULT_GPUS_PER_HOST):
    """Modelled efficiency on one host, on several, and beside Horovod's published figures.

    `compute_ms`: one device's step; the gradients are `parameters` in fp32.
    """
    compute = compute_ms / 1000
    grad_bytes = 4 * parameters
    return {"compute_ms": compute_ms, "parameters": parameters, "grad_bytes": grad_bytes,
            "source": source, "modelled": True, "assumptions": scaling.ASSUMPTIONS,
            "rows": scaling.project(compute, grad_bytes),
            "multi_host": {
                "hosts": list(hosts), "gpus_per_host": gpus_per_host,
                "assumptions": scaling.MULTI_HOST_ASSUMPTIONS,
                "rows": scaling.project_hosts(compute, grad_bytes, hosts, gpus_per_host)},
            "horovod": scaling.horovod_comparison()}


def count_parameters(spec):
    """The parameter count of `spec`'s model, built here (nothing is trained)."""
    from keras_multigpu.bench import worker

    return int(worker.build_model(spec["model"], spec["width"]).count_params())


def project_only(spec, step_ms=None, parameters=None, hosts=scaling.DEFAULT_HOSTS,
                 gpus_per_host=scaling.DEFAULT_GPUS_PER_HOST, output=None, timeout=900):
    """The projection alone, without the benchmark's setups; writes projection.json.

    The one-device step is `step_ms`, else `ours-1`'s compiled step measured once
    on the devices at hand (one worker process running `spec`); the gradients
    are `parameters`, else the model's.
    """
    measured = None
    if step_ms is None:
        setup = setups_lib.Setup("ours", 1)
        result = run_worker(setup, spec, setups_lib.cpu_only(), timeout)
        if result["compiled_step_ms"] is None:
            raise RuntimeError("the ours-1 worker measured no compiled step")
        measured = {k: result[k] for k in ("setup", "devices", "global_batch", "steps_per_epoch",
                                           "compiled_step_ms", "ms_per_step",
                                           "images_per_second", "compile_seconds",
                                           "parameters")}
        step_ms, source = result["compiled_step_ms"], "measured ours-1 compiled step"
        parameters = parameters or result["parameters"]
    else:
        source = "--step-ms"
        parameters = parameters or count_parameters(spec)
    results = {"command": " ".join(sys.argv), "spec": spec, "machine": machine(),
               "measured": measured,
               "note": "every efficiency and time below is modelled (bench/scaling.py), "
                       "not measured; only 'measured' was measured, on 'machine'",
               "projection": project_step(step_ms, parameters, source, hosts, gpus_per_host)}
    if output:
        os.makedirs(output, exist_ok=True)
        write_json(os.path.join(output, "projection.json"), results)
    return results


def run(setups, spec, rounds=3, output=None, timeout=900, step_ms=None, parameters=None,
        hosts=scaling.DEFAULT_HOSTS, gpus_per_host=scaling.DEFAULT_GPUS_PER_HOST):
    """Measures every setup `rounds` times; writes results.json and plots to `output`."""
    virtual = setups_lib.cpu_only()
    skipped = {s.name: setups_lib.available(s) for s in setups if setups_lib.available(s)}
    active = [s for s in setups if s.name not in skipped]
    runs = {s.name: [] for s in active}
    failures = {}
    for round_ in range(rounds):
        for setup in active:
            try:
                result = run_worker(setup, spec, virtual, timeout)
            except (RuntimeError, subprocess.TimeoutExpired) as error:
                # A crashed or hung peer is a finding to report, not a reason to
                # lose every other measurement.
                failures.setdefault(setup.name, []).append(f"round {round_ + 1}: {error}"[-2000:])
                logger.warning("round %d %s failed", round_ + 1, setup.name)
                continue
            runs[setup.name].append(result)
            logger.info("round %d %s: %.1f img/s", round_ + 1, setup.name,
                        result["images_per_second"])
    runs = {name: results for name, results in runs.items() if results}
    table, ratios = summarize(runs, spec)
    results = {"command": " ".join(sys.argv), "spec": spec, "rounds": rounds,
               "virtual_cpu_devices": virtual, "machine": machine(), "skipped": skipped,
               "failures": failures,
               "table": table, "ratios": ratios,
               "fit_call_ratios": _ratios(table, "fit_call_images_per_second"),
               "projection": projection(table, step_ms, parameters, hosts, gpus_per_host),
               "verdicts": verdicts(table, runs, virtual),
               "raw": runs}
    if output:
        os.makedirs(output, exist_ok=True)
        write_json(os.path.join(output, "results.json"), results)
        from keras_multigpu.bench import plots

        plots.draw(results, output)
    return results


def verdicts(table, runs, virtual):
    """What held each setup back: DeviceMonitor's verdict in its worker (last round), and for
    ours on several devices, the step's growth over one device's at the same per-device batch.

    On GPUs that growth is the all-reduce and the synchronisation between devices
    (measured); on virtual CPU devices, which share the cores, it is shared compute,
    and not judged.
    """
    from keras_multigpu.diagnosis import COMMUNICATION_BOUND

    lines = []
    for name, results in runs.items():
        found = results[-1].get("monitor")
        if found:
            bound = "" if found["bound"] == "unclear" else f"{found['bound']}-bound; "
            lines.append(f"{name}: {bound}{found['lines'][0]}")
        row = table[name]
        one = table.get(f"{row['engine']}-1")
        if not row["engine"].startswith("ours") or row["devices"] < 2 or one is None:
            continue
        step, single = row["ms_per_step"]["median"], one["ms_per_step"]["median"]
        grown = max(0.0, 1 - single / step)
        numbers = (f"{step:.1f} ms per step against {single:.1f} ms on one device at the same "
                   f"per-device batch")
        if virtual:
            lines.append(f"{name}: {numbers}; its {row['devices']} virtual CPU devices share "
                         f"{os.cpu_count()} cores, so the step's time is shared compute, not "
                         "communication: not judged here.")
        elif grown >= COMMUNICATION_BOUND:
            lines.append(f"{name}: communication-bound (measured): {numbers}; {100 * grown:.0f}% "
                         "of the step is the all-reduce, the wait between devices and any host "
                         "work that grows with the global batch. Try a larger batch per "
                         "device.")
        else:
            lines.append(f"{name}: not communication-bound (measured): {numbers}; "
                         f"{100 * grown:.0f}% of the step is the all-reduce, the wait between "
                         "devices and any host work that grows with the global batch.")
    return lines
