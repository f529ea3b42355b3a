"""Real Keras programs (tests/programs/) train through the wrapper as on one device.

Each program is trained by plain Keras on one device, then through `multi_gpu_model` on 2
or 3 devices with a global batch that divides neither device count nor the dataset, from
the same seed. A program written for every engine runs on one of them in CI, on 2 or 3
devices (`_with_counts`, `ENGINE`: chosen by measured cost), so that every engine meets
both counts and about a third of the programs. With KERAS_MULTIGPU_TEST_FULL=1 every
program runs on both counts on every engine (six times the time: CI keeps to the
rotation; run it after a change to an engine). Final weights, every history key, predict
outputs and a reload of the saved file, in a process that never imports keras_multigpu,
must agree: float32, 1e-4 relative."""

import contextlib
import importlib
import json
import os
import subprocess
import sys
import threading

import keras
import numpy as np
import pytest

import keras_multigpu as kmg
from conftest import ENGINES, FULL

pytestmark = pytest.mark.slow  # several processes or whole runs: not in the fast loop

PROGRAMS_DIR = os.path.join(os.path.dirname(__file__), "programs")
PROGRAMS = sorted(
    name[:-3] for name in os.listdir(PROGRAMS_DIR) if name.startswith("p") and name.endswith(".py")
)
RTOL, ATOL = 1e-4, 1e-6
RTOL64, ATOL64 = 1e-7, 1e-10  # in float64, for programs whose optimizer amplifies rounding
SEED = 1


def _load(name):
    return importlib.import_module(f"programs.{name}")


def _run(program, gpus, workdir, fit_kwargs=None, optimizer=None):
    """Trains `program` from SEED: plain Keras when gpus is None, else through the wrapper.

    `fit_kwargs` and `optimizer` (a factory) replace the program's own, for controls.
    """
    if gpus is None and "RANK" in os.environ:
        # torch: every process of the test runs the one-device reference too, each in its own
        # folder (its checkpoints are not the engine's files).
        workdir = f"{workdir}-rank{os.environ['RANK']}"
    os.makedirs(workdir, exist_ok=True)
    keras.utils.set_random_seed(SEED)
    if "torch" in sys.modules:  # a DataLoader's shuffle draws from torch's generator, which
        sys.modules["torch"].manual_seed(SEED)  # Keras seeds on the torch backend only
    model = program.build()
    initial = [np.copy(w) for w in model.get_weights()] if model.built else None
    compile_kwargs = {} if optimizer is None else {"optimizer": optimizer()}
    if getattr(program, "COMPILE_BEFORE_WRAP", False):
        program.compile(model, **compile_kwargs)
        target = model if gpus is None else kmg.multi_gpu_model(model, gpus=gpus)
    else:
        target = model if gpus is None else kmg.multi_gpu_model(model, gpus=gpus)
        program.compile(target, **compile_kwargs)
    kwargs = dict(fit_kwargs or program.fit_kwargs(workdir))
    epoch_totals = _EpochTotals()
    kwargs["callbacks"] = [*kwargs.get("callbacks", []), epoch_totals]
    history = target.fit(**kwargs).history
    if hasattr(program, "fine_tune"):  # a second phase: the program changes and recompiles
        program.fine_tune(model, target, **({} if optimizer is None
                                             else {"optimizer": optimizer()}))
        second = target.fit(**kwargs).history
        history = {key: history[key] + second[key] for key in history}
    predicted = (target.predict(program.predict_x(), batch_size=25, verbose=0)
                 if _predicts(program) else None)
    if keras.backend.backend() == "torch":
        # Keras's torch trainer keeps the training logs of metrics whose result() is a metric
        # variable itself (FalseNegatives, TruePositives, ...): the validation run resets that
        # variable in place, so one device's history shows validation figures under the
        # training keys. Each epoch's last batch logs hold the training figures.
        history.update(epoch_totals.totals)
    return model, target, initial, history, predicted


class _EpochTotals(keras.callbacks.Callback):
    """Each epoch's training figures, from its last batch's logs (copied as floats)."""

    def __init__(self):
        super().__init__()
        self.totals, self._last = {}, {}

    def on_train_batch_end(self, batch, logs=None):
        self._last = {key: float(value) for key, value in (logs or {}).items()}

    def on_epoch_end(self, epoch, logs=None):
        for key, value in self._last.items():
            self.totals.setdefault(key, []).append(value)


def _predicts(program):
    """Whether the program has a `call` to predict with (a GAN's model has none)."""
    return getattr(program, "PREDICT", True)


def _close(expected, actual, what, extra_atol=0.0):
    # On torch, the float64 runs keep float32 rounding in Keras's own loss path (one device's
    # logged losses have float32 resolution: Keras's result_type turns float64 into float32
    # on torch and JAX, so `ops.mean` reduces in float32; docs/semantics.md): they are held
    # to the float32 tolerance.
    precise = keras.config.floatx() == "float64" and keras.backend.backend() != "torch"
    rtol, atol = (RTOL64, ATOL64) if precise else (RTOL, ATOL)
    atol += extra_atol
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=rtol, atol=atol,
                               err_msg=what)


def _deviation(reference, run):
    """How far `run`'s weights are from `reference`'s, in units of the tolerance."""
    return max(
        float(np.max(np.abs(a - b) / (RTOL * np.abs(a) + ATOL)))
        for a, b in zip(reference[0].get_weights(), run[0].get_weights())
    )


def _per_output_loss(model, key):
    names = getattr(model, "output_names", None) or []
    return len(names) > 1 and key in {f"{name}_loss" for name in names}


def _compare(reference, run, gpus, program):
    ref_model, _, _, ref_history, ref_predicted = reference
    model, _, _, history, predicted = run
    assert history.keys() == ref_history.keys(), f"{gpus} devices: history keys"
    for key in ref_history:
        if keras.backend.backend() == "tensorflow" and _per_output_loss(ref_model, key):
            # Keras's TensorFlow trainer weighs these logs by the traced batch size, which a
            # partial last batch retraces away (weight 25 for full batches, 1 for the last):
            # the one-device reference depends on tracing, not on the data. The total loss,
            # the weights and the predictions are compared.
            continue
        _close(ref_history[key], history[key], f"{gpus} devices: history[{key!r}]")
    ref_weights, weights = ref_model.get_weights(), model.get_weights()
    assert len(weights) == len(ref_weights)
    for i, (expected, actual) in enumerate(zip(ref_weights, weights)):
        _close(expected, actual, f"{gpus} devices: weight {i} ({ref_model.weights[i].path})")
    if ref_predicted is None:
        return
    for i, (expected, actual) in enumerate(zip(keras.tree.flatten(ref_predicted),
                                                keras.tree.flatten(predicted))):
        what = f"{gpus} devices: predict output {i}"
        try:
            _close(expected, actual, what)
        except AssertionError:
            # Each device predicts on its own rows, a smaller batch than one device's: where
            # the CPU's kernels round a smaller batch otherwise (an AVX2 machine, not an
            # AVX-512 one, on p04), one device alone differs as much between those batch
            # sizes. That measured floor is allowed on top of the tolerance, nothing more.
            floor = _batch_shape_floor(reference[1], program, gpus, i, expected)
            _close(expected, actual, what, extra_atol=floor)


def _batch_shape_floor(target, program, gpus, output, reference):
    """How far one device's own predictions (`reference`, made in batches of 25) move when it
    predicts in the batch sizes each of `gpus` devices gets (batch 25 and the last, partial
    batch, split), as one number."""
    x = program.predict_x()
    rows = len(keras.tree.flatten(x)[0])
    shapes = {-(-25 // gpus), 25 // gpus, -(-(rows % 25) // gpus), (rows % 25) // gpus} - {0}
    return max(float(np.max(np.abs(np.asarray(keras.tree.flatten(
        target.predict(x, batch_size=s, verbose=0))[output]) - np.asarray(reference))))
        for s in shapes)


# One clean process per pytest process reloads every program's saved model, as a user on
# one CPU would: no virtual devices, no PYTHONPATH, and never keras_multigpu. It imports
# Keras and its backend once (2-4 s a time otherwise) and clears Keras's session before
# each program, whose module it runs afresh (its custom objects registered again).
RELOAD_SERVER = r"""
import importlib.util, json, sys, traceback
import numpy as np
import keras

def reload(program_path, saved, out_path):
    keras.backend.clear_session()
    spec = importlib.util.spec_from_file_location("program", program_path)
    program = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(program)
    predicts = getattr(program, "PREDICT", True)
    if program.SAVE == "keras":
        model = keras.saving.load_model(saved)
    elif predicts:
        x = program.predict_x()
        model = program.build()
        model.predict(keras.tree.map_structure(lambda a: a[:1], x), verbose=0)  # builds it
        model.load_weights(saved)
    else:  # no call (a GAN): its sub-models are built, so it is
        model = program.build()
        model.built = True
        model.load_weights(saved)
    if predicts and not getattr(program, "RANDOM_PREDICT", False):
        out = keras.tree.flatten(model.predict(program.predict_x(), batch_size=25, verbose=0))
    else:
        out = model.get_weights()
    np.savez(out_path, *out)
    assert "keras_multigpu" not in sys.modules, "the reload imported keras_multigpu"
    try:
        devices = len(keras.distribution.list_devices())
    except AttributeError:  # this Keras has no torch distribution library: one device
        devices = 1
    return {"outputs": len(out), "devices": devices}

for line in sys.stdin:
    request = json.loads(line)
    try:
        answer = reload(*request["args"])
    except BaseException:
        answer = {"error": traceback.format_exc()}
    answer["id"] = request["id"]
    print("RELOADED " + json.dumps(answer), flush=True)
"""


class _Reloader:
    """The reload process (`RELOAD_SERVER`), started where pytest runs, before any fork:
    under torch a test runs in forked processes, and its rank 0 asks through the inherited
    pipes. Each answer names its request, so one left unread by a failed test is skipped."""

    def __init__(self):
        self.process = None
        self.asked = 0

    def start(self):
        env = {k: v for k, v in os.environ.items()
               if k not in ("KERAS_MULTIGPU_CPU_DEVICES", "XLA_FLAGS", "PYTHONPATH", "RANK",
                            "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        env["KERAS_BACKEND"] = keras.backend.backend()
        # The Keras that saved the file (a PYTHONPATH entry holding one, as scripts/test.sh
        # lays the next Keras over the environment's), never the library's sources.
        kerases = [path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                   if path and os.path.isfile(os.path.join(path, "keras", "__init__.py"))
                   and not os.path.isdir(os.path.join(path, "keras_multigpu"))]
        if kerases:
            env["PYTHONPATH"] = os.pathsep.join(kerases)
        self.process = subprocess.Popen(
            [sys.executable, "-c", RELOAD_SERVER], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)

    def reload(self, program_path, saved, out, timeout=300):
        if self.process is None or self.process.poll() is not None:
            self.start()  # first use, or after a failure ended it
        self.asked += 1
        ask = f"{os.getpid()}-{self.asked}"
        self.process.stdin.write(json.dumps({"id": ask, "args": [program_path, saved, out]})
                                 + "\n")
        self.process.stdin.flush()
        timer = threading.Timer(timeout, self.process.kill)  # a hung reload fails, not hangs
        timer.start()
        try:
            for line in self.process.stdout:
                if line.startswith("RELOADED "):
                    answer = json.loads(line[len("RELOADED "):])
                    if answer["id"] == ask:
                        return answer
        finally:
            timer.cancel()
        raise AssertionError(f"the reload process ended (exit {self.process.poll()}) "
                             f"before answering for {program_path}")

    def close(self):
        if self.process is not None and self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()


@pytest.fixture(scope="module")
def reloader():
    reloader = _Reloader()
    reloader.start()  # here, in pytest's own process (see _Reloader)
    yield reloader
    reloader.close()


def _reload_elsewhere(name, target, workdir, reloader):
    program = _load(name)
    if program.SAVE is None:  # Keras cannot save it (see the program)
        return None
    path = os.path.join(workdir, "saved.keras" if program.SAVE == "keras" else "saved.weights.h5")
    if program.SAVE == "keras":
        target.save(path)
    else:
        target.save_weights(path)
    if os.environ.get("RANK", "0") != "0":
        return None  # one process per device (torch): the first reloads for all
    out = os.path.join(workdir, "reloaded.npz")
    facts = reloader.reload(os.path.join(PROGRAMS_DIR, f"{name}.py"), path, out)
    assert "error" not in facts, facts.get("error", "")[-3000:]
    assert facts["devices"] == 1  # one CPU device: no virtual devices, no library
    with np.load(out) as saved:
        return [saved[f"arr_{i}"] for i in range(facts["outputs"])]


def _written_for_this_backend(program):
    backends = getattr(program, "BACKENDS", ("jax", "tensorflow", "torch"))
    if keras.backend.backend() not in backends:
        pytest.skip(f"written for the {' and '.join(backends)} backend(s) (its own step uses "
                    "that framework); its counterpart for this backend is another program")


def _amplified(program):
    """Why this program's training amplifies rounding on this backend, or None."""
    reason = getattr(program, "AMPLIFIED", None)
    if isinstance(reason, dict):
        return reason.get(keras.backend.backend())
    return reason


@contextlib.contextmanager
def _floatx(dtype):
    """Layers and data in `dtype`: floatx, and the global dtype policy Keras made from it."""
    previous, policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx(dtype)
    keras.config.set_dtype_policy(dtype)
    try:
        yield
    finally:
        keras.config.set_floatx(previous)
        keras.config.set_dtype_policy(policy)


# CI runs each program written for every engine on one of them, chosen by its measured
# cost (seconds per engine in a profiled scripts/test.sh, 2026-11-26: TensorFlow traces the
# large graphs 2-6 times as long as torch runs them): TensorFlow takes the small programs
# and p19 (an `add_loss` model) and p24 (a base unfrozen after wrapping): defects TensorFlow
# had; JAX the post's MiniGoogLeNet, and six programs each. A program not listed takes its
# index's engine.
ENGINE = {
    "p04_subclass_no_training_arg": "tensorflow", "p07_pydataset_shuffle": "tensorflow",
    "p10_mnist_convnet": "tensorflow", "p12_weather_lstm_grad_accum": "tensorflow",
    "p13_custom_dropout_training_arg": "tensorflow", "p19_ctc_ocr_add_loss": "tensorflow",
    "p03_functional_ticket": "jax", "p06_timeseries_bn_callbacks": "jax",
    "p08_imbalanced_class_weight": "jax", "p14_minigooglenet_post": "jax",
    "p21_imbalanced_auc_metrics": "jax", "p22_lr_schedule_early_stopping": "jax",
    "p05_bilstm_masking": "torch", "p09_transformer_text": "torch",
    "p17_distiller_own_compile": "torch", "p18_census_grn_vsn_dict_inputs": "torch",
    "p20_torch_dataloader_custom_layers": "torch", "p23_augmentation_in_model": "torch",
    "p24_transfer_learning_fine_tune": "tensorflow",
    # p25's RandomZoom cannot be compiled: Keras runs its steps op by op, which on JAX took
    # 144 s (2 devices), on TensorFlow 36 s and on torch 9 s (2026-11-29).
    "p25_vision_transformer": "torch",
    # p26, written for TensorFlow and torch, took 36 s on TensorFlow and 12 s on torch.
    "p26_ddim_ema": "torch",
}


def _with_counts(names, rotate=True):
    """(program, device count) pairs for this engine, or every pair under FULL.

    Each program written for every engine, or listed in `ENGINE`, runs on one of them
    (`rotate`, `ENGINE`), on 2 or 3 devices by its index's parity, so that every engine meets
    both counts and about a third of the programs. Another program written for fewer
    engines, or one not rotated, runs on each of its own at one count, 2 on one engine and 3
    on the next (elsewhere it is skipped). On torch,
    conftest forks `gpus` processes for each."""
    engine = ENGINES.index(keras.backend.backend())
    pairs = []
    for name in names:
        if FULL:
            pairs += [(name, 2), (name, 3)]
            continue
        i = PROGRAMS.index(name)
        own = getattr(_load(name), "BACKENDS", ENGINES)
        if rotate and (len(own) == len(ENGINES) or name in ENGINE):
            if ENGINE.get(name, ENGINES[i % len(ENGINES)]) == ENGINES[engine]:
                pairs.append((name, 2 + i % 2))
        else:
            pairs.append((name, 2 + (i + engine) % 2))
    return pairs


@pytest.mark.parametrize(("name", "gpus"), _with_counts(PROGRAMS))
def test_program_equals_one_device(name, gpus, tmp_path, reloader):
    program = _load(name)
    _written_for_this_backend(program)
    assert program.SOURCE.startswith("https://")
    # A program whose optimizer amplifies rounding (see its docstring and
    # test_amplified_programs_differ_without_padding) is held to a tolerance where rounding
    # cannot reach it: in float64 as written, to 1e-7, on TensorFlow and torch; on JAX (float32
    # only, unless x64 is switched on for the whole process) in float32 under SGD, as is a
    # program whose own step is float32 only (FLOAT64 = False).
    precise = (_amplified(program) and keras.backend.backend() in ("tensorflow", "torch")
               and getattr(program, "FLOAT64", True))
    optimizer = getattr(program, "EXACT_OPTIMIZER", None) if _amplified(program) else None
    with _floatx("float64" if precise else keras.config.floatx()):
        # On torch, Adam turns even float64 rounding of p06's zero bias gradients into full
        # steps, and SGD in float32 still leaves its tolerance: both remedies apply there
        # (float64 and SGD, at the float32 tolerance; see `_close`).
        exact = optimizer if not precise or keras.backend.backend() == "torch" else None
        _program_equals_one_device(name, program, tmp_path, exact, gpus, reloader)


def _program_equals_one_device(name, program, tmp_path, optimizer, gpus, reloader):
    reference = _run(program, None, str(tmp_path / "one"), optimizer=optimizer)
    ref_model, _, initial, _, _ = reference
    if initial is not None:  # the program trained something
        assert any(not np.allclose(a, b) for a, b in zip(initial, ref_model.get_weights()))
    run = _run(program, gpus, str(tmp_path / f"gpus{gpus}"), optimizer=optimizer)
    assert isinstance(run[1], kmg.ParallelModel) and run[1].num_replicas == gpus
    _compare(reference, run, gpus, program)
    model, target = run[0], run[1]
    reloaded = _reload_elsewhere(name, target, str(tmp_path / f"gpus{gpus}"), reloader)
    if reloaded is None:
        return
    expected = (keras.tree.flatten(model.predict(program.predict_x(), batch_size=25, verbose=0))
                if _predicts(program) and not getattr(program, "RANDOM_PREDICT", False)
                else model.get_weights())
    assert len(reloaded) == len(expected)
    for i, (a, b) in enumerate(zip(expected, reloaded)):
        _close(a, b, f"reloaded output {i}")


WITH_CONTROL = [name for name in PROGRAMS if hasattr(_load(name), "CONTROL")]
# CI runs each control on one engine where its program amplifies rounding, the cheapest
# (seconds in a profiled scripts/test.sh, 2026-11-29: p23's control took 61 s on JAX, 25 on
# TensorFlow and 2 on torch; p06's 6, 13 and 4). Every engine under KERAS_MULTIGPU_TEST_FULL=1.
CONTROL_ENGINE = {"p06_timeseries_bn_callbacks": "torch", "p14_minigooglenet_post": "tensorflow",
                  "p23_augmentation_in_model": "torch", "p25_vision_transformer": "torch"}


def _controls():
    for name, engine in CONTROL_ENGINE.items():  # each one a control, on an engine it amplifies
        reason = getattr(_load(name), "AMPLIFIED", None) if name in WITH_CONTROL else None
        assert reason and (not isinstance(reason, dict) or engine in reason), (name, engine)
    pairs = _with_counts(WITH_CONTROL, rotate=False)
    if FULL:
        return pairs
    return [(name, gpus) for name, gpus in pairs
            if CONTROL_ENGINE.get(name, keras.backend.backend()) == keras.backend.backend()]


@pytest.mark.parametrize(("name", "gpus"), _controls())
def test_amplified_programs_differ_without_padding(name, gpus, tmp_path):
    """The program as written, with no padded batch at all, already leaves the tolerance
    between 1 and `gpus` devices: its optimizer amplifies reduction order, not the padding."""
    program = _load(name)
    _written_for_this_backend(program)
    if not _amplified(program):
        pytest.skip(f"{name} amplifies rounding on another backend only")
    control = program.CONTROL(str(tmp_path))
    rows = len(keras.tree.flatten(control["x"])[0])
    assert rows % control["batch_size"] == 0
    assert control["batch_size"] % 2 == 0 and control["batch_size"] % 3 == 0
    reference = _run(program, None, str(tmp_path / "one"), fit_kwargs=program.CONTROL(""))
    run = _run(program, gpus, str(tmp_path / f"g{gpus}"), fit_kwargs=program.CONTROL(""))
    assert _deviation(reference, run) > 1.0, f"{gpus} devices matched: drop AMPLIFIED"
    # Through the wrapper, with the program's own optimizer: the same logs, all finite.
    assert run[3].keys() == reference[3].keys()
    assert all(np.all(np.isfinite(w)) for w in run[0].get_weights())
