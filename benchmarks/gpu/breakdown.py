"""Where a GPU step's time goes, and ours against plain Keras where neither fills the GPU.

    python benchmarks/gpu/breakdown.py OUT_DIR [--toy] [--batch 4096] [--spe 8]
                                     [--rounds 6] [--budget 400]

One JAX process (issue 26, item 3), two parts:

1. `trace`: the fast end's record (`jax/ours/bf16/b{batch}/spe{spe}/resident/aug`, the
   plan's model and data): `fit` for a warm-up epoch (compilation), a timed epoch, then
   one more epoch under `jax.profiler.trace`. The trace's device events (CUPTI's kernels)
   are summed per kind: the convolutions and matrix products (cuDNN, cuBLAS), the
   reductions (BatchNormalization's statistics and their gradients), the other fusions
   (elementwise work), copies. From them: the share of the step each kind takes, the
   rate the convolutions reach on their own, and the share of the bf16 peak the step
   would reach if everything but the convolutions took no time. This is the measurement
   that says whether 15 % of the peak is the library's to reach.
2. `pair`: ours and plain Keras at the post's configuration (float32, batch 64, one step
   per call), interleaved in rounds in this one process (ours, plain, ours, plain, ...),
   each round a `fit` of a warm-up epoch and timed ones, so that drift between calls and
   machines falls on both alike. Reports each round's ratio and the median.

Writes OUT_DIR/breakdown.json, OUT_DIR/breakdown.txt (the table, also printed last) and the
trace's top kernels. Without a GPU (or with --toy) the same runs at toy sizes on the CPU,
where the device events are XLA:CPU's thunks.
"""

import argparse
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import plan  # noqa: E402  (sizes, peaks, data lookup, machine description)
import worker  # noqa: E402  (the plan's model, data and timing)

# Kernel kinds: the HLO op's name first (XLA's `cudnn-conv...`, `convolution`, `dot`,
# `reduce-window`), then the kernel's (cuDNN's and cuBLAS's); first match wins.
KINDS = (
    ("convolution", re.compile(r"cudnn-conv|convolution|conv(?!ert)|implicit_gemm|fprop|dgrad"
                               r"|wgrad", re.I)),
    ("matmul", re.compile(r"gemm|cublas|cutlass|\bdot|matmul", re.I)),
    ("pooling", re.compile(r"reduce[-_]window|select[-_]and[-_]scatter|pool", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy|transpose", re.I)),
    ("reduction", re.compile(r"reduc", re.I)),
)


def kind_of(event):
    args = event.get("args") or {}
    for text in (args.get("hlo_op", ""), f"{event.get('name', '')} {args.get('long_name', '')}"):
        for kind, pattern in KINDS:
            if pattern.search(text):
                return kind
    return "elementwise"


def device_events(trace_dir):
    """The trace's device-side events: those of a `/device:` process (CUPTI's kernels and
    copies on a GPU); on a CPU, the XLA thunks (events that name an HLO op)."""
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"),
                             recursive=True))
    if not files:
        raise RuntimeError(f"no perfetto_trace.json.gz under {trace_dir}")
    with gzip.open(files[-1]) as f:
        events = json.load(f)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = {pid for pid, name in names.items() if name.startswith("/device:")}
    spans = [e for e in events if e.get("ph") == "X" and e.get("dur") is not None]
    found = [e for e in spans if e["pid"] in device]
    if found:
        return found, sorted(names[p] for p in device)
    return [e for e in spans if "hlo_op" in (e.get("args") or {})], ["host (XLA:CPU thunks)"]


def breakdown(events, steps, train_flops_per_step, peak_tflops):
    """Per-step milliseconds of each kernel kind, the busy span, and what they imply."""
    per_kind, per_kernel = {}, {}
    for e in events:
        kind = kind_of(e)
        per_kind[kind] = per_kind.get(kind, 0.0) + e["dur"]
        args = e.get("args") or {}
        key = (kind, args.get("hlo_op", ""), e["name"][:120])
        entry = per_kernel.setdefault(key, [0.0, 0])
        entry[0] += e["dur"]
        entry[1] += 1
    busy_us = sum(per_kind.values())
    first = min(e["ts"] for e in events)
    last = max(e["ts"] + e["dur"] for e in events)
    ms = {k: v / 1000 / steps for k, v in sorted(per_kind.items(), key=lambda kv: -kv[1])}
    conv_ms = ms.get("convolution", 0.0) + ms.get("matmul", 0.0)
    out = {
        "steps": steps, "kernels": len(events),
        "device_busy_ms_per_step": busy_us / 1000 / steps,
        "device_span_ms_per_step": (last - first) / 1000 / steps,
        "ms_per_step_by_kind": ms,
        "share_by_kind": {k: v * 1000 * steps / busy_us for k, v in ms.items()},
        "top_kernels": [
            {"kind": k[0], "hlo_op": k[1], "name": k[2], "ms_per_step": v[0] / 1000 / steps,
             "calls_per_step": v[1] / steps}
            for k, v in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:40]],
    }
    if conv_ms > 0:
        rate = train_flops_per_step / (conv_ms / 1000) / 1e12
        out["convolution_tflops"] = rate
        if peak_tflops:
            out["convolution_peak_fraction"] = rate / peak_tflops
            busy = out["device_busy_ms_per_step"] / 1000
            out["busy_peak_fraction"] = train_flops_per_step / busy / 1e12 / peak_tflops
    return out


class Trace:
    """A callback that traces one epoch (`epoch`), after the epoch's timing has waited."""

    def __new__(cls, folder, epoch):
        import jax
        import keras

        class _Trace(keras.callbacks.Callback):
            def on_epoch_begin(self, e, logs=None):
                if e == epoch:
                    jax.profiler.start_trace(folder, create_perfetto_trace=True)

            def on_epoch_end(self, e, logs=None):
                if e == epoch:
                    keras.ops.convert_to_numpy(self.model.optimizer.iterations)
                    jax.profiler.stop_trace()

        return _Trace()


def run_trace(group, record, task, folder, peak):
    from keras_multigpu import parallel as parallel_module
    from keras_multigpu.callbacks import EpochStats

    entry = group.model(record)
    parallel_module.RESIDENT_LIMIT_BYTES = float("inf")
    parallel_module.RESIDENT_FRACTION = float("inf")
    batch, steps = record["batch"], record["steps"]
    x, y = group.x[: batch * steps], group.y[: batch * steps]
    start = time.perf_counter()
    history = entry["model"].fit(x, y, batch_size=batch, epochs=3, shuffle=True, verbose=0,
                                 callbacks=[EpochStats(len(x)), Trace(folder, 2)])
    seconds = history.history["seconds"]
    step_ms = 1000 * seconds[1] / steps
    train_flops = 3 * entry["flops"] * batch
    events, sources = device_events(folder)
    result = breakdown(events, steps, train_flops, peak)
    images = batch / (step_ms / 1000)
    result.update({
        "id": record["id"], "batch": batch, "steps_per_execution": record["steps_per_execution"],
        "epoch_seconds": seconds, "fit_wall_seconds": time.perf_counter() - start,
        "ms_per_step_untraced": step_ms, "ms_per_step_traced": 1000 * seconds[2] / steps,
        "images_per_second": images, "seconds_per_50k_epoch": worker.CIFAR_IMAGES / images,
        "train_tflop_per_step": train_flops / 1e12,
        "peak_fraction": train_flops / (step_ms / 1000) / 1e12 / peak if peak else None,
        "trace_sources": sources})
    return result


def run_pair(group, ours, plain, rounds, deadline):
    out = {"ours": ours["id"], "plain": plain["id"], "rounds": []}
    for r in range(rounds):
        if r >= 2 and time.time() > deadline:
            break
        row = {}
        for record in (ours, plain) if r % 2 == 0 else (plain, ours):
            row[record["engine"]] = group.measure(record, deadline + 3600)["images_per_second"]
        row["ratio"] = row["ours"] / row["plain"]
        out["rounds"].append(row)
        print(f"[breakdown] pair round {r + 1}: ours {row['ours']:.0f} img/s, "
              f"plain {row['plain']:.0f}, ratio {row['ratio']:.3f}", flush=True)
    ratios = [row["ratio"] for row in out["rounds"]]
    out["median_ratio"] = statistics.median(ratios) if ratios else None
    out["median_ours"] = statistics.median(row["ours"] for row in out["rounds"])
    out["median_plain"] = statistics.median(row["plain"] for row in out["rounds"])
    return out


def text(result):
    lines = []
    t = result.get("trace")
    if t:
        share = t["peak_fraction"]
        lines.append(f"trace {t['id']}: {t['ms_per_step_untraced']:.2f} ms a step untraced "
                     f"({t['ms_per_step_traced']:.2f} traced), "
                     f"{t['device_busy_ms_per_step']:.2f} ms of kernels, "
                     f"{t['seconds_per_50k_epoch']:.3f} s per 50k epoch, peak fraction "
                     f"{'n/a' if share is None else f'{100 * share:.2f} %'}")
        for kind, ms in t["ms_per_step_by_kind"].items():
            lines.append(f"  {kind:<12} {ms:8.3f} ms/step  {100 * t['share_by_kind'][kind]:5.1f} %")
        if "convolution_tflops" in t:
            lines.append(f"  convolutions alone: {t['convolution_tflops']:.1f} TFLOP/s"
                         + (f", {100 * t['convolution_peak_fraction']:.1f} % of the peak; "
                            f"all kernels back to back: {100 * t['busy_peak_fraction']:.1f} %"
                            if "convolution_peak_fraction" in t else ""))
        for k in t["top_kernels"][:12]:
            lines.append(f"    {k['ms_per_step']:7.3f} ms x{k['calls_per_step']:.0f} "
                         f"{k['kind']:<11} {k['hlo_op'][:30]:<30} {k['name'][:60]}")
    if result.get("trace_error"):
        lines.append(f"trace failed: {result['trace_error']}")
    p = result.get("pair")
    if p:
        lines.append(f"pair {p['ours']} / {p['plain']}: median ratio {p['median_ratio']:.3f} "
                     f"over {len(p['rounds'])} rounds ("
                     + ", ".join(f"{r['ratio']:.3f}" for r in p["rounds"]) + "); "
                     f"ours {p['median_ours']:.0f} img/s, plain {p['median_plain']:.0f}")
    if result.get("pair_error"):
        lines.append(f"pair failed: {result['pair_error']}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--toy", action="store_true")
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--spe", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--budget", type=float, default=400)
    args = parser.parse_args(argv)
    started = time.time()
    os.makedirs(args.out, exist_ok=True)
    os.environ["KERAS_BACKEND"] = "jax"
    gpu = plan.nvml_gpus()
    toy = args.toy or os.environ.get("GPU_PLAN_TOY") == "1" or not gpu["gpus"]
    if toy:
        os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"),
                                                         plan.TOY_XLA_FLAGS]))
    sizes = plan.TOY_SIZES if toy else plan.GPU_SIZES
    machine = plan.machine_info("toy" if toy else "gpu", gpu)
    peak = machine.get("bf16_peak_tflops")
    task = {"toy": toy, "gpu": not toy, "data_dir": plan.find_data(None),
            **{k: v for k, v in sizes.items() if k != "batch"}}
    task["timed_epochs"] = 2
    import keras  # noqa: F401  (the backend starts here)

    result = {"machine": machine, "device": worker.check_accelerator(task), "toy": toy,
              "command": "python benchmarks/gpu/breakdown.py " + " ".join(sys.argv[1:])}
    x, y, source = worker.load_data(task)
    result["data"] = source
    group = worker.Group(task, x, y)
    fast = plan.record("jax", "ours", "the fast end, traced", "mixed_bfloat16",
                       args.batch, args.spe)
    ours = plan.record("jax", "ours", "base: the post's configuration")
    plain = plan.record("jax", "plain", "plain Keras at the base")
    fast, ours, plain = plan.sized([fast, ours, plain], sizes, toy)
    try:
        with tempfile.TemporaryDirectory() as folder:
            result["trace"] = run_trace(group, fast, task, folder, peak)
    except Exception as error:  # the pair still runs; the error is the finding
        result["trace_error"] = f"{type(error).__name__}: {error}"[-1500:]
    print(f"[breakdown] trace done after {time.time() - started:.0f} s", flush=True)
    try:
        result["pair"] = run_pair(group, ours, plain, args.rounds, started + args.budget)
    except Exception as error:
        result["pair_error"] = f"{type(error).__name__}: {error}"[-1500:]
    result["seconds"] = time.time() - started
    plan.write_json(os.path.join(args.out, "breakdown.json"), result)
    summary = text(result)
    with open(os.path.join(args.out, "breakdown.txt"), "w") as f:
        f.write(summary + "\n")
    print(summary, flush=True)
    return 0 if "trace" in result and "pair" in result else 1


if __name__ == "__main__":
    sys.exit(main())
