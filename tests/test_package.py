"""The package as a user installs and imports it: no surprise at import, the user's backend
choice honoured, and a missing extra or framework named in one line.

Each test runs a fresh interpreter: what an import does can only be seen before it.
A module "not installed" is simulated by an import finder that refuses it, as Python's
import does on a machine without it.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(code, env=None, timeout=240):
    base = {k: v for k, v in os.environ.items()
            if k not in ("KERAS_BACKEND", "KERAS_MULTIGPU_CPU_DEVICES", "XLA_FLAGS")}
    source = os.path.join(ROOT, "src")
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [source, base.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                          env={**base, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


# A machine without these modules: an import finder that refuses them (modules that only
# look in sys.modules for them, such as SciPy's array API check, find nothing, as there).
BLOCK = """import importlib.abc, sys
class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {names!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, _NotInstalled())
"""


def test_import_honours_keras_json_and_changes_no_environment(tmp_path):
    pytest.importorskip("torch", reason="keras.json names the torch backend here")
    home = tmp_path / "keras-home"
    home.mkdir()
    (home / "keras.json").write_text(json.dumps({"backend": "torch"}))
    result = _python("""
        import json, os
        import keras  # Keras's import sets variables of its own (TF_CPP_MIN_LOG_LEVEL, ...)
        before = dict(os.environ)
        import keras_multigpu
        changed = sorted(k for k in set(before) | set(os.environ)
                         if before.get(k) != os.environ.get(k))
        print(json.dumps({"backend": keras.backend.backend(), "changed": changed}))
    """, env={"KERAS_HOME": str(home)})
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"backend": "torch", "changed": []}


def test_the_users_keras_backend_wins_over_keras_json(tmp_path):
    home = tmp_path / "keras-home"
    home.mkdir()
    (home / "keras.json").write_text(json.dumps({"backend": "torch"}))
    result = _python("import keras_multigpu, keras; print(keras.backend.backend())",
                     env={"KERAS_HOME": str(home), "KERAS_BACKEND": "jax"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == "jax"


def test_with_nothing_set_keras_default_stands(tmp_path):
    pytest.importorskip("tensorflow", reason="Keras's default backend is TensorFlow")
    home = tmp_path / "empty-keras-home"
    home.mkdir()
    result = _python("import keras_multigpu, keras; print(keras.backend.backend())",
                     env={"KERAS_HOME": str(home)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == "tensorflow"


def test_import_loads_neither_the_monitor_nor_nvml():
    result = _python("""
        import sys
        import keras_multigpu
        print(sorted(m for m in ("keras_multigpu.monitor", "keras_multigpu.nvml", "pynvml")
                     if m in sys.modules))
        print(keras_multigpu.callbacks.DeviceMonitor.__module__)
    """, env={"KERAS_BACKEND": "jax"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["[]", "keras_multigpu.monitor"]


def test_the_command_starts_no_framework_and_the_library_registers_its_classes():
    """The `keras-multigpu` command imports Keras only for what needs it (its argument
    errors, `devices` and `launch` then take a fraction of a second); a program importing
    the package finds its Keras classes registered for `keras.saving.load_model`."""
    command = _python("""
        import sys
        sys.argv = ["keras-multigpu", "frobnicate"]
        from keras_multigpu import cli
        try:
            cli.main()
        except SystemExit as exit:
            print(exit.code, "keras" in sys.modules)
    """, env={"KERAS_BACKEND": "jax"})
    assert command.stdout.split() == ["2", "False"], command.stdout + command.stderr
    assert "invalid choice: 'frobnicate'" in command.stderr
    library = _python("""
        import keras_multigpu
        import keras
        print(keras.saving.get_registered_object("keras_multigpu>LinearScaling").__name__)
    """, env={"KERAS_BACKEND": "jax"})
    assert library.stdout.split() == ["LinearScaling"], library.stdout + library.stderr


@pytest.mark.parametrize("argv", [["devices"], ["-v", "launch", "-n", "2", "missing.py"]])
def test_devices_and_launch_start_no_framework_with_virtual_cpu_devices_asked(argv):
    """With KERAS_MULTIGPU_CPU_DEVICES set, importing the package configured the engine's
    virtual devices, starting Keras and its framework (about 6 s on TensorFlow) for
    commands that need neither; `train`, `compare` and `bench` still get them."""
    command = _python(f"""
        import sys
        sys.argv = ["keras-multigpu", *{argv!r}]
        from keras_multigpu import cli
        code = cli.main()
        print(code, "keras" in sys.modules, "tensorflow" in sys.modules)
    """, env={"KERAS_MULTIGPU_CPU_DEVICES": "2"})
    code = "0" if argv == ["devices"] else "2"
    assert command.stdout.split()[-3:] == [code, "False", "False"], (
        command.stdout + command.stderr)


@pytest.mark.parametrize("value", ["abc", "0"])
def test_a_bad_virtual_device_count_is_one_line_for_the_command(value):
    """A bad KERAS_MULTIGPU_CPU_DEVICES is a bad flag's one line and status 2 for every
    command (`devices`, `--help` too), where the package's import raised it with a
    traceback; a program importing the package still gets the ValueError."""
    variable = {"KERAS_MULTIGPU_CPU_DEVICES": value}
    for argv in (["devices"], ["--help"]):
        command = _python(f"""
            import sys
            sys.argv = ["keras-multigpu", *{argv!r}]
            from keras_multigpu import cli
            cli.main()
        """, env=variable)
        assert command.returncode == 2, command.stdout + command.stderr
        assert command.stderr == (
            f"keras-multigpu: KERAS_MULTIGPU_CPU_DEVICES must be a positive integer. "
            f"Received: KERAS_MULTIGPU_CPU_DEVICES={value!r}. Set it to the number of virtual "
            "CPU devices you want, e.g. 4, or unset it.\n"), command.stderr
    library = _python("import keras_multigpu", env=variable)
    assert library.returncode == 1 and library.stderr.rstrip().endswith(
        f"Received: KERAS_MULTIGPU_CPU_DEVICES={value!r}. Set it to the number of virtual "
        "CPU devices you want, e.g. 4, or unset it."), library.stderr


def test_a_missing_monitor_extra_is_named_in_one_line():
    result = _python(BLOCK.format(names=("matplotlib",)) + textwrap.dedent("""
        import keras_multigpu as kmg
        try:
            kmg.callbacks.DeviceMonitor("logs")
        except ImportError as error:
            print(type(error).__name__, "|", error)
    """), env={"KERAS_BACKEND": "jax"})
    assert result.returncode == 0, result.stderr
    line = result.stdout.strip()
    assert line.startswith("MissingExtra | DeviceMonitor needs matplotlib"), line
    assert 'pip install "keras-multigpu[monitor]"' in line and "\n" not in line


@pytest.mark.parametrize("command", [["train", "--epochs", "1"], ["bench", "--project",
                                                                   "--step-ms", "5"]])
def test_a_missing_experiment_extra_is_one_line_and_exit_2(command, tmp_path):
    result = _python(BLOCK.format(names=("matplotlib",)) + textwrap.dedent(f"""
        from keras_multigpu.cli import main
        sys.exit(main({command + ["--output", str(tmp_path / "run")]!r}))
    """), env={"KERAS_BACKEND": "jax"})
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"keras-multigpu {command[0]}: error: ")
    assert 'pip install "keras-multigpu[experiment]"' in lines[0]
    assert not (tmp_path / "run").exists()


FRAMEWORKS = ("jax", "jaxlib", "tensorflow", "torch")


def test_devices_and_launch_work_without_a_framework(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text("import os\nprint('rank', os.environ['RANK'], 'of', "
                      "os.environ['WORLD_SIZE'])\n")
    result = _python(BLOCK.format(names=FRAMEWORKS) + textwrap.dedent(f"""
        import keras_multigpu
        from keras_multigpu.cli import main
        assert main(["devices"]) == 0
        code = main(["launch", "-n", "2", {str(script)!r}])
        try:
            keras_multigpu.multi_gpu_model
        except ImportError as error:
            print("needs:", error)
        sys.exit(code)
    """), env={"KERAS_BACKEND": "jax"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rank 0 of 2" in result.stdout and "rank 1 of 2" in result.stdout
    assert "No GPU found" in result.stdout or "gpu:" in result.stdout
    needs = [line for line in result.stdout.splitlines() if line.startswith("needs:")]
    assert len(needs) == 1, result.stdout
    assert "keras_multigpu.multi_gpu_model needs Keras with a backend" in needs[0]
    assert 'pip install "keras-multigpu[jax]"' in needs[0]


def test_keras_internals_are_imported_in_one_place():
    """Every `keras.src` import of the library is in `keras_multigpu/_keras/`, where each
    internal it relies on is checked at import."""
    package = os.path.join(ROOT, "src", "keras_multigpu")
    outside = []
    for folder, _, names in os.walk(package):
        if os.path.basename(folder) == "_keras":
            continue
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path) as f:
                    outside += [f"{os.path.relpath(path, ROOT)}:{number}"
                                for number, line in enumerate(f, 1)
                                if "keras.src" in line and not line.lstrip().startswith("#")]
    assert outside == []


@pytest.mark.parametrize("backend, module, name", [
    ("jax", "keras.src.losses.loss", "reduce_values"),
    ("jax", "keras.src.trainers.data_adapters", "get_data_adapter"),
    ("torch", "keras.src.backend.torch.random", "dropout"),
    ("jax", "keras.layers", "BatchNormalization._moments"),  # a public class's private method
])
def test_a_keras_that_moved_an_internal_is_named_at_import(backend, module, name):
    pytest.importorskip(backend)
    result = _python(f"""
        import importlib, sys
        import keras
        owner = importlib.import_module({module!r})
        *path, last = {name!r}.split(".")
        for part in path:
            owner = getattr(owner, part)
        delattr(owner, last)  # as a Keras release that moved it would have it
        try:
            import keras_multigpu
            from keras_multigpu import backends

            backends.current()
        except ImportError as error:
            print(type(error).__name__, "|", error)
    """, env={"KERAS_BACKEND": backend})
    assert result.returncode == 0, result.stderr[-3000:]
    line = result.stdout.strip().splitlines()[-1]
    assert line.startswith("KerasVersionError | keras-multigpu ("), line
    import keras

    assert (f"does not work with the installed Keras {keras.__version__}: it is tested on "
            "keras>=3.15,<3.17" in line), line
    assert f"{module}.{name}" in line, line


def test_devices_and_launch_work_with_a_keras_outside_the_tested_range(tmp_path):
    """The CLI's `devices` and `launch` need no framework: a Keras that moved an internal is
    named when the library's training API is first used, not at `import keras_multigpu`."""
    script = tmp_path / "hello.py"
    script.write_text("import os\nprint('rank', os.environ['RANK'])\n")
    result = _python(f"""
        import sys
        import keras.src.utils.io_utils as moved
        del moved.print_msg  # as a Keras release that moved it would have it
        import keras_multigpu
        from keras_multigpu.cli import main
        assert main(["devices"]) == 0
        code = main(["launch", "-n", "2", {str(script)!r}])
        try:
            keras_multigpu.multi_gpu_model
        except ImportError as error:
            print("needs:", type(error).__name__, error)
        sys.exit(code)
    """, env={"KERAS_BACKEND": "jax"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rank 0" in result.stdout and "rank 1" in result.stdout
    needs = [line for line in result.stdout.splitlines() if line.startswith("needs:")]
    assert len(needs) == 1 and needs[0].startswith("needs: KerasVersionError "), result.stdout
    assert "keras.src.utils.io_utils.print_msg" in needs[0]

