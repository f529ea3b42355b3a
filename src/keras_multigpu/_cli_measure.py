"""The commands that measure: `keras-multigpu devices` (NVML, no framework) and
`keras-multigpu bench`."""

import dataclasses
import json
import os
import sys

from keras_multigpu import devices as devices_lib
from keras_multigpu._cli_args import UsageError, _needs_experiment
from keras_multigpu._cli_output import _check_output


def cmd_devices(args):
    from keras_multigpu import nvml

    found = devices_lib.list_devices()
    report = nvml.gpu_report()  # NVML only: no framework, no device memory
    cpus = sum(d.kind == "cpu" for d in found)
    if args.json:
        print(json.dumps({"devices": [dataclasses.asdict(d) for d in found], **report,
                          "cpu_devices": cpus}, indent=2))
        return 0
    for d in found:
        memory = f"{d.memory_bytes / 2**30:.1f} GiB" if d.memory_bytes else "-"
        print(f"{str(d):8} {d.name:32} {memory}")
    if not report["gpus"]:
        reason = report["nvml"] if report["nvml"] != "ok" else "no GPU visible"
        print(f"No GPU found (NVML: {reason}); CPU devices: {cpus}")
    for gpu in report["gpus"]:
        print(_gpu_line(gpu))
    return 0


def _gpu_line(gpu):
    """One GPU's NVML facts on a line; '?' where NVML could not say (e.g. '? W')."""
    def shown(value, form):
        return form.replace("{:.0f}", "?").replace("{}", "?") if value is None else (
            form.format(value))

    used, total = gpu["memory_used_bytes"], gpu["memory_total_bytes"]
    memory = "?" if used is None else f"{used / 2**30:.1f}/{total / 2**30:.1f} GiB"
    links = gpu["nvlink"]
    nvlink = "none" if links is None else f"{sum(links)}/{len(links)} links up"
    return (f"gpu:{gpu['id']} {shown(gpu['name'], '{}')}: memory {memory}, util "
            f"{shown(gpu['utilization_gpu'], '{}%')}, {shown(gpu['temperature_c'], '{} C')}, "
            f"{shown(gpu['power_w'], '{:.0f} W')}, PCIe gen {shown(gpu['pcie_generation'], '{}')}"
            f" x{shown(gpu['pcie_width'], '{}')}, NVLink {nvlink}")


PROJECT_MAX_STEPS = 8  # `bench --project` measures at most this many steps per epoch


def _cmd_project(args):
    """`bench --project`: the cost model alone, from --step-ms or one short ours-1 run."""
    from keras_multigpu import bench
    from keras_multigpu.bench import harness

    if args.setups:
        raise UsageError("--project runs no setups; leave out --setups")
    batch = args.batch_per_device
    spec = bench.spec(
        model=args.model, width=args.width, samples=min(args.samples, PROJECT_MAX_STEPS * batch),
        epochs=1, batch_per_device=batch, precision=args.precision, fit_calls=0,
        placement=args.placement)
    results = harness.project_only(spec, step_ms=args.step_ms, parameters=args.params,
                                   hosts=args.hosts, gpus_per_host=args.gpus_per_host,
                                   output=args.output, timeout=args.timeout)
    print(harness.format_projection(results["projection"]))
    print(f"\nWrote {os.path.join(args.output, 'projection.json')}")
    return 0


def cmd_bench(args):
    _needs_experiment(args.command)
    from keras_multigpu import bench

    if args.project:
        return _cmd_project(args)
    _check_output(args.output, overwrite=True)  # bench replaces its own results
    if args.setups is not None:
        names = [name.strip() for name in args.setups.split(",") if name.strip()]
        if not names:
            raise UsageError(f"--setups names no setup. Received: --setups {args.setups!r}; "
                             "pass e.g. --setups plain-1,ours-2, or leave it out for the defaults")
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise UsageError(f"--setups names {', '.join(repeated)} more than once. Received: "
                             f"--setups {args.setups!r}; --rounds repeats every setup")
        setups = [bench.parse(name) for name in names]
    else:
        found = devices_lib.list_devices()
        count = args.devices or (len(found) if found[0].kind == "gpu" else 2)
        setups = bench.default_setups(count)
    spec = bench.spec(model=args.model, width=args.width, samples=args.samples,
                      epochs=args.epochs, batch_per_device=args.batch_per_device,
                      precision=args.precision, fit_calls=args.fit_calls,
                      fit_epochs=args.fit_epochs, placement=args.placement)
    results = bench.run(setups, spec, rounds=args.rounds, output=args.output,
                        timeout=args.timeout, step_ms=args.step_ms, parameters=args.params,
                        hosts=args.hosts, gpus_per_host=args.gpus_per_host)
    print(bench.format_table(results))
    if not results["table"]:  # every setup failed or was skipped: no figure to show
        print("keras-multigpu bench: no setup was measured (see the reasons above)",
              file=sys.stderr)
        return 1
    return 0
