"""The `keras-multigpu` command at the user's level: its errors, help, output folders and
what a crashed or interrupted run keeps."""

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

from conftest import child_env, cifar_dir, synthetic_cifar
from keras_multigpu import callbacks as callbacks_lib
from keras_multigpu import cli, experiment, interrupt
from keras_multigpu.data import load_cifar10

TINY = ["--limit", "32", "--width", "0.0625", "--batch-per-device", "8"]


def _train(out, *flags, epochs=1):
    return cli.main(["train", "--output", str(out), "--data-dir", cifar_dir(),
                     "--epochs", str(epochs), *TINY, *flags])


def _history(out):
    return json.loads((out / "history.json").read_text())


def _fail_in_epoch(monkeypatch, number, error):
    """Makes epoch `number` (1-based) raise `error` as it begins, as a crash or a Ctrl-C would."""
    begin = callbacks_lib.EpochStats.on_epoch_begin

    def on_epoch_begin(self, epoch, logs=None):
        if epoch + 1 == number:
            raise error
        begin(self, epoch, logs)

    monkeypatch.setattr(callbacks_lib.EpochStats, "on_epoch_begin", on_epoch_begin)


# -- flags and help ----------------------------------------------------------------------


def _subparsers(parser):
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def test_help_shows_every_default(capsys):
    parser = cli.build_parser()
    for name, sub in {"": parser, **_subparsers(parser)}.items():
        formatter = sub._get_formatter()
        for action in sub._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            if not action.option_strings:  # a positional (launch's script): required
                continue
            assert "default" in formatter._get_help_string(action), (name, action.dest)
    with pytest.raises(SystemExit) as info:
        cli.main(["train", "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("--epochs EPOCHS training epochs (default: 70)", "(default: 1.0)",
                  "(default: 0.005)", "(default: 64)", "(default: runs/minigooglenet)",
                  "(default: auto)"):
        assert shown in text


@pytest.mark.parametrize("text, gpus", [
    ("0", 0), ("1", 1), ("3", 3), ("all", None), ("0,2", [0, 2]), ("3,", [3]), (" 1, 0 ", [1, 0]),
])
def test_train_gpus_means_what_the_api_does(text, gpus):
    assert cli.build_parser().parse_args(["train", "--gpus", text]).gpus == gpus


@pytest.mark.parametrize("argv, message", [
    (["train", "--gpus", "-1"], "argument --gpus: expected a device count"),
    (["train", "--gpus", "1,1"], "list of distinct device ids"),
    (["train", "--gpus", "two"], "argument --gpus"),
    (["compare", "--gpus", "0,2"], "distinct device counts of at least 1"),
    (["compare", "--gpus", "2,2"], "distinct device counts of at least 1"),
    (["train", "--width", "0"], "argument --width: expected a positive number"),
    (["train", "--lr", "nan"], "argument --lr: expected a positive number"),
    (["train", "--target-acc", "1.5"], "argument --target-acc: expected a number from 0 to 1"),
    (["train", "--progress", "loud"], "argument --progress: invalid choice"),
    (["train", "--seed", "-1"], "argument --seed: expected an integer from 0 to 2**32 - 1"),
    (["train", "--seed", str(2**32)], "expected an integer from 0 to 2**32 - 1 (4294967295), "
                                      "got '4294967296'"),
    (["launch", "-n", "0", "train.py"], "argument -n/--nproc-per-node/--nproc: expected a "
                                        "positive integer, got '0'"),
    (["launch", "--max-restarts", "-1", "train.py"], "argument --max-restarts"),
    (["nosuch"], "invalid choice: 'nosuch'"),
])
def test_bad_flags_exit_2_with_a_message(argv, message, capsys):
    """In one line that names the command's --help (argparse printed its usage block
    first: 7 lines for launch)."""
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and err.strip().endswith("--help)"), err


def test_launch_without_a_script_names_the_script_alone(capsys):
    """argparse said "the following arguments are required: script, args" (args may be
    left out)."""
    assert cli.main(["launch", "-n", "2"]) == 2
    err = capsys.readouterr().err
    assert "launch needs a script" in err and "args" not in err
    assert len(err.strip().splitlines()) == 1


def test_compare_gpus_stays_a_list_of_counts():
    assert cli.build_parser().parse_args(["compare", "--gpus", "1,2,4"]).gpus == [1, 2, 4]


def test_too_many_or_unknown_devices_are_refused_before_anything_starts(tmp_path, capsys):
    # conftest gives 8 virtual CPU devices
    assert cli.main(["train", "--gpus", "9", "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("keras-multigpu train: error: --gpus: gpus=9 but this machine has 8 ")
    assert "Pass --gpus all" in err
    assert cli.main(["train", "--gpus", "2,8", "--output", str(tmp_path / "o")]) == 2
    assert "unknown device id(s) [8]" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_progress_follows_the_terminal(monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    assert experiment.keras_verbose("auto") == 1  # a terminal: Keras's progress bar
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False, raising=False)
    assert experiment.keras_verbose("auto") == 2  # piped: one line per epoch
    parser = cli.build_parser()
    for choice, verbose in (("auto", "auto"), ("bar", 1), ("epoch", 2), ("none", 0)):
        args = parser.parse_args(["train", "--progress", choice])
        assert cli._config(args, None, "o").verbose == verbose


# -- the output folder -----------------------------------------------------------------


@pytest.mark.parametrize("command", ["train", "compare"])
def test_an_output_that_is_a_file_is_refused(tmp_path, capsys, command):
    target = tmp_path / "taken"
    target.write_text("mine")
    assert cli.main([command, "--output", str(target)]) == 2
    err = capsys.readouterr().err
    assert err == (f"keras-multigpu {command}: error: --output {target} is a file; "
                   "choose another --output\n")
    assert cli.main([command, "--output", str(target / "run")]) == 2
    err = capsys.readouterr().err
    assert f"--output {target / 'run'} cannot be created: {target} is a file" in err
    assert target.read_text() == "mine"
    assert cli.main([command, "--output", ""]) == 2
    assert "--output is empty" in capsys.readouterr().err


@pytest.mark.skipif(not os.path.isdir("/sys"), reason="sysfs (Linux): a folder no one, root "
                                                      "included, creates folders in")
def test_an_output_that_cannot_be_written_says_what_to_do():
    with pytest.raises(OSError, match=r"--output /sys/keras-multigpu-test cannot be written: "
                                      r".*\. Choose an --output folder this user can write to"):
        with cli._claimed("/sys/keras-multigpu-test", overwrite=False):
            pass


@pytest.mark.parametrize("command", ["train", "compare"])
def test_an_earlier_run_is_not_overwritten(tmp_path, capsys, command):
    (tmp_path / "history.json").write_text("{}")
    (tmp_path / "model.keras").write_text("old")
    code = cli.main([command, "--output", str(tmp_path), "--data-dir", cifar_dir()])
    assert code == 2
    err = capsys.readouterr().err
    assert err == (f"keras-multigpu {command}: error: --output {tmp_path} already holds files "
                   "(history.json, model.keras); pass --overwrite to replace them, or choose "
                   "another --output\n")
    assert (tmp_path / "model.keras").read_text() == "old"


def test_a_second_run_into_the_same_output_at_once_is_refused(tmp_path):
    """While one run holds --output (a claim held until it ends), another into the same
    folder exits 2 at once, naming the holder, and writes nothing there."""
    out = tmp_path / "run"
    with cli._claimed(str(out), overwrite=True):
        (out / "history.json").write_text("the first run's")
        second = subprocess.run(
            [sys.executable, "-m", "keras_multigpu.cli", "train", "--output", str(out),
             "--overwrite", "--data-dir", synthetic_cifar(tmp_path / "data")],
            capture_output=True, text=True, timeout=120, check=False,
            env={**os.environ, "KERAS_BACKEND": "jax"})
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"--output {out} is in use by another run (pid {os.getpid()}, started " in (
            second.stderr), second.stderr[-2000:]
        assert "Traceback" not in second.stderr
    assert (out / "history.json").read_text() == "the first run's"
    assert sorted(os.listdir(out)) == ["history.json"]  # the claim is gone with the run
    with cli._claimed(str(out), overwrite=True):  # and the folder can be claimed again
        pass


def test_a_run_failing_before_its_first_file_leaves_no_folder(tmp_path, capsys):
    out = tmp_path / "runs" / "deep" / "x"
    code = cli.main(["compare", "--output", str(out), "--data-dir", str(tmp_path / "none")])
    assert code == 2
    err = capsys.readouterr().err
    assert "not found" in err and "Traceback" not in err
    assert os.listdir(tmp_path) == []


@pytest.mark.slow  # a whole run
def test_a_first_write_that_fails_leaves_no_empty_folder(tmp_path, capsys, monkeypatch):
    """The folder appears with the first file: a failed write takes it away again."""

    def full_disk(model, path):
        with experiment.atomic_path(path, ".keras"):
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(experiment, "save_model", full_disk)
    out = tmp_path / "runs" / "x"
    assert _train(out, "--gpus", "1") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"keras-multigpu train: error: [Errno 28] Cannot write {out}/model.keras")
    assert err.rstrip().endswith("; nothing was saved: the first epoch had not ended")
    assert "Traceback" not in err
    assert os.listdir(tmp_path) == []


# -- a whole run: overwrite, gpus=0, the closing line -----------------------------------


@pytest.mark.slow  # a whole run
def test_overwrite_replaces_a_run_and_the_closing_line_says_what_happened(tmp_path, capsys):
    (tmp_path / "history.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("mine")
    # --gpus 0 is one device, as in the API; --limit 3 is less than one batch of 16.
    code = _train(tmp_path, "--overwrite", "--gpus", "0", "--limit", "3",
                  "--batch-per-device", "16", "--target-acc", "0")
    assert code == 0
    history = _history(tmp_path)
    assert history["devices"] == ["cpu:0"] and history["train_images"] == 3
    assert history["complete"] is True and len(history["epochs"]) == 1
    assert sorted(os.listdir(tmp_path)) == ["history.json", "model.keras", "monitor",
                                            "notes.txt", "plot.png"]
    line = capsys.readouterr().out.strip().splitlines()[-1]
    accuracy = history["final_val_accuracy"]
    assert line.startswith("devices=1 (cpu:0) total=")
    assert line.endswith(f"val_accuracy={accuracy:.4f}; --target-acc 0 passed "
                         f"({accuracy:.4f} >= 0); saved in {tmp_path}: model.keras, "
                         "history.json, plot.png, monitor/")


# -- crashes and Ctrl-C keep the epochs done -------------------------------------------


def _evaluate(path, limit):
    """Loss of the saved model on the run's test images, with plain Keras."""
    (_, _), (x_test, y_test) = load_cifar10(cifar_dir(), limit)
    model = keras.saving.load_model(path)
    model.compile(loss="categorical_crossentropy")
    return model.evaluate(x_test.astype("float32"), keras.utils.to_categorical(y_test, 10),
                          verbose=0)


@pytest.mark.slow  # a whole run
def test_a_crash_keeps_the_epochs_done(tmp_path, monkeypatch):
    _fail_in_epoch(monkeypatch, 2, RuntimeError("the device fell over"))
    with pytest.raises(RuntimeError, match="the device fell over") as info:
        _train(tmp_path / "run", "--gpus", "1,3", epochs=3)
    assert info.value.__notes__ == [
        f"{tmp_path / 'run'} keeps 1 of 3 epoch(s) (model.keras, history.json, plot.png, "
        "written after each epoch)"
    ]
    history = _history(tmp_path / "run")
    assert history["complete"] is False and history["devices"] == ["cpu:1", "cpu:3"]
    assert [e["epoch"] for e in history["epochs"]] == [1]
    assert history["final_val_loss"] == history["epochs"][0]["val_loss"]
    assert (tmp_path / "run" / "plot.png").read_bytes()[:4] == b"\x89PNG"
    # The checkpoint holds the weights after epoch 1: its loss is epoch 1's val_loss.
    loss = _evaluate(tmp_path / "run" / "model.keras", 32)
    assert loss == pytest.approx(history["epochs"][0]["val_loss"], rel=1e-4)
    assert keras.config.dtype_policy().name == "float32"


@pytest.mark.slow  # a whole run
def test_ctrl_c_exits_130_naming_what_was_kept(tmp_path, capsys, monkeypatch):
    _fail_in_epoch(monkeypatch, 3, interrupt.Interrupted("Stopped by Ctrl-C"))
    assert _train(tmp_path / "run", "--gpus", "2", epochs=5) == 130
    err = capsys.readouterr().err
    assert err == (f"keras-multigpu train: interrupted; {tmp_path / 'run'} keeps 2 of 5 "
                   "epoch(s) (model.keras, history.json, plot.png, written after each epoch)\n")
    assert [e["epoch"] for e in _history(tmp_path / "run")["epochs"]] == [1, 2]


@pytest.mark.slow  # a whole run's start: 13 s when first
@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                         ids=["ctrl-c", "sigterm"])
def test_ctrl_c_in_the_first_epoch_leaves_no_folder(tmp_path, capsys, monkeypatch, signum,
                                                    status):
    """Exits as a shell reports the signal: 130 after Ctrl-C, 143 after SIGTERM."""
    _fail_in_epoch(monkeypatch, 1, interrupt.Interrupted("Stopped", signum))
    assert _train(tmp_path / "run", "--gpus", "1") == status
    assert capsys.readouterr().err == (
        "keras-multigpu train: interrupted; nothing was saved: the first epoch had not ended\n"
    )
    assert os.listdir(tmp_path) == []


def _sigint_default():
    """Ctrl-C as in a terminal: a test run started in the background (`cmd &`) ignores SIGINT,
    and its children would inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow  # a process of its own
def test_a_real_ctrl_c_on_a_piped_run(tmp_path):
    """The installed command, stdout piped: one line per epoch, and a SIGINT ends it with
    status 130, one message and no traceback, keeping the epochs done."""
    out = tmp_path / "run"
    env = child_env(KERAS_BACKEND="jax", KERAS_MULTIGPU_CPU_DEVICES="2")
    process = subprocess.Popen(
        [sys.executable, "-m", "keras_multigpu.cli", "train", "--gpus", "2", "--output",
         str(out), "--data-dir", cifar_dir(), "--epochs", "1000", *TINY],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        preexec_fn=_sigint_default,
    )
    deadline = time.monotonic() + 240
    while not (out / "history.json").exists() or len(_history(out)["epochs"]) < 2:
        if process.poll() is not None:
            pytest.fail(f"train exited early: {process.communicate()[1][-3000:]}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail("two epochs never ended")
        time.sleep(0.1)
    process.send_signal(signal.SIGINT)
    try:
        stdout, stderr = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail("a Ctrl-C did not stop train")
    assert process.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr
    saved = len(_history(out)["epochs"])
    assert stderr.rstrip().splitlines()[-1] == (
        f"keras-multigpu train: interrupted; {out} keeps {saved} of 1000 epoch(s) "
        "(model.keras, history.json, plot.png, written after each epoch)"
    )
    assert not any(c in stdout for c in "\x1b\x08\r")  # no progress-bar escapes
    epoch_lines = [line for line in stdout.splitlines() if "val_loss" in line]
    assert len(epoch_lines) == saved
    assert all(line.startswith("2/2 - ") for line in epoch_lines), epoch_lines[:2]
    assert np.isfinite(_history(out)["final_val_loss"])


@pytest.mark.slow  # a process of its own (two on torch)
@pytest.mark.parametrize("backend", ["tensorflow", "torch"])
def test_train_takes_its_gpus_count_of_virtual_devices_on_every_engine(tmp_path, backend):
    """`--gpus 2` on a machine without GPUs, KERAS_MULTIGPU_CPU_DEVICES unset, asks for two
    virtual CPU devices as its help says: TensorFlow's run was refused ("this machine has 1
    CPU device(s)"), and torch's two processes (the run relaunches itself) each claimed the
    --output folder and waited for the other's model.keras (their temporary files' names
    differed). One run, one history.json of two devices."""
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "keras_multigpu.cli", "train", "--gpus", "2", "--output",
         str(out), "--data-dir", cifar_dir(), "--epochs", "1", "--progress", "none", *TINY],
        capture_output=True, text=True, timeout=420, check=False,
        env=child_env(drop=("KERAS_MULTIGPU_CPU_DEVICES",), KERAS_BACKEND=backend))
    assert result.returncode == 0, result.stderr[-3000:]
    history = _history(out)
    assert history["devices"] == ["cpu:0", "cpu:1"] and history["complete"]
    assert sorted(os.listdir(out)) == ["history.json", "model.keras", "monitor", "plot.png"]
    assert keras.saving.load_model(out / "model.keras").name == "minigooglenet_cifar10"


def test_compare_on_torch_without_gpus_is_refused_before_it_trains(tmp_path):
    """torch runs one process per device, which `train --gpus N` starts by relaunching
    itself; `compare` runs several device counts in one process, so on a CPU-only machine
    it is refused at once, as `--gpus 0,1` is, not after its one-device run."""
    for command in (["compare", "--gpus", "1,2"], ["train", "--gpus", "0,1"]):
        result = subprocess.run(
            [sys.executable, "-m", "keras_multigpu.cli", *command, "--output",
             str(tmp_path / "run"), "--data-dir", cifar_dir(), "--epochs", "1", *TINY],
            capture_output=True, text=True, timeout=240, check=False,
            env=child_env(drop=("KERAS_MULTIGPU_CPU_DEVICES",), KERAS_BACKEND="torch"))
        assert result.returncode == 2, result.stderr[-3000:]
        assert "this machine has 1 CPU device(s)" in result.stderr, result.stderr[-3000:]
        assert not (tmp_path / "run").exists()
