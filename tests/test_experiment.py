"""The main job end to end, tiny: `keras-multigpu train` and `compare` on virtual devices."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import cifar_dir
from keras_multigpu import cli
from keras_multigpu.data import find_cifar10

pytestmark = pytest.mark.slow  # several processes or whole runs: not in the fast loop

TINY = ["--epochs", "2", "--limit", "96", "--width", "0.125", "--batch-per-device", "16"]

LOAD = """
import sys, numpy as np, keras
model = keras.saving.load_model(sys.argv[1])
print("library" if "keras_multigpu" in sys.modules else "plain", model.predict(
    np.zeros((2, 32, 32, 3), "float32"), verbose=0).shape)
"""


def test_train_writes_every_output(tmp_path, capsys):
    out = tmp_path / "run"
    code = cli.main(["train", "--gpus", "3", "--output", str(out), "--data-dir", cifar_dir(),
                     "--lr", "0.01", *TINY])
    assert code == 0
    assert sorted(os.listdir(out)) == ["history.json", "model.keras", "monitor", "plot.png"]
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(out / "monitor")) == ["monitor.png", "steps.csv", "timeline.csv"]
    history = json.loads((out / "history.json").read_text())
    assert history["devices"] == ["cpu:0", "cpu:1", "cpu:2"]
    assert history["global_batch"] == 48 and history["train_images"] == 96
    assert history["config"]["epochs"] == 2
    # The folder the images came from, whichever way it was found (--data-dir, the variable).
    assert history["data"] == str(find_cifar10(cifar_dir()))
    epochs = history["epochs"]
    for key in ("loss", "accuracy", "val_loss", "val_accuracy", "learning_rate", "seconds",
                "images_per_second"):
        assert len(epochs) == 2 and all(np.isfinite(e[key]) for e in epochs), key
    # Linear decay to zero over the run: half-way after epoch 1, zero at the end.
    assert epochs[0]["learning_rate"] == pytest.approx(0.005, rel=1e-4)
    assert epochs[1]["learning_rate"] == pytest.approx(0.0, abs=1e-9)
    assert history["complete"] is True
    # The verdict: arrays on the devices and a real convolutional step on a CPU.
    assert history["verdict"]["bound"] == "compute", history["verdict"]
    printed = capsys.readouterr().out
    assert "DeviceMonitor: not input-bound" in printed or (
        "DeviceMonitor: moderately input-bound" in printed)
    assert "Epoch 2/2" in printed  # Keras's output, one line per epoch: stdout is no terminal
    assert "\x1b" not in printed and "\x08" not in printed and "\r" not in printed
    line = printed.strip().splitlines()[-1]
    assert line.startswith("devices=3 (cpu:0, cpu:1, cpu:2)") and "val_accuracy=" in line
    assert line.endswith(f"; saved in {out}: model.keras, history.json, plot.png, monitor/"), (
        line)
    loaded = subprocess.run(
        [sys.executable, "-c", LOAD, str(out / "model.keras")], capture_output=True, text=True,
        env={**os.environ, "KERAS_BACKEND": "jax"}, timeout=180, check=False,
    )
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert loaded.stdout.split() == ["plain", "(2,", "10)"]


def test_target_accuracy_sets_the_exit_status(tmp_path, capsys):
    code = cli.main(["train", "--gpus", "2", "--output", str(tmp_path), "--data-dir",
                     cifar_dir(), "--target-acc", "0.99", "--no-augment", *TINY])
    assert code == 1
    printed = capsys.readouterr()
    assert "below --target-acc 0.99" in printed.err
    accuracy = json.loads((tmp_path / "history.json").read_text())["final_val_accuracy"]
    line = printed.out.strip().splitlines()[-1]
    assert f"; --target-acc 0.99 FAILED ({accuracy:.4f} < 0.99); saved in {tmp_path}: " in line


def test_compare_overlays_device_counts(tmp_path, capsys):
    code = cli.main(["compare", "--gpus", "1,2", "--output", str(tmp_path), "--data-dir",
                     cifar_dir(), *TINY])
    assert code == 0
    assert (tmp_path / "compare.png").exists()
    runs = json.loads((tmp_path / "compare.json").read_text())
    assert [len(r["devices"]) for r in runs] == [1, 2]
    table = capsys.readouterr().out
    assert "speed-up" in table and "s/epoch" in table
    assert table.strip().splitlines()[-1] == (
        f"saved in {tmp_path}: compare.json, compare.png, gpus-1/, gpus-2/"
    )


def test_missing_data_is_a_clear_error(tmp_path, capsys):
    code = cli.main(["train", "--gpus", "1", "--output", str(tmp_path / "o"), "--data-dir",
                     str(tmp_path / "nowhere"), *TINY])
    assert code == 2
    err = capsys.readouterr().err
    assert "nowhere" in err and "--data-dir" in err and "Traceback" not in err
    assert os.listdir(tmp_path) == []  # no empty output folder left behind


def test_bad_flags_are_refused(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--epochs", "0"])
    assert "positive integer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["compare", "--gpus", "1,x"])


def test_devices_lists_without_starting_anything(capsys):
    assert cli.main(["devices", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["devices"]
    assert [d["kind"] for d in listed] == ["cpu"] * 8
