"""Watching the devices while a model trains, and saying what held it back.

"Are my GPUs busy, or waiting for data?" `DeviceMonitor` answers it: a
thread (`nvml.Sampler`) samples each GPU's utilisation, SM activity where
NVML's GPM counters exist, and memory, while the callback times, on the
host, each step and the part of it spent producing the batch. At the end of
`fit` it writes `timeline.csv`, `steps.csv` and `monitor.png`, and prints a
verdict with its evidence (`verdict()`); with several processes, every
process's step figures reach process 0, which alone writes.

Why the data time is measured where the batch is made: Keras fetches the
next batch *inside* the step call (`train_function(iterator)`), so the gap
between one step's `on_train_batch_end` and the next `on_train_batch_begin`
is nearly zero however slow the input is. For a `ParallelModel`, the monitor
times its padded dataset's batch production instead. A plain Keras model
gives it no such handle: its data time is reported as not measured.

Why a step is timed from one `on_train_batch_begin` to the next: a callback
that overrides `on_train_batch_end` makes Keras copy every step's logs to
the host, a wait for the device per step that would take away the very
overlap of input and compute being measured. Steps run asynchronously, so
one step's time can shift into the next; the sums over an epoch, which the
verdict uses, are the wall time.
"""

import csv
import logging
import os
import threading
import time

import keras
from keras.src.utils import io_utils

from keras_multigpu import _io
from keras_multigpu import nvml as nvml_lib

logger = logging.getLogger(__name__)

HIGHLY_INPUT_BOUND = 0.20  # xprof's threshold for "highly input-bound"
MODERATELY_INPUT_BOUND = 0.05
LAG_POINTS = 25.0  # mean utilisation gap, in percentage points, between devices
BUSY_UTILISATION = 70.0


class _Timed:
    """Stands in for a padded dataset's source and its `pad`, timing each call.

    Only the outermost call counts (`pad` may itself gather), and calls from
    other threads (a PyDataset's workers) are kept apart: their time overlaps
    the steps, so it bounds the wait from above rather than measuring it.
    """

    def __init__(self, monitor, target):
        self._monitor, self._target = monitor, target

    def __call__(self, *args, **kwargs):
        return self._monitor._timed(self._target, *args, **kwargs)

    def __getitem__(self, index):
        return self._monitor._timed(self._target.__getitem__, index)

    def __len__(self):
        return len(self._target)

    def __getattr__(self, name):
        if name.startswith("__") or name in ("_monitor", "_target"):
            raise AttributeError(name)  # copy and pickle probe before __init__ ran
        return getattr(self._target, name)


# -- the verdict ---------------------------------------------------------------


def verdict(steps, timeline, measured="dataset", gpus=0):
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

    Returns:
        A dict: `input` (`"highly"`, `"moderately"`, `"no"` or `"unknown"`), `bound`
        (`"input"`, `"compute"` or `"unclear"`), `lagging_device` (an id or
        None), `communication`, `evidence` (the numbers), `lines` (what is
        printed) and `fixes`.
    """
    timed = steps[1:] if len(steps) > 1 else steps
    data_ms = sum(row[2] or 0.0 for row in timed)
    step_ms = sum(row[3] for row in timed)
    share = data_ms / step_ms if step_ms > 0 else 0.0
    mean = {}
    for device in range(gpus):
        values = [row[2] for row in timeline if row[1] == device and row[2] is not None]
        if values:
            mean[device] = sum(values) / len(values)
    sm = [row[3] for row in timeline if row[3] is not None]
    evidence = {
        "steps": len(timed),
        "data_ms_per_step": data_ms / max(len(timed), 1),
        "step_ms_per_step": step_ms / max(len(timed), 1),
        "data_share": share,
        "data_measured": measured,
        "mean_utilization": mean,
        "mean_sm_activity": sum(sm) / len(sm) if sm else None,
    }
    how = {"dataset": "batch production", "workers": "batch production on worker threads, "
           "overlapping the steps (an upper bound on the wait)",
           "none": ""}[measured]
    numbers = (f"data {evidence['data_ms_per_step']:.1f} ms of a "
               f"{evidence['step_ms_per_step']:.1f} ms step ({100 * share:.0f}%, {how})")
    lines, fixes = [], []
    input_level = ("unknown" if measured == "none" else "highly" if share >= HIGHLY_INPUT_BOUND
                   else "moderately" if share >= MODERATELY_INPUT_BOUND else "no")
    if input_level == "unknown":
        lines.append(f"data wait not measured ({evidence['step_ms_per_step']:.1f} ms per step): "
                     "a plain Keras model fetches its batch inside the step, out of a "
                     "callback's sight (wrap it with multi_gpu_model to measure it).")
    elif input_level != "no":
        lines.append(f"{input_level} input-bound: {numbers}.")
        fixes += ["produce batches faster: more PyDataset workers (workers=, "
                  "use_multiprocessing=) or tf.data prefetch/num_parallel_calls",
                  "move augmentation onto the device (keras preprocessing layers in the model)",
                  "keep array data on the device (multi_gpu_model places arrays that fit)"]
    else:
        lines.append(f"not input-bound: {numbers}.")
    busy = mean and min(mean.values()) >= BUSY_UTILISATION
    if input_level in ("no", "moderately") and (not gpus or busy):
        bound = "compute"
        where = "no GPU: the CPU does the work" if not gpus else (
            "GPU utilisation " + ", ".join(f"gpu:{d} {u:.0f}%" for d, u in mean.items()))
        lines.append(f"compute-bound ({where}).")
        fixes.append("a larger batch per device, mixed precision, or more devices")
    elif input_level == "highly":
        bound = "input"
    else:
        bound = "unclear"
        if mean and input_level != "unknown":
            lines.append("GPUs under-used with little data wait: "
                         + ", ".join(f"gpu:{d} {u:.0f}%" for d, u in mean.items())
                         + "; steps may be too small to fill them.")
            fixes.append("a larger batch per device")
    lagging = None
    if len(mean) > 1 and max(mean.values()) - min(mean.values()) > LAG_POINTS:
        lagging = min(mean, key=mean.get)
        lines.append(f"one device lags: gpu:{lagging} averages {mean[lagging]:.0f}% against "
                     f"{max(mean.values()):.0f}% on the busiest; check its PCIe link and "
                     "clocks (keras-multigpu devices) and other processes on it.")
    if evidence["mean_sm_activity"] is not None:
        lines.append(f"SM activity (GPM) averages {evidence['mean_sm_activity']:.0f}%.")
    communication = "not measurable from host timing"
    return {"input": input_level, "bound": bound, "lagging_device": lagging,
            "communication": communication, "evidence": evidence, "lines": lines,
            "fixes": fixes}


# -- the callback --------------------------------------------------------------


class DeviceMonitor(keras.callbacks.Callback):
    """Samples the GPUs and times each step; at the end of `fit`, writes and judges.

    Files in `log_dir` (written atomically, by process 0 only):
    `timeline.csv` (time, device, util, sm_activity, sm_occupancy, memory),
    `steps.csv` (step, epoch, data_ms, step_ms) and `monitor.png`. The
    verdict is printed and kept in `.verdict` (see `verdict()`): input-bound
    when producing batches takes >= 20% of the step ("highly") or >= 5%
    ("moderately"), compute-bound otherwise when the GPUs are busy or there
    is none, and "one device lags" when one GPU's mean utilisation trails the
    busiest by more than 25 points.

    Without NVML (a CPU-only machine) it logs one line and times steps only.

    Args:
        log_dir: the folder for the files; created if missing. An unwritable
            one fails at `on_train_begin`, before any step.
        interval: seconds between device samples (0.5 costs nothing measurable).
        tensorboard: a `keras.callbacks.TensorBoard` (or a log folder) to
            also receive the samples as scalars, through `tf.summary`. A
            callback cannot see its siblings in `fit`'s list, so pass it here.

    Example:

    >>> monitor = DeviceMonitor("runs/monitor")  # doctest: +SKIP
    >>> parallel.fit(x, y, epochs=3, callbacks=[monitor])  # doctest: +SKIP
    >>> monitor.verdict["input"]  # doctest: +SKIP
    'no'
    """

    def __init__(self, log_dir, interval=0.5, tensorboard=None):
        super().__init__()
        if not interval > 0:
            raise ValueError(f"interval must be a positive number of seconds. Received: "
                             f"interval={interval!r}.")
        self.log_dir = os.fspath(log_dir)
        self.interval = float(interval)
        self.tensorboard = tensorboard
        self.verdict = None
        self._lock = threading.Lock()
        self._sampler = None
        self._patched = []
        self._begin = None
        self._finished = True

    # -- set-up --------------------------------------------------------------

    def _check_writable(self):
        _io.writable_folder(self.log_dir, f"DeviceMonitor cannot write to log_dir="
                                          f"{self.log_dir!r}", "Choose a writable folder.")

    def _rank(self):
        backend = getattr(self.model, "_backend", None)
        return backend.process_index() if backend is not None else 0

    def _start_sampler(self):
        try:
            nvml = nvml_lib.open_nvml()
        except nvml_lib.NvmlUnavailable as error:
            io_utils.print_msg(f"DeviceMonitor: NVML unavailable ({error}); step timing only")
            return
        try:
            self._sampler = nvml_lib.Sampler(nvml, self.interval, self._zero)
        except Exception as error:  # noqa: BLE001 - any NVML failure: time steps only
            nvml_lib.field(nvml, "nvmlShutdown")
            io_utils.print_msg(f"DeviceMonitor: NVML unavailable ({error}); step timing only")
            return
        self._sampler.start()

    def _wrap_dataset(self):
        """Times batch production on a ParallelModel's padded dataset (see the module doc)."""
        dataset = getattr(self.model, "_fit_dataset", None)
        if dataset is None or getattr(dataset, "use_multiprocessing", False):
            return "none"  # worker processes get a pickled copy: nothing to time here
        for name in ("take", "dataset", "pad"):
            original = vars(dataset).get(name)
            if name == "pad":
                original = dataset.pad
            elif original is None or not (callable(original) or hasattr(original, "__getitem__")):
                continue
            self._patched.append((dataset, name, name in vars(dataset), vars(dataset).get(name)))
            setattr(dataset, name, _Timed(self, original))
        return "dataset"

    def _unwrap_dataset(self):
        for dataset, name, had, original in reversed(self._patched):
            if had:
                setattr(dataset, name, original)
            else:
                vars(dataset).pop(name, None)
        self._patched = []

    def _timed(self, function, *args, **kwargs):
        local = self._local
        if getattr(local, "depth", 0):
            return function(*args, **kwargs)
        local.depth = 1
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            local.depth = 0
            elapsed = time.perf_counter() - start
            with self._lock:
                if threading.get_ident() == self._train_thread:
                    self._data_s += elapsed
                else:
                    self._worker_s += elapsed

    def on_train_begin(self, logs=None):
        self._writes = self._rank() == 0
        if self._writes:
            self._check_writable()
        self._zero = time.perf_counter()
        self._train_thread = threading.get_ident()
        self._local = threading.local()
        self._steps, self._epochs = [], []
        self._data_s = self._worker_s = 0.0
        self._epoch = 0
        self._begin = None
        self._finished = False
        self._sampler = None
        self._measured = self._wrap_dataset()
        self._start_sampler()

    # -- per step --------------------------------------------------------------

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._epochs.append((time.perf_counter() - self._zero, epoch))

    def on_train_batch_begin(self, batch, logs=None):
        now = time.perf_counter()
        self._close_step(now)
        with self._lock:
            self._data_s = self._worker_s = 0.0
        self._begin = now

    def _close_step(self, now):
        """Ends the open step at `now`: the next step's start, validation, or the epoch's end."""
        if self._begin is None:
            return
        with self._lock:
            data, workers = self._data_s, self._worker_s
        if self._measured == "none":
            data = None
        elif workers and not data:
            self._measured = "workers"
            data = workers
        self._steps.append((len(self._steps), self._epoch, None if data is None else 1000 * data,
                            1000 * (now - self._begin)))
        self._begin = None

    def on_test_begin(self, logs=None):
        if self._begin is not None:
            self._close_step(time.perf_counter())  # validation is not the last step's time

    def on_epoch_end(self, epoch, logs=None):
        self._close_step(time.perf_counter())

    # -- the end -----------------------------------------------------------------

    def on_interrupt(self):
        self._finish()

    def on_train_end(self, logs=None):
        self._finish()

    def _finish(self):
        if self._finished:
            return
        self._finished = True
        self._close_step(time.perf_counter())
        self._unwrap_dataset()
        timeline, gpus = [], 0
        if self._sampler is not None:
            self._sampler.stop()
            timeline, gpus = list(self._sampler.rows), len(self._sampler.handles)
            if self._sampler.error is not None:
                logger.warning("DeviceMonitor: sampling stopped early: %s", self._sampler.error)
        self.timeline, self.steps = timeline, list(self._steps)
        self.verdict = verdict(self.steps, timeline, self._measured, gpus)
        if not self._writes:
            return
        io_utils.print_msg("DeviceMonitor: " + " ".join(self.verdict["lines"]))
        if self.verdict["fixes"]:
            io_utils.print_msg("DeviceMonitor: to try: " + "; ".join(self.verdict["fixes"]))
        # Training is over by now: a full disk here costs the files, not the run's result.
        try:
            self._write_csv("timeline.csv", ("time", "device", "util", "sm_activity",
                                             "sm_occupancy", "memory"), timeline)
            self._write_csv("steps.csv", ("step", "epoch", "data_ms", "step_ms"), self.steps)
            self._plot(timeline, gpus)
            self._write_tensorboard(timeline)
        except OSError as error:
            io_utils.print_msg(f"DeviceMonitor: could not write its files: {error}")

    def _write_csv(self, name, header, rows):
        path = os.path.join(self.log_dir, name)
        with _io.atomic_path(path, ".csv") as tmp, open(tmp, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(header)
            writer.writerows(["" if v is None else v for v in row] for row in rows)

    def _plot(self, timeline, gpus):
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        # A Figure of its own, not pyplot: drawing must not change the user's backend.
        figure = Figure(figsize=(9, 4))
        FigureCanvasAgg(figure)
        ax = figure.add_subplot()
        if gpus and timeline:
            for device in range(gpus):
                rows = [r for r in timeline if r[1] == device and r[2] is not None]
                ax.plot([r[0] for r in rows], [r[2] for r in rows], label=f"gpu:{device}")
            for seconds, epoch in self._epochs:
                ax.axvline(seconds, color="grey", linestyle=":", linewidth=1)
                ax.annotate(f"epoch {epoch + 1}", (seconds, 100), fontsize=7, rotation=90,
                            va="top")
            ax.set(xlabel="seconds", ylabel="utilisation (%)", ylim=(0, 105),
                   title="GPU utilisation (NVML)")
        else:
            steps = [r[0] for r in self.steps]
            ax.plot(steps, [r[3] for r in self.steps], label="step (ms)")
            if self._measured != "none":
                ax.plot(steps, [r[2] for r in self.steps], label="data (ms)")
            ax.set(xlabel="step", ylabel="ms", title="Per-step time: data vs step (no GPU)")
        ax.legend(loc="lower right", fontsize=8)
        with _io.atomic_path(os.path.join(self.log_dir, "monitor.png"), ".png") as tmp:
            figure.savefig(tmp, dpi=100, bbox_inches="tight")

    def _write_tensorboard(self, timeline):
        if self.tensorboard is None:
            return
        folder = getattr(self.tensorboard, "log_dir", self.tensorboard)
        try:
            import tensorflow as tf
        except ImportError:
            logger.warning("DeviceMonitor: TensorFlow is not installed; no TensorBoard scalars.")
            return
        writer = tf.summary.create_file_writer(os.path.join(os.fspath(folder), "devices"))
        with writer.as_default():
            for seconds, device, util, sm_util, _, memory in timeline:
                step = int(1000 * seconds)  # milliseconds since training began
                for name, value in (("util", util), ("sm_activity", sm_util),
                                    ("memory_gib", None if memory is None else memory / 2**30)):
                    if value is not None:
                        tf.summary.scalar(f"gpu{device}/{name}", value, step=step)
            for step, _, data_ms, step_ms in self.steps:
                if data_ms is not None:
                    tf.summary.scalar("host/data_ms", data_ms, step=step)
                tf.summary.scalar("host/step_ms", step_ms, step=step)
        writer.close()
