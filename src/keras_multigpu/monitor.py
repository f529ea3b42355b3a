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

import logging
import math
import os
import socket
import threading
import time

import keras

from keras_multigpu import _extras, _io, processes
from keras_multigpu import nvml as nvml_lib
from keras_multigpu._keras import io_utils
from keras_multigpu._monitor_files import (
    MAX_GATHERED_ROWS,
    MonitorFiles,
    _merge_hosts,
    _sibling_board,
    _thin,
)
from keras_multigpu.diagnosis import communication_estimate, per_step, verdict

logger = logging.getLogger(__name__)

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


# -- the callback --------------------------------------------------------------


class DeviceMonitor(MonitorFiles, keras.callbacks.Callback):
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
