"""The verdict on a training run: what held it back, with its evidence and fixes.

`verdict()` judges the step timings and device samples that `DeviceMonitor`
collects (input-bound, communication-bound, compute-bound, a lagging device
or process); `communication_estimate()` models the gradient all-reduce over
the GPUs' link. Pure functions of those figures: no NVML, no framework.
"""

import math

import numpy as np

HIGHLY_INPUT_BOUND = 0.20  # xprof's threshold for "highly input-bound"
MODERATELY_INPUT_BOUND = 0.05
LAG_POINTS = 25.0  # mean utilisation gap, in percentage points, between devices
BUSY_UTILISATION = 70.0
# An all-reduce estimated at >= 20% of the step: as xprof's highly input-bound, a fifth of
# the step is where adding devices stops paying (efficiency <= 80% without overlap).
COMMUNICATION_BOUND = 0.20
_ON_CPU = "no GPU: the CPU does the work"
RANK_LAG_FACTOR = 2.0  # a process whose batches take twice the others' holds them back


def verdict(steps, timeline, measured="dataset", gpus=0, ranks=None, communication=None,
            accelerator=None):
    """What held training back, from the step timings and the device samples.

    Args:
        steps: `(step, epoch, data_ms, step_ms)` rows; the first step (which
            compiles) is left out of the sums.
        timeline: `(seconds, device, util, sm_activity, sm_occupancy,
            memory)` rows, empty without NVML.
        measured: `"dataset"` (batch production timed on the training
            thread), `"workers"` (timed on a PyDataset's worker threads: an
            upper bound on the wait) or `"none"` (a plain Keras model, or
            worker processes: `data_ms` is None).
        gpus: how many GPUs were sampled.
        ranks: with several processes, one dict per process (`rank`, `host`,
            `steps`, `data_ms`, `step_ms`: per-step means, `measured`); the
            slowest process's input is the one every process waits for.
        communication: the gradient all-reduce's estimated cost (`ms`,
            `link`, `grad_bytes`, `replicas`), or None where there is none to
            estimate (one device, or no GPU link known).
        accelerator: what the model trains on, `"gpu"` or `"cpu"` (None:
            unknown), for the wording when no GPU was sampled.

    Returns:
        A dict: `input` (`"highly"`, `"moderately"`, `"no"` or `"unknown"`), `bound`
        (`"input"`, `"compute"`, `"communication"` or `"unclear"`),
        `lagging_device` (an id or None), `lagging_rank`, `communication`,
        `evidence` (the numbers), `lines` (what is printed) and `fixes`.
    """
    if len(steps) < 2:
        line = (f"nothing to judge: {len(steps)} step(s) ran" + (
            ", the first of which compiles" if steps else "") + ".")
        return {"input": "unknown", "bound": "unclear", "lagging_device": None,
                "lagging_rank": None, "communication": "not estimated",
                "evidence": {"steps": 0, "data_ms_per_step": 0.0, "step_ms_per_step": 0.0,
                             "data_share": 0.0, "data_measured": measured,
                             "mean_utilization": {}, "mean_sm_activity": None,
                             "ranks": ranks},
                "lines": [line], "fixes": []}
    count, data_ms, step_ms = per_step(steps)
    evidence = {
        "steps": count,
        "data_ms_per_step": data_ms,
        "step_ms_per_step": step_ms,
        "data_measured": measured,
        "mean_utilization": _mean_by_device(timeline, gpus, 2),
        "mean_sm_activity": _mean([row[3] for row in timeline]),
        "ranks": ranks,
    }
    lines, fixes = [], []
    worst = _slowest_input(ranks) if ranks else None
    if worst is not None:  # every process waits for the one whose batches come last
        evidence.update(data_ms_per_step=worst["data_ms"], step_ms_per_step=worst["step_ms"],
                        data_measured=worst["measured"], data_rank=worst["rank"])
        measured = worst["measured"]
    step_ms = evidence["step_ms_per_step"]
    share = evidence["data_ms_per_step"] / step_ms if step_ms > 0 else 0.0
    evidence["data_share"] = share
    input_level = ("unknown" if measured == "none" else "highly" if share >= HIGHLY_INPUT_BOUND
                   else "moderately" if share >= MODERATELY_INPUT_BOUND else "no")
    if measured == "workers" and input_level != "no":
        input_level = "unknown"  # an upper bound above the threshold proves nothing
    lines.append(_input_line(input_level, evidence, worst))
    if input_level in ("highly", "moderately"):
        fixes += ["produce batches faster: more PyDataset workers (workers=, "
                  "use_multiprocessing=) or tf.data prefetch/num_parallel_calls",
                  "move augmentation onto the device (keras preprocessing layers in the model)",
                  "keep array data on the device (multi_gpu_model places arrays that fit)"]
    comm_share = None
    if communication is not None and step_ms > 0:
        comm_share = communication["ms"] / step_ms
        evidence["communication_share"] = comm_share
        lines.append(_communication_line(communication, step_ms, comm_share))
    mean = evidence["mean_utilization"]
    busy = mean and min(mean.values()) >= BUSY_UTILISATION
    if input_level == "highly":
        bound = "input"
    elif comm_share is not None and comm_share >= COMMUNICATION_BOUND:
        bound = "communication"
        fixes.append("a larger batch per device (fewer all-reduces per image), or fewer "
                     "devices over a faster link (keras-multigpu devices shows the links)")
    elif input_level in ("no", "moderately") and (not gpus or busy):
        bound = "compute"
        where = (_ON_CPU if accelerator == "cpu" else
                 "GPU utilisation not sampled: NVML unavailable" if accelerator == "gpu" else
                 "no GPU samples") if not gpus else (
            "GPU utilisation " + ", ".join(f"gpu:{d} {u:.0f}%" for d, u in mean.items()))
        lines.append(f"compute-bound ({where}).")
        fixes.append("a larger batch per device, mixed precision, or more devices")
    else:
        bound = "unclear"
        if mean and input_level != "unknown":
            lines.append("GPUs under-used with little data wait: "
                         + ", ".join(f"gpu:{d} {u:.0f}%" for d, u in mean.items())
                         + "; steps may be too small to fill them.")
            fixes.append("a larger batch per device")
    if bound != "compute" and not gpus and accelerator == "cpu":
        lines.append(f"{_ON_CPU}.")  # whatever held it back
    lagging = None
    if len(mean) > 1 and max(mean.values()) - min(mean.values()) > LAG_POINTS:
        lagging = min(mean, key=mean.get)
        lines.append(f"one device lags: gpu:{lagging} averages {mean[lagging]:.0f}% against "
                     f"{max(mean.values()):.0f}% on the busiest; check its PCIe link and "
                     "clocks (keras-multigpu devices) and other processes on it.")
    lagging_rank = _lagging_rank(ranks, lines) if ranks else None
    if evidence["mean_sm_activity"] is not None:
        lines.append(f"SM activity (GPM) averages {evidence['mean_sm_activity']:.0f}%.")
    return {"input": input_level, "bound": bound, "lagging_device": lagging,
            "lagging_rank": lagging_rank,
            "communication": "not estimated" if comm_share is None else (
                "bound" if comm_share >= COMMUNICATION_BOUND else "not bound"),
            "evidence": evidence, "lines": lines, "fixes": fixes}


def per_step(steps):
    """`(steps, data ms, step ms)`: the per-step means, the first (compiling) step left out."""
    timed = steps[1:]
    count = max(len(timed), 1)
    return (len(timed), sum(row[2] or 0.0 for row in timed) / count,
            sum(row[3] for row in timed) / count)


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _mean_by_device(timeline, gpus, column):
    means = {d: _mean([row[column] for row in timeline if row[1] == d]) for d in range(gpus)}
    return {d: m for d, m in means.items() if m is not None}


def _slowest_input(ranks):
    """The process whose batch production takes the largest share of its step."""
    timed = [r for r in ranks if r["measured"] != "none" and r["step_ms"] > 0]
    return max(timed, key=lambda r: r["data_ms"] / r["step_ms"]) if timed else None


def _input_line(level, evidence, worst):
    how = {"dataset": "batch production", "workers": "batch production on worker threads, "
           "overlapping the steps (an upper bound on the wait)",
           "none": ""}[evidence["data_measured"]]
    where = "" if worst is None else f" on rank {worst['rank']}, the slowest to produce them"
    numbers = (f"data {evidence['data_ms_per_step']:.1f} ms of a "
               f"{evidence['step_ms_per_step']:.1f} ms step "
               f"({100 * evidence['data_share']:.0f}%, {how}{where})")
    if level == "unknown" and evidence["data_measured"] == "workers":
        return (f"input not judged: {numbers}; the wait itself is hidden behind the steps "
                "as far as the workers keep ahead.")
    if level == "unknown":
        return (f"data wait not measured ({evidence['step_ms_per_step']:.1f} ms per step): a "
                "plain Keras model fetches its batch inside the step, out of a callback's "
                "sight (wrap it with multi_gpu_model to measure it).")
    return f"{level} input-bound: {numbers}." if level != "no" else f"not input-bound: {numbers}."


def _communication_line(c, step_ms, share):
    return (f"communication (estimated, not measured): a ring all-reduce of "
            f"{c['grad_bytes'] / 1e6:.1f} MB of gradients over {c['replicas']} GPUs on "
            f"{c['link']} takes about {c['ms']:.2f} ms, {100 * share:.0f}% of the "
            f"{step_ms:.1f} ms step" + (f" ({c['note']})" if c.get("note") else "")
            + (" — communication-bound." if share >= COMMUNICATION_BOUND else "."))


def _lagging_rank(ranks, lines):
    """A process whose input takes far longer than the others' (the rest wait for it)."""
    timed = sorted((r for r in ranks if r["measured"] != "none"), key=lambda r: r["data_ms"])
    if len(timed) < 2:
        return None
    slowest, others = timed[-1], timed[:-1]
    typical = others[len(others) // 2]["data_ms"]
    if (slowest["data_ms"] - typical < MODERATELY_INPUT_BOUND * slowest["step_ms"]
            or slowest["data_ms"] < RANK_LAG_FACTOR * typical):
        return None
    lines.append(f"one process lags: rank {slowest['rank']} ({slowest['host']}) takes "
                 f"{slowest['data_ms']:.1f} ms per batch against {typical:.1f} ms on the "
                 "others, which wait for it at every step; check that machine's load and "
                 "its data path (local disk, CPU cores per process).")
    return slowest["rank"]


def communication_estimate(model, gpu_links):
    """The ring all-reduce of `model`'s gradients over the slowest link among the GPUs.

    Modelled (see `bench.scaling`): 2 (N - 1) / N * S / B + 2 (N - 1) * a, for
    N replicas, S gradient bytes (the trainable variables' own dtypes) and the
    link NVML reports. None for one replica, or when NVML gave no link.
    """
    replicas = getattr(model, "num_replicas", 1)
    if replicas < 2 or not gpu_links or any(link is None for link in gpu_links):
        return None
    name, bandwidth, latency = min(gpu_links, key=lambda link: link[1])
    grad_bytes = sum(math.prod(v.shape) * np.dtype(v.dtype).itemsize
                     for v in model.trainable_variables)
    seconds = 2 * (replicas - 1) / replicas * grad_bytes / bandwidth + 2 * (replicas - 1) * latency
    return {"ms": 1000 * seconds, "link": name, "grad_bytes": int(grad_bytes),
            "replicas": replicas, "modelled": True}
