"""The GPU measurement plan of issue 14, in one command (`benchmarks/gpu/run.sh`).

    python benchmarks/gpu/plan.py [OUT_DIR] [--toy] [--backends jax,torch] [--budget S]
    python benchmarks/gpu/plan.py [OUT_DIR] --reference [--epochs N] [--tile N] [--budget S]

Plan mode measures, on one GPU, MiniGoogLeNet at full width (the reference
experiment's model: mean subtraction, on-device shifts and flips, MiniGoogLeNet)
trained by Keras's `fit`, plain and through `multi_gpu_model(model, gpus=1)`
("ours"), on a 50,000-image CIFAR-sized array set: the CIFAR-10 found (the
shared subset, tiled) or uniform noise. The records (`matrix`) start from one
base configuration, the post's (JAX, ours, float32, 64 images per step,
`steps_per_execution` 1, data resident on the device, augmentation on), and
change one factor at a time: plain Keras, `mixed_bfloat16`, larger batches
(with `steps_per_execution` 8), `steps_per_execution` 8 and 32, the host path
with prefetch, no augmentation; and plain against ours on Keras's torch
backend. Each backend runs in its own process (`worker.py`).

Timing: each record's first epoch (compilation, data placement) is a warm-up;
then `timed_epochs` epochs of a fixed number of steps are timed and the
median epoch gives the step time, which is extrapolated to a 50,000-image
epoch (`seconds_per_50k_epoch`): the per-epoch cost of a real epoch (one
metrics sync) is spread over fewer steps here, so the figure is if anything
pessimistic. FLOPs are counted from the model (Conv2D and Dense layers, x3
for a training step); the bf16 peak comes from a table by GPU name (null on
a CPU) and a large bf16 matrix product is timed as the measured ceiling.

Every record has a time budget; the groups run one after the other within
`--budget` seconds, and a record that the time does not reach is reported as
skipped. The cost model of `keras-multigpu bench --project` is then run with
the fastest measured step, and with the post's 64 images per device.

Writes into OUT_DIR (default `$OUT`, else runs/gpu-plan), flat: machine.json,
results.json, plan.png, projection.json, summary.txt, log.txt.

Reference mode runs `keras-multigpu train` (70 epochs, linear decay, 64 per
device, augmentation) on the CIFAR-10 at hand (`--tile 50000`: its training
images repeated to 50,000) within `--budget` and writes machine.json,
reference.json, reference.png (beside the post's 74 and 19 minutes),
reference-history.json, reference-curves.png, reference-monitor.png (where
`train` draws one) and log.txt.

`--toy` (also `GPU_PLAN_TOY=1`, and automatic when no GPU is found) runs the
same records at CPU toy sizes (width 1/16, 512 images, batch 8, a few steps)
to check the whole path in well under a minute.
"""

import argparse
import concurrent.futures
import datetime
import importlib.metadata
import importlib.util
import io
import json
import math
import os
import pickle
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
CIFAR_IMAGES = 50_000
FORWARD_GFLOP_PER_IMAGE = 0.469  # MiniGoogLeNet at width 1 (the issue; recounted per record)

# The post this project started from (MiniGoogLeNet, CIFAR-10, 70 epochs, 64 per GPU).
POST = {"titan_x_1_seconds_per_epoch": 63, "titan_x_4_seconds_per_epoch": 16,
        "titan_x_1_total_minutes": 74, "titan_x_4_total_minutes": 19}
TARGETS = {"seconds_per_50k_epoch": 1.0, "speedup_over_titan_x": 63, "peak_fraction": 0.15,
           "ours_over_plain": 0.97}

# Dense bf16 tensor-core peak (TFLOP/s, no sparsity) by GPU name, vendor datasheets; the
# first entry whose key the name contains wins.
BF16_PEAK_TFLOPS = (
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.4), ("H200", 989.4),
    ("H800", 989.4), ("GH200", 989.4), ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0),
    ("L40S", 362.0), ("L4", 121.0), ("A10G", 70.0), ("A10", 125.0), ("RTX 4090", 165.2),
)

GPU_SIZES = {"width": 1.0, "samples": CIFAR_IMAGES, "timed_images": 6144, "timed_epochs": 3,
             "matmul_size": 8192, "matmul_repeats": 10, "budget": 510}
TOY_SIZES = {"width": 0.0625, "samples": 512, "timed_images": 16, "timed_epochs": 1,
             "matmul_size": 256, "matmul_repeats": 3, "budget": 300, "batch": 8}
# XLA:CPU compiles MiniGoogLeNet's step in about half the time at these levels (toy only).
TOY_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
# Seconds a record may take on the GPU: a new step program (compile, then four short
# epochs) or one already compiled (cached: another steps_per_execution, the host path).
# On an H200 (2026-11-26) a new program's record took 15-25 s with its process's share,
# the batch-1024 bf16 ones about 40 s (budgets are soft: a record may use what earlier
# ones left).
NEW_PROGRAM_S, CACHED_PROGRAM_S, TORCH_S, MATMUL_S = 25, 12, 20, 10
GROUP_START_S = 20  # starting a process: Python, the framework, CUDA
GRACE_S = 20  # past a group's deadline before its process is killed


def _short(precision):
    return {"float32": "fp32", "mixed_bfloat16": "bf16"}[precision]


def record(backend, engine, factor, precision="float32", batch=64, spe=1, placement=None,
           augment=True, pair=None, budget=None, batchnorm=True):
    """One measurement. `factor` says what it changes from the base configuration."""
    if placement is None:
        placement = ("keras" if engine == "plain"  # Keras's own data adapter
                     else "resident" if backend == "jax" else "host")
    rid = (f"{backend}/{engine}/{_short(precision)}/b{batch}/spe{spe}/{placement}/"
           f"{'aug' if augment else 'noaug'}{'' if batchnorm else '/nobn'}")
    if budget is None:
        budget = TORCH_S if backend == "torch" else NEW_PROGRAM_S
    return {"id": rid, "kind": "train", "backend": backend, "engine": engine, "factor": factor,
            "precision": precision, "plan_batch": batch, "steps_per_execution": spe,
            "placement": placement, "augment": augment, "batchnorm": batchnorm, "pair": pair,
            "budget_s": budget}


def matrix(backends=("jax", "torch"), beyond=False):
    """The records, in the order they run (most wanted first), grouped by backend; with
    `beyond`, also the larger batches that do not fit the whole plan's one call (`--only`
    names them)."""
    records = []
    if "jax" in backends:
        base = record("jax", "ours", "base: the post's configuration")
        plain = record("jax", "plain", "plain Keras at the base")
        bf16 = record("jax", "ours", "mixed_bfloat16", "mixed_bfloat16")
        plain_bf16 = record("jax", "plain", "plain Keras, mixed_bfloat16", "mixed_bfloat16")
        large = record("jax", "ours", "batch 1024, bf16, steps_per_execution 8",
                       "mixed_bfloat16", 1024, 8)
        plain_large = record("jax", "plain", "plain Keras, batch 1024, bf16, "
                             "steps_per_execution 8", "mixed_bfloat16", 1024, 8)
        base["pair"], bf16["pair"], large["pair"] = plain["id"], plain_bf16["id"], plain_large["id"]
        records += [
            {"id": "jax/matmul/bf16", "kind": "matmul", "backend": "jax", "engine": "matmul",
             "factor": "ceiling: a large bf16 matrix product", "pair": None,
             "budget_s": MATMUL_S},
            base, plain, bf16, plain_bf16, large, plain_large,
            record("jax", "ours", "steps_per_execution 8", spe=8, budget=CACHED_PROGRAM_S),
            record("jax", "ours", "steps_per_execution 32", spe=32, budget=CACHED_PROGRAM_S),
            record("jax", "ours", "host path with prefetch", placement="host",
                   budget=CACHED_PROGRAM_S),
            record("jax", "ours", "no augmentation", augment=False),
            record("jax", "ours", "batch 256, bf16, steps_per_execution 8", "mixed_bfloat16",
                   256, 8),
            # Past the fast end: does a larger batch reach 15 % of the bf16 peak?
            record("jax", "ours", "batch 2048, bf16, steps_per_execution 8", "mixed_bfloat16",
                   2048, 8, pair="jax/plain/bf16/b2048/spe8/keras/aug"),
            record("jax", "plain", "plain Keras, batch 2048, bf16, steps_per_execution 8",
                   "mixed_bfloat16", 2048, 8),
            # Where the fast end's time goes: its step without BatchNormalization (19
            # memory-bound layers), and without the on-device augmentation.
            record("jax", "ours", "the fast end without BatchNormalization", "mixed_bfloat16",
                   1024, 8, batchnorm=False),
            record("jax", "ours", "the fast end without augmentation", "mixed_bfloat16", 1024,
                   8, augment=False),
        ]
        if beyond:  # the share of the peak past batch 2048 (H200, 2026-11-26: 14.2 % at 4096)
            records += [
                record("jax", "ours", "batch 4096, bf16, steps_per_execution 8",
                       "mixed_bfloat16", 4096, 8, pair="jax/plain/bf16/b4096/spe8/keras/aug"),
                record("jax", "plain", "plain Keras, batch 4096, bf16, steps_per_execution 8",
                       "mixed_bfloat16", 4096, 8),
                # 8192 x 8 steps would exceed the 50,000 images: 4 steps per call.
                record("jax", "ours", "batch 8192, bf16, steps_per_execution 4",
                       "mixed_bfloat16", 8192, 4, pair="jax/plain/bf16/b8192/spe4/keras/aug"),
                record("jax", "plain", "plain Keras, batch 8192, bf16, steps_per_execution 4",
                       "mixed_bfloat16", 8192, 4),
            ]
    if "torch" in backends:  # steps_per_execution must be 1 on torch; ours takes the host path
        plain = record("torch", "plain", "torch: plain Keras")
        plain_bf16 = record("torch", "plain", "torch: plain Keras, bf16", "mixed_bfloat16")
        plain_large = record("torch", "plain", "torch: plain Keras, batch 1024, bf16",
                             "mixed_bfloat16", 1024)
        records += [
            record("torch", "ours", "torch: ours", pair=plain["id"]), plain,
            record("torch", "ours", "torch: ours, bf16", "mixed_bfloat16",
                   pair=plain_bf16["id"]), plain_bf16,
            record("torch", "ours", "torch: ours, batch 1024, bf16", "mixed_bfloat16", 1024,
                   pair=plain_large["id"]), plain_large,
        ]
    return records


def sized(records, sizes, toy):
    """Each record with the batch and step count it runs at (toy: one small batch)."""
    out = []
    for r in records:
        r = dict(r)
        if r["kind"] == "train":
            batch = sizes["batch"] if toy else r["plan_batch"]
            spe = r["steps_per_execution"]
            # A whole number of executions, at least one, of about `timed_images` images.
            steps = spe * math.ceil(math.ceil(sizes["timed_images"] / batch) / spe)
            if steps * batch > sizes["samples"]:
                raise ValueError(f"{r['id']}: {steps} steps of {batch} exceed the data")
            r.update(batch=batch, steps=steps)
        out.append(r)
    return out


def select(records, only):
    """The records whose id contains one of the comma-separated `only` strings (all: None)."""
    if not only:
        return records
    wanted = [part for part in only.split(",") if part]
    chosen = [r for r in records if any(part in r["id"] for part in wanted)]
    if not chosen:
        raise SystemExit(f"--only {only!r} selects no record")
    return chosen


# -- the machine ------------------------------------------------------------


def _version(package):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def nvml_gpus():
    """[{name, memory_total_bytes, ...}], driver and CUDA version, through NVML; else
    nvidia-smi; else none. Starts no framework and allocates nothing."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as error:  # no library, no driver, no GPU
        return _smi_gpus(f"NVML: {type(error).__name__}: {error}")
    try:
        def text(value):
            return value.decode() if isinstance(value, bytes) else value

        def maybe(function, *args):
            try:
                return function(*args)
            except Exception:
                return None

        cuda = maybe(pynvml.nvmlSystemGetCudaDriverVersion_v2)
        info = {"source": "nvml", "driver": text(maybe(pynvml.nvmlSystemGetDriverVersion)),
                "cuda_driver": None if cuda is None else f"{cuda // 1000}.{cuda % 1000 // 10}",
                "gpus": []}
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            memory = maybe(pynvml.nvmlDeviceGetMemoryInfo, handle)
            limit = maybe(pynvml.nvmlDeviceGetPowerManagementLimit, handle)
            info["gpus"].append({
                "index": i, "name": text(pynvml.nvmlDeviceGetName(handle)),
                "memory_total_bytes": None if memory is None else int(memory.total),
                "max_sm_clock_mhz": maybe(pynvml.nvmlDeviceGetMaxClockInfo, handle,
                                          pynvml.NVML_CLOCK_SM),
                "power_limit_w": None if limit is None else limit / 1000,
                "compute_capability": maybe(pynvml.nvmlDeviceGetCudaComputeCapability, handle),
            })
        return info
    finally:
        pynvml.nvmlShutdown()


def _smi_gpus(reason):
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
             "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30,
            check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {"source": "none", "reason": reason, "driver": None, "cuda_driver": None,
                "gpus": []}
    gpus, driver = [], None
    for i, line in enumerate(filter(None, out.splitlines())):
        name, driver, memory = (part.strip() for part in line.split(","))
        gpus.append({"index": i, "name": name, "memory_total_bytes": int(memory) * 2**20})
    return {"source": "nvidia-smi", "reason": reason, "driver": driver, "cuda_driver": None,
            "gpus": gpus}


def peak_bf16_tflops(name):
    for key, tflops in BF16_PEAK_TFLOPS:
        if name and key in name:
            return tflops
    return None


def source_info():
    """Which code runs: the wheels' record (wheels.sh), else git."""
    carried = os.path.join(REPO, ".whl", "source.json")
    if os.path.exists(carried):
        with open(carried) as f:
            return {"from": ".whl/source.json", **json.load(f)}
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO, capture_output=True, text=True, timeout=10).stdout
        return {"from": "git", "commit": commit, "dirty": bool(dirty.strip())}
    except (OSError, subprocess.SubprocessError):
        return {"from": "unknown"}


def machine_info(mode, gpu):
    from keras_multigpu.bench.harness import cpu_name

    cpu = cpu_name()
    name = gpu["gpus"][0]["name"] if gpu["gpus"] else None
    packages = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "keras", "torch",
                "numpy", "optree", "namex", "ml-dtypes", "h5py", "matplotlib", "nvidia-ml-py",
                "keras-multigpu")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mode": mode, "command": " ".join([os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]]),
        "gpu_name": name, "gpu_count": len(gpu["gpus"]), "driver": gpu.get("driver"),
        "cuda_driver": gpu.get("cuda_driver"), "gpus": gpu["gpus"], "gpu_source": gpu["source"],
        "gpu_detection_note": gpu.get("reason"),
        "bf16_peak_tflops": peak_bf16_tflops(name) if mode == "gpu" else None,
        "bf16_peak_source": "datasheet, dense (no sparsity), by GPU name" if name else None,
        "python": platform.python_version(), "executable": sys.executable,
        "platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(),
        "versions": {p: v for p in packages if (v := _version(p))},
        "source": source_info(),
        "env": {k: os.environ[k] for k in ("CUDA_VISIBLE_DEVICES", "XLA_FLAGS", "KERAS_BACKEND",
                                           "PYTHONPATH") if k in os.environ},
    }


# -- running the groups -----------------------------------------------------


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_environment(backend, toy):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("KERAS_MULTIGPU_") and k not in (
               "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "TF_CONFIG")}
    env["KERAS_BACKEND"] = backend
    env["PYTHONUNBUFFERED"] = "1"
    if toy:
        env["XLA_FLAGS"] = " ".join(filter(None, [env.get("XLA_FLAGS"), TOY_XLA_FLAGS]))
        env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    if backend == "torch":  # ours on torch is one process per device: here one, rank 0
        env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0",
                    "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    return env


def run_group(label, backend, records, task, deadline, work, log):
    """Runs `records` in worker processes until each has an outcome or time is up.

    A worker that dies takes the record it was on with it (failed); a new one
    goes on with the rest. Returns ({id: outcome}, [events]).
    """
    outcomes, events_seen = {}, []
    attempt = 0
    while True:
        remaining = [r for r in records if r["id"] not in outcomes]
        if not remaining:
            break
        if time.time() > deadline - 5:
            for r in remaining:
                outcomes[r["id"]] = {"status": "skipped", "reason": "the plan's time ran out "
                                     "before this record's process started"}
            break
        attempt += 1
        task_path = os.path.join(work, f"{label}-{attempt}.json")
        events = os.path.join(work, f"{label}-{attempt}.jsonl")
        with open(task_path, "w") as f:
            json.dump({**task, "records": remaining, "deadline": deadline}, f)
        log.write(f"\n===== {label} worker {attempt}: {len(remaining)} record(s), "
                  f"{deadline - time.time():.0f} s left =====\n")
        log.flush()
        command = [sys.executable, os.path.join(HERE, "worker.py"), task_path, events]
        started = time.time()
        with open(os.path.join(work, f"{label}-{attempt}.err"), "w+") as err:
            process = subprocess.Popen(command, env=group_environment(backend, task["toy"]),
                                       stdout=err, stderr=subprocess.STDOUT, cwd=REPO)
            try:
                code = process.wait(timeout=max(1.0, deadline + GRACE_S - time.time()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                code = "killed at the group's deadline"
            err.seek(0)
            output = err.read()
        log.write(output[-200_000:])
        log.write(f"\n----- {label} worker {attempt} ended ({code}) after "
                  f"{time.time() - started:.0f} s -----\n")
        log.flush()
        current = None
        lines = []
        if os.path.exists(events):
            with open(events) as f:
                lines = [json.loads(line) for line in f if line.strip()]
        for event in lines:
            events_seen.append(event)
            kind = event["event"]
            if kind == "start":
                current = event["id"]
            elif kind == "record":
                outcomes[event["id"]] = {"status": "ok", **event}
                current = None
            elif kind == "skipped":
                outcomes[event["id"]] = {"status": "skipped", "reason": event["reason"]}
            elif kind == "failed":
                outcomes[event["id"]] = {"status": "failed", "reason": event["error"],
                                         "traceback": event["traceback"]}
                current = None
        if current is not None:  # the process died (or was killed) inside this record
            outcomes[current] = {"status": "failed", "reason": f"worker ended ({code}) during "
                                 f"this record: {output.strip()[-1500:]}"}
        elif code != 0 and not lines:  # it never started a record
            for r in remaining:
                outcomes[r["id"]] = {"status": "failed",
                                     "reason": f"worker ended ({code}) before its first record: "
                                               f"{output.strip()[-1500:]}"}
    return outcomes, events_seen


def _finite(value):
    return isinstance(value, (int, float)) and math.isfinite(value)


def assemble(records, outcomes, peak, matmul_tflops):
    """One result per record, in plan order, with the peak fractions and ours/plain."""
    results = []
    for r in records:
        result = {**r, **outcomes.get(r["id"], {"status": "skipped", "reason": "not run"})}
        result.pop("event", None)
        if r["kind"] == "train":
            achieved = result.get("achieved_tflops")
            ok = result["status"] == "ok" and _finite(achieved)
            result["bf16_peak_tflops"] = peak
            result["peak_fraction"] = achieved / peak if ok and peak else None
            result["measured_matmul_fraction"] = (
                achieved / matmul_tflops if ok and matmul_tflops else None)
            result["speedup_over_titan_x"] = (
                POST["titan_x_1_seconds_per_epoch"] / result["seconds_per_50k_epoch"]
                if ok else None)
        results.append(result)
    by_id = {r["id"]: r for r in results}
    for result in results:
        result["ratio_ours_over_plain"] = None
        plain = by_id.get(result.get("pair") or "")
        if plain and result["status"] == "ok" and plain["status"] == "ok":
            result["ratio_ours_over_plain"] = (result["images_per_second"]
                                               / plain["images_per_second"])
    return results


def projections(results):
    """`bench --project`'s cost model from the fastest ours step and from the post's batch."""
    # The groups are done; nothing in this process may take the GPU all the same.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from keras_multigpu.bench import harness

    ours = [r for r in results if r.get("engine") == "ours" and r["status"] == "ok"]
    if not ours:
        return None
    chosen = {"fastest": max(ours, key=lambda r: r["images_per_second"])}
    post = [r for r in ours if r["factor"].startswith("base")]
    if post:
        chosen["post_batch"] = post[0]
    out = {}
    for name, r in chosen.items():
        projection = harness.project_step(
            r["ms_per_step"], r["trainable_parameters"],
            f"measured {r['id']} ({r['ms_per_step']:.2f} ms per step of {r['batch']} images)")
        out[name] = {"record": r["id"], "step_ms": r["ms_per_step"], "batch_per_device": r["batch"],
                     "parameters": r["trainable_parameters"],
                     "command": (f"keras-multigpu bench --project --step-ms {r['ms_per_step']:.4f} "
                                 f"--params {r['trainable_parameters']}"),
                     "projection": projection, "text": harness.format_projection(projection)}
    return out


# -- reporting --------------------------------------------------------------


def _fmt(value, form):
    return "-" if value is None else format(value, form)


def summary_text(machine, results, projection):
    lines = [f"GPU plan ({machine['mode']}) on {machine['gpu_name'] or machine['cpu']}, "
             f"{machine['date']}; s/epoch is per 50,000 images, extrapolated from timed steps",
             f"{'record':44}{'s/epoch':>9}{'img/s':>10}{'ms/step':>9}{'TFLOP/s':>9}"
             f"{'%peak':>7}{'ours/plain':>11}{'warm s':>8}  status"]
    for r in results:
        if r["kind"] == "matmul":
            tflops = r.get("tflops")
            lines.append(f"{r['id']:44}{'':>9}{'':>10}{'':>9}{_fmt(tflops, '.1f'):>9}"
                         f"{'':>7}{'':>11}{'':>8}  {r['status']} {r.get('size', '')}")
            continue
        fraction = r["peak_fraction"]
        lines.append(
            f"{r['id']:44}{_fmt(r.get('seconds_per_50k_epoch'), '.3f'):>9}"
            f"{_fmt(r.get('images_per_second'), '.0f'):>10}{_fmt(r.get('ms_per_step'), '.2f'):>9}"
            f"{_fmt(r.get('achieved_tflops'), '.2f'):>9}"
            f"{_fmt(None if fraction is None else 100 * fraction, '.1f'):>7}"
            f"{_fmt(r['ratio_ours_over_plain'], '.3f'):>11}"
            f"{_fmt(r.get('warmup_epoch_seconds'), '.1f'):>8}  {r['status']}"
            + ("" if r["status"] == "ok" else f": {str(r.get('reason', ''))[:120]}"))
    if projection:
        lines.append("")
        for name, p in projection.items():  # the short form; the full tables in summary.txt
            rows = [r for r in p["projection"]["rows"] if r["devices"] in (2, 4, 8)]
            lines.append(f"Projected efficiency ({name}: {p['step_ms']:.2f} ms per step of "
                         f"{p['batch_per_device']}; modelled): " + "; ".join(
                             f"{r['link'].split(' (')[0]} x{r['devices']} "
                             f"{100 * r['efficiency']:.0f}/{100 * r['efficiency_overlap']:.0f} %"
                             for r in rows) + " (without/with overlap)")
    return "\n".join(lines)


def projection_text(projection):
    return "\n".join(f"\nProjection ({name}): {p['command']}\n{p['text']}"
                     for name, p in (projection or {}).items())


def draw(machine, results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results if r["kind"] == "train" and r["status"] == "ok"]
    figure, (epoch_ax, flops_ax) = plt.subplots(
        1, 2, figsize=(15, 1.2 + 0.38 * max(len(rows), 1)), sharey=True)
    labels = [r["id"] for r in rows]
    colours = ["tab:blue" if r["engine"] == "ours" else "tab:gray" for r in rows]
    hatches = ["" if r["backend"] == "jax" else "//" for r in rows]
    y = np.arange(len(rows))
    bars = epoch_ax.barh(y, [r["seconds_per_50k_epoch"] for r in rows], color=colours)
    for bar, hatch in zip(bars, hatches):
        bar.set_hatch(hatch)
    epoch_ax.set_xscale("log")
    epoch_ax.axvline(POST["titan_x_1_seconds_per_epoch"], color="tab:red", linestyle="--",
                     label="the post: 1 Titan X, 63 s")
    epoch_ax.axvline(POST["titan_x_4_seconds_per_epoch"], color="tab:orange", linestyle="--",
                     label="the post: 4 Titan X, 16 s")
    epoch_ax.axvline(TARGETS["seconds_per_50k_epoch"], color="tab:green", linestyle=":",
                     label="target: 1 s")
    peak = machine["bf16_peak_tflops"]
    if peak and rows:
        limit = CIFAR_IMAGES * rows[0]["train_gflop_per_image"] * 1e9 / (peak * 1e12)
        epoch_ax.axvline(limit, color="k", linestyle=":", label=f"bf16 limit: {limit:.3f} s")
    epoch_ax.set_yticks(y, labels, fontsize=8)
    epoch_ax.invert_yaxis()
    epoch_ax.set_xlabel("seconds per 50,000-image epoch (log; extrapolated from timed steps)")
    epoch_ax.legend(fontsize=8, loc="lower right")
    epoch_ax.grid(alpha=0.3, axis="x")
    flops_ax.barh(y, [r["achieved_tflops"] for r in rows], color=colours)
    if peak:
        flops_ax.axvline(TARGETS["peak_fraction"] * peak, color="tab:green", linestyle=":",
                         label=f"target: 15 % of the bf16 peak ({peak:.0f})")
        flops_ax.legend(fontsize=8, loc="lower right")
    for i, r in enumerate(rows):
        note = f"{r['images_per_second']:.0f} img/s"
        if r["ratio_ours_over_plain"] is not None:
            note += f", ours/plain {r['ratio_ours_over_plain']:.2f}"
        flops_ax.text(r["achieved_tflops"], i, " " + note, va="center", fontsize=7)
    flops_ax.set_xlabel("achieved TFLOP/s (3 x forward Conv2D/Dense FLOPs per image)")
    flops_ax.grid(alpha=0.3, axis="x")
    figure.suptitle(f"MiniGoogLeNet training on {machine['gpu_name'] or machine['cpu']} "
                    f"({machine['mode']}; blue: ours, gray: plain Keras; hatched: torch)")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def write_json(path, value):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=2, default=str)
        f.write("\n")
    os.replace(tmp, path)


# -- data -------------------------------------------------------------------


def find_data(given):
    """The CIFAR-10 folder to use: --data-dir, $KERAS_MULTIGPU_DATA, the carried copy
    (.whl/data, see wheels.sh), the shared subset beside the checkout; else None."""
    for candidate in (given, os.environ.get("KERAS_MULTIGPU_DATA"),
                      os.path.join(REPO, ".whl", "data"),
                      os.path.join(REPO, "..", "shared", "data")):
        if not candidate:
            continue
        for folder in (candidate, os.path.join(candidate, "cifar-10-batches-py")):
            if os.path.exists(os.path.join(folder, "data_batch_1")):
                return os.path.abspath(folder)
    return None


def write_cifar_batch(path, images, labels):
    """A batch file in CIFAR-10's python format (channels-first rows of 3,072 bytes)."""
    rows = np.ascontiguousarray(images.transpose(0, 3, 1, 2).reshape(len(images), -1))
    with open(path, "wb") as f:
        pickle.dump({b"batch_label": b"tiled", b"labels": [int(v) for v in labels],
                     b"data": rows.astype(np.uint8),
                     b"filenames": [b"%d.png" % i for i in range(len(labels))]}, f, protocol=2)


def read_cifar_batch(path):
    """(images, labels) of a batch file in CIFAR-10's python format (the copy at hand,
    already checked by the project's loader in the runs that read it)."""
    with open(path, "rb") as f:
        batch = pickle.load(f, encoding="bytes")  # our own data files: trusted
    rows = np.asarray(batch[b"data"], dtype=np.uint8)
    return rows.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), np.asarray(batch[b"labels"])


def tiled_cifar(source, images, folder):
    """`source`'s training images tiled to `images` in five batch files; its test batch."""
    x, y = zip(*(read_cifar_batch(os.path.join(source, f"data_batch_{i}"))
                 for i in range(1, 6)))
    x, y = np.concatenate(x), np.concatenate(y)
    repeats = math.ceil(images / len(x))
    x, y = np.tile(x, (repeats, 1, 1, 1))[:images], np.tile(y, repeats)[:images]
    os.makedirs(folder, exist_ok=True)
    for i, (xs, ys) in enumerate(zip(np.array_split(x, 5), np.array_split(y, 5)), start=1):
        write_cifar_batch(os.path.join(folder, f"data_batch_{i}"), xs, ys)
    shutil.copy(os.path.join(source, "test_batch"), folder)
    return folder


# -- the two modes ----------------------------------------------------------


def run_plan(args, out, toy, machine):
    sizes = TOY_SIZES if toy else GPU_SIZES
    budget = args.budget or sizes["budget"]
    started = time.time()
    deadline = started + budget
    backends = [b for b in args.backends.split(",") if b]
    available = [b for b in backends if importlib.util.find_spec(b) is not None]
    records = select(sized(matrix(backends, beyond=bool(args.only)), sizes, toy), args.only)
    data_dir = find_data(args.data_dir)
    work = tempfile.mkdtemp(prefix="gpu-plan-")
    task = {"toy": toy, "gpu": not toy, "data_dir": data_dir, "jax_cache":
            os.path.join(work, "jax-cache"), **{k: v for k, v in sizes.items() if k != "batch"}}
    outcomes, events = {}, []
    with open(os.path.join(out, "log.txt"), "w") as log:
        for backend in backends:
            group = [r for r in records if r["backend"] == backend]
            if backend not in available:
                outcomes.update({r["id"]: {"status": "unavailable",
                                           "reason": f"{backend} is not installed"}
                                 for r in group})
                continue
            planned = GROUP_START_S + sum(r["budget_s"] for r in group)
            later = sum(GROUP_START_S + sum(r["budget_s"] for r in records if r["backend"] == b)
                        for b in available[available.index(backend) + 1:])
            # Its own plan (three times it at toy sizes), leaving later groups theirs.
            # (On a GPU, the whole budget left beyond the later groups' plans: a record's
            # budget is soft, and a selection of a few records must not die at its plan.)
            group_deadline = (min(time.time() + planned * 3, deadline - later) if toy
                              else deadline - later)
            print(f"[plan] {backend}: {len(group)} record(s), "
                  f"{group_deadline - time.time():.0f} s", flush=True)
            shards = [group]
            if toy and backend == "jax" and os.getloadavg()[0] < (os.cpu_count() or 1) - 1:
                # Toy only, on an idle machine: ours and plain in two processes at once
                # (XLA:CPU compiles on one core); on a GPU every record runs alone.
                shards = [[r for r in group if r["engine"] == "ours"],
                          [r for r in group if r["engine"] != "ours"]]
            buffers = [io.StringIO() for _ in shards]
            with concurrent.futures.ThreadPoolExecutor(len(shards)) as pool:
                futures = [pool.submit(run_group, f"{backend}{i}", backend, shard, task,
                                       group_deadline, work, buffer)
                           for i, (shard, buffer) in enumerate(zip(shards, buffers))]
                for future in futures:
                    found, seen = future.result()
                    outcomes.update(found)
                    events += seen
            for buffer in buffers:
                log.write(buffer.getvalue())
            for r in group:
                o = outcomes.get(r["id"], {})
                print(f"[plan]   {r['id']}: {o.get('status')} "
                      + (f"{o['images_per_second']:.0f} img/s" if o.get("status") == "ok"
                         and "images_per_second" in o else str(o.get("reason", ""))[:200]),
                      flush=True)
    shutil.rmtree(work, ignore_errors=True)
    matmul = outcomes.get("jax/matmul/bf16", {})
    matmul_tflops = matmul.get("tflops") if matmul.get("status") == "ok" else None
    machine["measured_bf16_matmul_tflops"] = matmul_tflops
    machine["frameworks_saw"] = [e for e in events if e["event"] == "device"]
    results = assemble(records, outcomes, machine["bf16_peak_tflops"], matmul_tflops)
    projection = projections(results)
    data = next((e["source"] for e in events if e["event"] == "data"), None)
    document = {
        "machine": machine, "mode": machine["mode"], "sizes": sizes, "budget_s": budget,
        "seconds": time.time() - started, "data": data, "post": POST, "targets": TARGETS,
        "method": (
            "Each record: Keras fit (plain, or through multi_gpu_model(model, gpus=1)) on the "
            "reference experiment's model; one warm-up epoch (compilation, placement) then "
            f"{sizes['timed_epochs']} timed epoch(s) of 'timed_steps_per_epoch' steps; the "
            "median epoch gives ms_per_step; seconds_per_50k_epoch = 50,000 / images_per_second "
            "(extrapolated). achieved_tflops = images/s x 3 x forward FLOPs of the model's "
            "Conv2D and Dense layers; peak_fraction against the datasheet's dense bf16 peak "
            "for this GPU (null on a CPU); measured_matmul_fraction against the bf16 matrix "
            "product timed here. ratio_ours_over_plain: images/s of ours over its paired plain "
            "Keras record, same run."),
        "toy_xla_flags": TOY_XLA_FLAGS if toy else None,
        "records": results, "projection": projection,
    }
    write_json(os.path.join(out, "machine.json"), machine)
    write_json(os.path.join(out, "results.json"), document)
    if projection:
        write_json(os.path.join(out, "projection.json"), projection)
    draw(machine, results, os.path.join(out, "plan.png"))
    text = summary_text(machine, results, projection)
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write(text + "\n" + projection_text(projection) + "\n")
    print(text, flush=True)  # last, so that a device call's output tail holds the table
    failed = [r["id"] for r in results if r["status"] == "failed"]
    skipped = [r["id"] for r in results if r["status"] == "skipped"]
    print(f"\n[plan] {len(results) - len(failed) - len(skipped)} ok, {len(failed)} failed, "
          f"{len(skipped)} skipped in {time.time() - started:.0f} s; wrote {out}", flush=True)
    return 1 if failed or (toy and skipped) else 0


def run_reference(args, out, toy, machine):
    """`keras-multigpu train` at the post's settings, within the budget."""
    budget = args.budget or (120 if toy else 500)
    epochs = args.epochs or (1 if toy else 70)
    data_dir = find_data(args.data_dir)
    work = tempfile.mkdtemp(prefix="gpu-reference-")
    if data_dir is None:
        if not toy:
            print("[reference] no CIFAR-10 found: pass --data-dir, set KERAS_MULTIGPU_DATA, or "
                  "run benchmarks/gpu/wheels.sh (it carries the shared subset in .whl/data)",
                  file=sys.stderr)
            return 2
        rng = np.random.default_rng(0)  # toy without data: a small synthetic CIFAR folder
        data_dir = os.path.join(work, "synthetic")
        os.makedirs(data_dir)
        for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
            write_cifar_batch(os.path.join(data_dir, name),
                              rng.integers(0, 256, (64, 32, 32, 3), dtype=np.uint8),
                              rng.integers(0, 10, 64))
    if args.tile:
        data_dir = tiled_cifar(data_dir, args.tile, os.path.join(work, "tiled"))
    output = os.path.join(work, "train")
    command = [sys.executable, "-m", "keras_multigpu.cli", "train", "--gpus", "1",
               "--epochs", str(epochs), "--output", output, "--data-dir", data_dir,
               "--progress", "epoch"]
    if toy:
        command += ["--width", "0.0625", "--limit", "256"]
    env = group_environment("jax", toy)
    started = time.time()
    with open(os.path.join(out, "log.txt"), "w") as log:
        log.write(" ".join(command) + "\n")
        log.flush()
        try:
            code = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  cwd=REPO, timeout=budget).returncode
        except subprocess.TimeoutExpired:
            code = f"stopped at the budget ({budget} s)"
    seconds = time.time() - started
    history_path = os.path.join(output, "history.json")
    if not os.path.exists(history_path):
        print(f"[reference] train wrote no history ({code}); see log.txt", file=sys.stderr)
        write_json(os.path.join(out, "machine.json"), machine)
        return 1
    with open(history_path) as f:
        history = json.load(f)
    shutil.copy(history_path, os.path.join(out, "reference-history.json"))
    for name, kept in (("plot.png", "reference-curves.png"),
                       (os.path.join("monitor", "monitor.png"), "reference-monitor.png")):
        if os.path.exists(os.path.join(output, name)):  # DeviceMonitor's, where train has it
            shutil.copy(os.path.join(output, name), os.path.join(out, kept))
    done = len(history["epochs"])
    images = history["train_images"]
    epoch_50k = history["mean_epoch_seconds"] * CIFAR_IMAGES / images
    reference = {
        "command": " ".join(command[1:]), "exit": code, "wall_seconds": seconds,
        "epochs_planned": epochs, "epochs_done": done, "complete": history["complete"],
        "note": None if history["complete"] else (
            f"stopped after {done} of {epochs} epochs ({code}): the figures cover those"),
        "data_dir": data_dir, "tiled_to": args.tile, "train_images": images,
        "test_images": history["test_images"], "global_batch": history["global_batch"],
        "total_seconds": history["total_seconds"],
        "first_epoch_seconds": history["first_epoch_seconds"],
        "mean_epoch_seconds": history["mean_epoch_seconds"],
        "images_per_second": history["images_per_second"],
        "seconds_per_50k_epoch": epoch_50k,
        "projected_70x50k_minutes": (history["first_epoch_seconds"]
                                     + 69 * epoch_50k) / 60,
        "final_val_accuracy": history["final_val_accuracy"],
        "post": POST, "machine": machine["gpu_name"] or machine["cpu"],
    }
    write_json(os.path.join(out, "machine.json"), machine)
    write_json(os.path.join(out, "reference.json"), reference)
    draw_reference(machine, reference, os.path.join(out, "reference.png"))
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({k: v for k, v in reference.items() if k != "post"}, indent=2, default=str))
    return 0 if history["complete"] else 3


def draw_reference(machine, ref, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [(f"measured: {ref['epochs_done']} epoch(s) x {ref['train_images']:,} images",
             ref["total_seconds"] / 60, "tab:blue"),
            ("projected: 70 epochs x 50,000 images", ref["projected_70x50k_minutes"],
             "tab:cyan"),
            ("the post: 1 Titan X", POST["titan_x_1_total_minutes"], "tab:red"),
            ("the post: 4 Titan X", POST["titan_x_4_total_minutes"], "tab:orange")]
    figure, ax = plt.subplots(figsize=(9, 3.2))
    ax.barh(range(len(bars)), [b[1] for b in bars], color=[b[2] for b in bars])
    for i, (_, minutes, _) in enumerate(bars):
        ax.text(minutes, i, f" {minutes:.2f} min", va="center", fontsize=8)
    ax.set_yticks(range(len(bars)), [b[0] for b in bars], fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("minutes (log)")
    accuracy = ref["final_val_accuracy"]
    ax.set_title(f"MiniGoogLeNet, CIFAR-10 reference on {machine['gpu_name'] or machine['cpu']}"
                 f": val accuracy {'-' if accuracy is None else f'{accuracy:.4f}'} on "
                 f"{ref['test_images']:,} test images", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=None,
                        help="output folder (default: $OUT, else runs/gpu-plan)")
    parser.add_argument("--toy", action="store_true",
                        help="CPU toy sizes (also GPU_PLAN_TOY=1; automatic without a GPU)")
    parser.add_argument("--reference", action="store_true",
                        help="run the reference experiment (keras-multigpu train) instead")
    parser.add_argument("--backends", default="jax,torch", help="plan mode: comma-separated")
    parser.add_argument("--only", default=None,
                        help="plan mode: run only the records whose id contains one of these "
                             "comma-separated strings (e.g. fp32,matmul)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for everything (500 on a GPU)")
    parser.add_argument("--epochs", type=int, default=None,
                        help="reference: epochs (70 on a GPU, 1 in toy mode)")
    parser.add_argument("--tile", type=int, default=None,
                        help="reference: tile the training images to this many (e.g. 50000)")
    parser.add_argument("--data-dir", default=None, help="CIFAR-10 folder (default: searched)")
    args = parser.parse_args(argv)
    out = args.out or os.environ.get("OUT") or os.path.join(REPO, "runs", "gpu-plan")
    os.makedirs(out, exist_ok=True)
    gpu = nvml_gpus()
    toy = args.toy or os.environ.get("GPU_PLAN_TOY") == "1" or not gpu["gpus"]
    if not args.toy and not gpu["gpus"]:
        print(f"[plan] no GPU found ({gpu.get('reason')}): toy sizes", flush=True)
    machine = machine_info("toy" if toy else "gpu", gpu)
    print(f"[plan] {machine['mode']} on {machine['gpu_name'] or machine['cpu']}, python "
          f"{machine['python']}, {machine['versions']}", flush=True)
    if args.reference:
        return run_reference(args, out, toy, machine)
    return run_plan(args, out, toy, machine)


if __name__ == "__main__":
    sys.exit(main())
