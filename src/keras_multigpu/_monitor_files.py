"""What `DeviceMonitor` writes (a mixin): `timeline.csv`, `steps.csv`, `monitor.png` (a
Figure of its own, not pyplot), TensorBoard scalars; and how process 0 merges the
other processes' figures."""

import csv
import logging
import math
import os
import sys

import keras

from keras_multigpu import _io

logger = logging.getLogger("keras_multigpu.monitor")

MAX_GATHERED_ROWS = 20_000  # device samples a process sends process 0 (thinned beyond)


def _thin(timeline, limit):
    """At most about `limit` rows, thinned by sample time: each sample has a row per GPU,
    so every GPU keeps its rows."""
    times = sorted({row[0] for row in timeline})
    per_sample = max(1, len(timeline) // max(len(times), 1))
    every = math.ceil(len(times) / max(1, limit // per_sample)) or 1
    kept = set(times[::every])
    return [row for row in timeline if row[0] in kept]


def _step_axis_top(step_ms):
    """The step plot's upper limit and the steps above it: 3 x the 95th percentile,
    so that one long step (a compilation) leaves the others readable."""
    if len(step_ms) < 20:
        return None, []
    ordered = sorted(step_ms)
    top = 3 * ordered[int(0.95 * (len(ordered) - 1))]
    clipped = [ms for ms in step_ms if ms > top]
    return (top * 1.05, clipped) if clipped else (None, [])


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


class MonitorFiles:
    """`DeviceMonitor`'s files."""

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
        top, clipped = _step_axis_top([r[3] for r in steps])
        if clipped:  # e.g. the step that compiles evaluation: it would flatten the rest
            compile_note += (f"; {len(clipped)} step(s) above {top:.0f} ms clipped "
                             f"(longest {max(clipped) / 1000:.1f} s)")
        ax.set(xlabel="step (dotted: an epoch begins)", ylabel="ms", ylim=(0, top),
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
