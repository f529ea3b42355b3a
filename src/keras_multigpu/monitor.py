"""Watching the devices while a model trains, and saying what held it back.

"Are my GPUs busy, or waiting for data?" `DeviceMonitor` answers it: a
thread (`nvml.Sampler`) samples each GPU's utilisation, SM activity where
NVML's GPM counters exist, and memory, while the callback times, on the
host, each step and the part of it spent producing the batch. At the end of
`fit` it writes `timeline.csv`, `steps.csv` and `monitor.png`, and prints a
verdict with its evidence (`diagnosis.verdict()`); with several processes,
every process's step figures reach process 0, which alone writes.

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
import math
import os
import socket
import sys
import threading
import time

import keras

from keras_multigpu import _extras, _io, processes
from keras_multigpu import nvml as nvml_lib
from keras_multigpu._keras import io_utils
from keras_multigpu.diagnosis import communication_estimate, per_step, verdict

logger = logging.getLogger(__name__)

MAX_GATHERED_ROWS = 20_000  # device samples a process sends process 0 (thinned beyond)
RANK_FIELDS = ("rank", "host", "steps", "data_ms", "step_ms", "measured")


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


def _thin(timeline, limit):
    """At most about `limit` rows, thinned by sample time: each sample has a row per GPU,
    so every GPU keeps its rows."""
    times = sorted({row[0] for row in timeline})
    per_sample = max(1, len(timeline) // max(len(times), 1))
    every = math.ceil(len(times) / max(1, limit // per_sample)) or 1
    kept = set(times[::every])
    return [row for row in timeline if row[0] in kept]


def _sibling_board():
    """The `keras.callbacks.TensorBoard` of the `fit` under way, if it has one.

    A callback is given no handle on its siblings; Keras's `CallbackList`,
    which calls `on_train_begin` on each of them, is a few frames up the stack.
    """
    frame = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, keras.callbacks.CallbackList):
            return next((c for c in owner.callbacks
                         if isinstance(c, keras.callbacks.TensorBoard)), None)
        frame = frame.f_back
    return None


def _merge_hosts(everyone):
    """One timeline over every process's GPUs, each GPU once (processes of one machine
    often see the same GPUs: the lowest rank's samples of each are kept), renumbered."""
    timeline, links, numbers = [], [], {}
    for figures in everyone:
        local = {}
        for device, (uuid, link) in enumerate(zip(figures["uuids"], figures["links"])):
            key = uuid or (figures["host"], device)
            if key not in numbers:
                numbers[key] = local[device] = len(links)
                links.append(tuple(link) if link else None)
        timeline += [(row[0], local[row[1]], *row[2:]) for row in figures["timeline"]
                     if row[1] in local]
    return timeline, links


# -- the callback --------------------------------------------------------------


class DeviceMonitor(keras.callbacks.Callback):
    """Samples the GPUs and times each step; at the end of `fit`, writes and judges.

    Files in `log_dir` (written atomically, by process 0 only):
    `timeline.csv` (time, device, util, sm_activity, sm_occupancy, memory),
    `steps.csv` (step, epoch, data_ms, step_ms), `monitor.png`, and with
    several processes `ranks.csv` (each process's per-step means: every
    process's figures reach process 0 at the end of `fit`, and its GPUs'
    samples join the timeline). The verdict is printed and kept in
    `.verdict` (see `verdict()`): input-bound when producing batches takes
    >= 20% of the step ("highly") or >= 5% ("moderately"), on the slowest
    process; communication-bound when the gradient all-reduce, estimated from
    the gradient size and the GPUs' link (NVLink or PCIe, from NVML), takes
    >= 20% of the step; compute-bound otherwise when the GPUs are busy or
    there is none; "one device lags" when one GPU's mean utilisation trails
    the busiest by more than 25 points, "one process lags" when one process's
    batches take twice the others' (and 5% of the step more).

    Without NVML (a CPU-only machine) it logs one line and times steps only.
    Only the GPUs the model trains on are sampled. With several processes,
    give each its DeviceMonitor (the same script does): they meet at the end
    of `fit` to gather their figures.

    Args:
        log_dir: the folder for the files; created if missing. An unwritable
            one fails at `on_train_begin`, before any step.
        interval: seconds between device samples (0.5 costs nothing measurable).
        tensorboard: a `keras.callbacks.TensorBoard` (or a log folder) to
            also receive the samples as scalars (`<its log_dir>/devices`,
            through `tf.summary`). By default, the TensorBoard callback of the
            same `fit`, if there is one.

    Example:

    >>> monitor = DeviceMonitor("runs/monitor")  # doctest: +SKIP
    >>> parallel.fit(x, y, epochs=3, callbacks=[monitor])  # doctest: +SKIP
    >>> monitor.verdict["input"]  # doctest: +SKIP
    'no'
    """

    def __init__(self, log_dir, interval=0.5, tensorboard=None):
        super().__init__()
        _extras.require("matplotlib", "monitor", "DeviceMonitor")  # its figure, at fit's end
        try:
            seconds = float(interval)
        except (TypeError, ValueError):
            seconds = math.nan
        if isinstance(interval, bool) or not 0 < seconds < math.inf:
            raise ValueError(f"interval must be a positive number of seconds. Received: "
                             f"interval={interval!r}.")
        if not (tensorboard is None or isinstance(tensorboard, (str, os.PathLike))
                or isinstance(tensorboard, keras.callbacks.TensorBoard)):
            raise TypeError(f"tensorboard must be a keras.callbacks.TensorBoard or a log "
                            f"folder. Received: tensorboard={tensorboard!r}.")
        try:
            self.log_dir = os.fspath(log_dir)
        except TypeError:
            raise TypeError(f"log_dir must be a folder path. Received: log_dir={log_dir!r}.") \
                from None
        self.interval = seconds
        self.tensorboard = tensorboard
        self.verdict = None
        self._runtime()

    def _runtime(self):
        """What one `fit` uses, made anew: never copied or pickled."""
        self._lock = threading.Lock()
        self._local = threading.local()
        self._sampler = None
        self._patched = []
        self._board = None
        self._begin = None
        self._finished = True

    def __getstate__(self):  # deepcopy (KerasTuner copies callbacks per trial) and pickle
        state = dict(self.__dict__)
        for name in ("_lock", "_local", "_sampler", "_patched", "_board", "_model", "model"):
            state.pop(name, None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._runtime()

    # -- set-up --------------------------------------------------------------

    def _check_writable(self):
        _io.writable_folder(self.log_dir, f"DeviceMonitor cannot write to log_dir="
                                          f"{self.log_dir!r}", "Choose a writable folder.")

    def _rank(self):
        backend = getattr(self.model, "_backend", None)
        return backend.process_index() if backend is not None else 0

    def _model_gpus(self):
        """The visible GPUs this process trains on (None: every one it sees).

        A plain Keras model runs on the framework's first GPU; a ParallelModel on its
        devices, or, with one process per device (torch), on this process's LOCAL_RANK.
        Idle GPUs beside them would read as lagging devices.
        """
        devices = getattr(self.model, "devices", None)
        backend = getattr(self.model, "_backend", None)
        if devices is None or backend is None:
            return [0]
        gpus = [d for d in devices if d.kind == "gpu"]
        processes = backend.process_count()
        if processes > 1 and len(devices) == processes:
            return [int(os.environ.get("LOCAL_RANK", "0"))]
        if processes > 1:
            return None  # several per machine: every process samples what it sees, merged
        return [d.id for d in gpus]

    def _accelerator(self):
        devices = getattr(self.model, "devices", None)
        if not devices:
            return None
        return "gpu" if any(d.kind == "gpu" for d in devices) else "cpu"

    def _start_sampler(self):
        try:
            nvml = nvml_lib.open_nvml()
        except nvml_lib.NvmlUnavailable as error:
            io_utils.print_msg(f"DeviceMonitor: NVML unavailable ({error}); step timing only")
            return
        try:
            self._sampler = nvml_lib.Sampler(nvml, self.interval, self._zero,
                                             self._model_gpus())
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
        # The host's work only (see `feed.Feed`): the fetch of each batch from Keras's
        # adapter (a user's PyDataset, its workers' queue, a generator, a DataLoader),
        # padding, and host-built array batches (the wait for the prefetched one). Not the
        # gather of arrays kept on the devices: that is device work, and where a device
        # runs its work in order (XLA:CPU), its dispatch waits for the step before it.
        for name in ("pad", "host_parts", "next_from"):
            original = getattr(dataset, name, None)
            if original is None or not callable(original):
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
        if not self._finished:  # the last fit ended in an exception, past on_train_end
            self._abandon()
        self._writes = self._rank() == 0
        if self._writes:
            self._check_writable()
        self._zero = time.perf_counter()
        self._train_thread = threading.get_ident()
        self._steps, self._epochs = [], []
        self._data_s = self._worker_s = 0.0
        self._epoch = 0
        self._begin = None
        self._finished = False
        self._sampler = None
        self._measured = self._wrap_dataset()
        self._board = self.tensorboard if self.tensorboard is not None else _sibling_board()
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
        # The step just opened will not run; the other processes may be gone (or stopping):
        # no gather, this process's figures.
        self._begin = None
        self._finish(gather=False)

    def _abandon(self):
        """Stops what a fit that never reached its end left running."""
        self._finished = True
        self._stop_sampler()
        self._unwrap_dataset()

    def _stop_sampler(self):
        """Stops the sampling thread; returns it (with its rows), or None if none ran."""
        sampler, self._sampler = self._sampler, None
        if sampler is not None:
            sampler.stop()
        return sampler

    def on_train_end(self, logs=None):
        self._finish(gather=True)

    def _finish(self, gather):
        if self._finished:
            return
        self._finished = True
        self._close_step(time.perf_counter())
        self._unwrap_dataset()
        timeline, gpus, links, uuids = [], 0, [], []
        sampler = self._stop_sampler()
        if sampler is not None:
            timeline, gpus = list(sampler.rows), len(sampler.handles)
            links, uuids = sampler.links, sampler.uuids
            if sampler.error is not None:
                logger.warning("DeviceMonitor: sampling stopped early: %s", sampler.error)
        self.steps, ranks = list(self._steps), None
        backend = getattr(self.model, "_backend", None)
        if gather and backend is not None and backend.process_count() > 1:
            try:
                everyone = processes.all_gather_object(self._figures(timeline, links, uuids))
            except Exception as error:  # noqa: BLE001 - a peer gone at the end costs figures
                logger.warning("DeviceMonitor: could not gather the other processes' figures "
                               "(%s); this process's figures only", error)
            else:
                ranks = [{k: v for k, v in r.items() if k not in ("timeline", "links")}
                         for r in everyone]
                timeline, links = _merge_hosts(everyone)
                gpus = len(links)
        self.timeline, self.ranks = timeline, ranks
        communication = communication_estimate(self.model, links)
        if communication is not None and ranks and len({r["host"] for r in ranks}) > 1:
            communication["note"] = "the link inside a machine; the network is not modelled"
        self.verdict = verdict(self.steps, timeline, self._measured, gpus, ranks, communication,
                               self._accelerator())
        if not self._writes:
            return
        if not self.steps:
            io_utils.print_msg("DeviceMonitor: no step ran; nothing written.")
            return
        io_utils.print_msg("DeviceMonitor: " + " ".join(self.verdict["lines"]))
        if self.verdict["fixes"]:
            io_utils.print_msg("DeviceMonitor: to try: " + "; ".join(self.verdict["fixes"]))
        # Training is over by now: a full disk here costs the files, not the run's result.
        try:
            self._write_csv("timeline.csv", ("time", "device", "util", "sm_activity",
                                             "sm_occupancy", "memory"), timeline)
            self._write_csv("steps.csv", ("step", "epoch", "data_ms", "step_ms"), self.steps)
            if ranks:
                self._write_csv("ranks.csv", RANK_FIELDS, [[r[k] for k in RANK_FIELDS]
                                                           for r in ranks])
            self._plot(timeline, gpus)
            self._write_tensorboard(timeline)
        except Exception as error:  # noqa: BLE001 - training is over: only the files are lost
            io_utils.print_msg(f"DeviceMonitor: could not write its files: {error}")

    def _figures(self, timeline, links, uuids):
        """This process's figures for process 0: per-step means, and its GPUs' samples."""
        steps, data_ms, step_ms = per_step(self.steps)
        return {"rank": self._rank(), "host": socket.gethostname(), "steps": steps,
                "data_ms": data_ms, "step_ms": step_ms, "measured": self._measured,
                "timeline": [list(row) for row in _thin(timeline, MAX_GATHERED_ROWS)],
                "links": [list(link) if link else None for link in links],
                "uuids": uuids}

    def _write_csv(self, name, header, rows):
        path = os.path.join(self.log_dir, name)
        with _io.atomic_path(path, ".csv") as tmp, open(tmp, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(header)
            writer.writerows(["" if v is None else v for v in row] for row in rows)

    def _plot(self, timeline, gpus):
        """GPU utilisation over time (with GPUs), and each step's time with its data part."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        # A Figure of its own, not pyplot: drawing must not change the user's backend.
        panels = 2 if gpus and timeline else 1
        figure = Figure(figsize=(9, 3.2 * panels))
        FigureCanvasAgg(figure)
        axes = figure.subplots(panels, 1, squeeze=False)[:, 0]
        if panels == 2:
            ax = axes[0]
            for device in range(gpus):
                rows = [r for r in timeline if r[1] == device and r[2] is not None]
                ax.plot([r[0] for r in rows], [r[2] for r in rows], label=f"gpu:{device}")
                sm = [r for r in timeline if r[1] == device and r[3] is not None]
                if sm:
                    ax.plot([r[0] for r in sm], [r[3] for r in sm], linestyle="--",
                            label=f"gpu:{device} SM activity (GPM)")
            for seconds, epoch in self._epochs:
                ax.axvline(seconds, color="grey", linestyle=":", linewidth=1)
                ax.annotate(f"epoch {epoch + 1}", (seconds, 100), fontsize=7, rotation=90,
                            va="top")
            ax.set(xlabel="seconds since fit began", ylabel="utilisation (%)", ylim=(0, 105),
                   title="GPU utilisation (NVML)")
            ax.legend(loc="lower right", fontsize=8)
        self._plot_steps(axes[-1], gpus)
        figure.tight_layout()
        with _io.atomic_path(os.path.join(self.log_dir, "monitor.png"), ".png") as tmp:
            figure.savefig(tmp, dpi=100, bbox_inches="tight")

    def _plot_steps(self, ax, gpus):
        steps = self.steps[1:]  # the first step compiles: it would flatten the rest
        numbers = [r[0] for r in steps]
        ax.plot(numbers, [r[3] for r in steps], label="step (ms)", linewidth=1)
        if self._measured != "none" and steps:
            data = [r[2] or 0.0 for r in steps]
            ax.fill_between(numbers, 0, data, alpha=0.5, color="tab:orange",
                            label="waiting for the batch (ms)")
        first = {}
        for number, epoch, _, _ in steps:
            first.setdefault(epoch, number)
        for number in first.values():
            ax.axvline(number, color="grey", linestyle=":", linewidth=1)
        compile_note = f"; step 0 (compiling, {self.steps[0][3] / 1000:.1f} s) not shown" if (
            self.steps) else ""
        ax.set(xlabel="step (dotted: an epoch begins)", ylabel="ms", ylim=(0, None),
               title=("Per-step time on the host" + ("" if gpus else " (no GPU)")
                      + compile_note))
        ax.legend(loc="lower right", fontsize=8)

    def _write_tensorboard(self, timeline):
        if self._board is None:
            return
        folder = getattr(self._board, "log_dir", self._board)
        try:
            import tensorflow as tf
        except ImportError:
            logger.warning("DeviceMonitor: TensorFlow is not installed; no TensorBoard scalars.")
            return
        writer = tf.summary.create_file_writer(os.path.join(os.fspath(folder), "devices"))
        with writer.as_default():  # a scalar call per value: thinned like the gather
            for seconds, device, util, sm_util, _, memory in _thin(timeline, MAX_GATHERED_ROWS):
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
