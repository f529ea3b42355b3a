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

logger = logging.getLogger(__name__)

FIGURES = ("images_per_second", "ms_per_step", "compiled_step_ms", "outside_step_ms",
           "compile_seconds", "peak_host_memory_mb", "fit_call_ms", "fit_call_images_per_second",
           "fit_call_outside_epochs_ms", "fit_call_compiles")


def machine():
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
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
            ratio(name, f"independent_torch-{row['devices']}")
    return ratios


def projection(table, step_ms=None):
    one = table.get("ours-1")
    if one is None or (step_ms is None and one["compiled_step_ms"] is None):
        return None
    compute = (step_ms if step_ms is not None else one["compiled_step_ms"]["median"]) / 1000
    grad_bytes = 4 * one["parameters"]
    return {"compute_ms": compute * 1000, "grad_bytes": grad_bytes,
            "source": "--step-ms" if step_ms is not None else "measured ours-1 compiled step",
            "assumptions": scaling.ASSUMPTIONS,
            "rows": scaling.project(compute, grad_bytes)}


def run(setups, spec, rounds=3, output=None, timeout=900, step_ms=None):
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
               "projection": projection(table, step_ms),
               "raw": runs}
    if output:
        os.makedirs(output, exist_ok=True)
        write_json(os.path.join(output, "results.json"), results)
        from keras_multigpu.bench import plots

        plots.draw(results, output)
    return results


def format_table(results):
    lines = [f"{'setup':16}{'dev':>4}{'img/s':>10}{'min':>9}{'max':>9}{'ms/step':>9}"
             f"{'in step':>9}{'outside':>9}{'compile s':>10}{'eff.':>6}"]
    for name, row in results["table"].items():
        median = {k: float("nan") if row[k] is None else row[k]["median"] for k in FIGURES}
        ips = row["images_per_second"]
        lines.append(f"{name:16}{row['devices']:>4}{ips['median']:>10.1f}{ips['min']:>9.1f}"
                     f"{ips['max']:>9.1f}{median['ms_per_step']:>9.2f}"
                     f"{median['compiled_step_ms']:>9.2f}{median['outside_step_ms']:>9.2f}"
                     f"{median['compile_seconds']:>10.1f}{row.get('efficiency', 1.0):>6.2f}")
    for name, reason in results["skipped"].items():
        lines.append(f"{name:16} skipped: {reason}")
    for name, errors in results.get("failures", {}).items():
        last = errors[-1].strip().splitlines()[-1][:150]
        lines.append(f"{name:16} failed in {len(errors)} round(s); last: {last}")
    lines += _format_fit_calls(results)
    lines.append("")
    lines += [f"{name:32} {value:.3f}" for name, value in results["ratios"].items()]
    if results.get("fit_call_ratios"):
        lines.append("Per fit call:")
        lines += [f"{name:32} {value:.3f}" for name, value in results["fit_call_ratios"].items()]
    if results["projection"]:
        p = results["projection"]
        lines.append(f"\nProjected efficiency from {p['source']} ({p['compute_ms']:.2f} ms, "
                     f"{p['grad_bytes'] / 1e6:.1f} MB of gradients); assumptions: "
                     f"{p['assumptions']}")
        for row in p["rows"]:
            lines.append(f"  {row['link']:22} {row['devices']:>3} GPUs: "
                         f"{100 * row['efficiency']:5.1f} % (no overlap), "
                         f"{100 * row['efficiency_overlap']:5.1f} % (overlap)")
    return "\n".join(lines)


def _format_fit_calls(results):
    """The per-call block of the table: whole `fit` calls of a warm model."""
    rows = {name: row for name, row in results["table"].items() if row.get("fit_call_ms")}
    if not rows:
        return []
    spec = results["spec"]
    lines = ["", f"Whole fit calls after a warm-up fit ({spec.get('fit_calls')} calls of "
                 f"{spec.get('fit_epochs')} epoch(s) each; medians over rounds):",
             f"{'setup':16}{'dev':>4}{'ms/call':>10}{'min':>10}{'max':>10}{'img/s':>10}"
             f"{'outside epochs ms':>19}{'compiles':>9}"]
    for name, row in rows.items():
        call, ips = row["fit_call_ms"], row["fit_call_images_per_second"]
        outside = row["fit_call_outside_epochs_ms"]["median"]
        compiles = row["fit_call_compiles"]
        lines.append(f"{name:16}{row['devices']:>4}{call['median']:>10.1f}{call['min']:>10.1f}"
                     f"{call['max']:>10.1f}{ips['median']:>10.1f}{outside:>19.2f}"
                     f"{'-' if compiles is None else int(compiles['max']):>9}")
    return lines
