"""The experiment's figures, drawn with matplotlib (no display needed)."""

from keras_multigpu._extras import require

matplotlib = require("matplotlib", "experiment", "The experiment (train, compare, bench)")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from keras_multigpu._io import atomic_path  # noqa: E402


def _save(figure, path):
    with atomic_path(path, ".png") as tmp:
        figure.savefig(tmp, dpi=110, bbox_inches="tight")
    plt.close(figure)


def _title(summary):
    names = ", ".join(summary["device_names"])
    return (
        f"MiniGoogLeNet on CIFAR-10: {len(summary['devices'])} × {names}, "
        f"{summary['mean_epoch_seconds']:.2f} s/epoch"
    )


def training_curves(epochs, summary, path):
    """Train/validation loss and accuracy per epoch (the post's figure)."""
    x = [e["epoch"] for e in epochs]
    figure, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key in ((loss_ax, "loss"), (acc_ax, "accuracy")):
        ax.plot(x, [e[key] for e in epochs], label=f"train {key}")
        if "val_" + key in epochs[0]:
            ax.plot(x, [e["val_" + key] for e in epochs], label=f"validation {key}")
        ax.set_xlabel("epoch")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        ax.legend()
    figure.suptitle(_title(summary))
    _save(figure, path)


def comparison(runs, path):
    """Curves of several device counts overlaid, and epoch time / speed-up bars.

    Args:
        runs: list of `(summary, epochs)` pairs, the first being the baseline.
    """
    figure, (curve_ax, bar_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for summary, epochs in runs:
        n = len(summary["devices"])
        x = [e["epoch"] for e in epochs]
        line = curve_ax.plot(x, [e["loss"] for e in epochs], label=f"{n} dev train loss")[0]
        if "val_accuracy" in epochs[0]:
            curve_ax.plot(x, [e["val_accuracy"] for e in epochs], linestyle="--",
                          color=line.get_color(), label=f"{n} dev val accuracy")
    curve_ax.set_xlabel("epoch")
    curve_ax.set_title("loss and validation accuracy")
    curve_ax.grid(alpha=0.3)
    curve_ax.legend(fontsize=8)

    labels = [str(len(s["devices"])) for s, _ in runs]
    times = [s["mean_epoch_seconds"] for s, _ in runs]
    bars = bar_ax.bar(labels, times, color="tab:blue")
    for bar, t in zip(bars, times):
        bar_ax.annotate(f"{t:.2f} s\n×{times[0] / t:.2f}", (bar.get_x() + bar.get_width() / 2, t),
                        ha="center", va="bottom", fontsize=9)
    bar_ax.set_xlabel("devices")
    bar_ax.set_ylabel("s / epoch (steady state)")
    bar_ax.set_title("epoch time and speed-up over the first")
    bar_ax.set_ylim(0, max(times) * 1.3)
    names = ", ".join(runs[0][0]["device_names"])
    figure.suptitle(f"MiniGoogLeNet on CIFAR-10, device: {names}")
    _save(figure, path)
