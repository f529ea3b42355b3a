"""The process rules (`keras_multigpu.processes`), once, over a store of files.

Every engine hands the same module its own key-value store; here two real processes
share a folder as their store (a `Store` of a dozen lines), so the rules are tested
without any engine's collectives: process 0's random state, the exchange and its
deadline, the stop agreement, and saves written by process 0 alone, a direct
`keras.saving.save_model` among them. The engines' own stores are exercised by
`test_multihost_jax.py`, `test_multihost_tf.py` and the torch launcher's tests.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

PROGRAM = """
import json, os, random, sys, time, warnings

import numpy as np

rank, folder = int(sys.argv[1]), sys.argv[2]
random.seed(rank)  # each process seeds otherwise: it takes process 0's state on joining
np.random.seed(rank)

import keras
from keras.src.saving import saving_lib

from keras_multigpu import inputs, interrupt, processes


class FolderStore(processes.Store):
    def __init__(self, rank, count, path):
        self.rank, self.count, self.path = rank, count, path

    def _file(self, key):
        return os.path.join(self.path, key.replace("/", "%"))

    def set(self, key, value):
        with open(self._file(key) + f".{self.rank}.tmp", "w") as f:
            f.write(value)
        os.replace(self._file(key) + f".{self.rank}.tmp", self._file(key))

    def get(self, key, timeout):
        deadline = time.monotonic() + timeout
        while not os.path.exists(self._file(key)):
            if time.monotonic() > deadline:
                raise TimeoutError(key)
            time.sleep(0.01)
        with open(self._file(key)) as f:
            return f.read()

    def delete(self, key):
        os.remove(self._file(key))


store = os.path.join(folder, "store")
os.makedirs(store, exist_ok=True)
writes = []
save_model = saving_lib.save_model
saving_lib.save_model = lambda *a, **k: (writes.append(a[1]), save_model(*a, **k))[1]

processes.join(FolderStore(rank, 2, store))
result = {"draws": [random.random(), float(np.random.random())]}
result["gathered"] = processes.all_gather_object({"rank": rank, "big": "x" * (3 << 20)})
result["gathered"] = [g["rank"] for g in result["gathered"] if len(g["big"]) == 3 << 20]
# Ctrl-C on process 1 only: both are told to stop; then neither.
result["stop"] = [interrupt._STATE.agree(rank == 1), interrupt._STATE.agree(False)]


def told(check, *args):  # the check's error, else its warning (process 0's), else "same"
    try:
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            check(*args)
    except ValueError as error:
        return str(error)
    said = [str(w.message) for w in warned if "processes" in str(w.message)]
    return "warned: " + said[0] if said else "same"


def model(units):
    return keras.Sequential([keras.Input((2,)), keras.layers.Dense(units)]).variables


def padded(x):
    return inputs.as_padded(x, x[:, :1], batch_size=4, replicas=1, tag=lambda b, r, n: b)


whole = np.arange(40.0, dtype="float32").reshape(20, 2)
result["models"] = [told(processes.check_same_model, model(3)),
                    told(processes.check_same_model, model(3 + rank))]
result["data"] = [told(padded, whole), told(padded, whole[rank::2]),
                  told(padded, whole[:10 + 2 * rank]),
                  told(padded, whole.astype("float64" if rank else "float32")),
                  told(lambda x: inputs.as_padded(x, batch_size=4 + rank, replicas=1,
                                                  tag=lambda b, r, n: b), whole),
                  told(lambda x: inputs.as_padded(x, batch_size=4, replicas=1,
                                                  tag=lambda b, r, n: b),
                       (batch for batch in [(whole[:4],)] * 5) if rank else whole)]
model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
keras.saving.save_model(model, os.path.join(folder, "direct.keras"))
model.save(os.path.join(folder, "model.keras"))
try:  # Keras's `overwrite` by position: refused on every process, not Keras's prompt
    keras.saving.save_model(model, os.path.join(folder, "direct.keras"), False)
except Exception as error:
    result["kept"] = f"{type(error).__name__}: {error}"
keras.saving.save_model(model, os.path.join(folder, "unzipped"), True, False)  # Keras's folder
result["read"] = len(keras.saving.load_model(os.path.join(folder, "model.keras")).weights)
try:  # process 0 cannot write (Keras refuses the name): every process hears why
    keras.saving.save_model(model, os.path.join(folder, "lost.txt"))
except Exception as error:
    result["error"] = f"{type(error).__name__}: {error}"
result["writes"] = len(writes)
result["files"] = sorted(f for f in os.listdir(folder)
                         if f not in ("store", "program.py") and not f.startswith("result-"))
with open(os.path.join(folder, f"result-{rank}.json"), "w") as f:
    json.dump(result, f)
# At exit, process 0 (whose store the others read on torch) leaves after every other one.
if rank == 1:
    time.sleep(1)
processes.leave()
if rank == 0:
    print("PROCESS 1 HAD LEFT:", os.path.exists(os.path.join(store, "keras_multigpu%left%1")))
if rank == 0:  # process 1 has left: the next exchange names it, within the timeout
    os.environ["KERAS_MULTIGPU_TIMEOUT"] = "3"  # (the waits above may be slow on a busy machine)
    try:
        processes.exchange("a gather process 1 never reaches", "late")
    except processes.CollectiveError as error:
        print("NAMED:", error)
"""


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    folder = tmp_path_factory.mktemp("processes")
    script = folder / "program.py"
    script.write_text(textwrap.dedent(PROGRAM))
    env = {**os.environ, "KERAS_MULTIGPU_TIMEOUT": "90"}
    started = [subprocess.Popen([sys.executable, str(script), str(rank), str(folder)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for rank in range(2)]
    outputs = []
    try:
        for process in started:
            outputs.append(process.communicate(timeout=120)[0])
    finally:
        for process in started:
            process.kill()
    for process, output in zip(started, outputs):
        assert process.returncode == 0, output[-4000:]
    results = []
    for rank in range(2):
        with open(folder / f"result-{rank}.json") as f:
            results.append(json.load(f))
    return results, outputs


def test_every_process_takes_process_zeros_random_state(ran):
    (first, second), _ = ran
    assert first["draws"] == second["draws"]


def test_a_gather_returns_every_process_value_in_rank_order(ran):
    results, _ = ran
    assert [r["gathered"] for r in results] == [[0, 1], [0, 1]]  # 3 MiB each: in chunks


def test_a_ctrl_c_on_one_process_stops_every_process(ran):
    results, _ = ran
    assert [r["stop"] for r in results] == [[True, False], [True, False]]


def test_processes_with_different_models_are_told_which_variable(ran):
    results, _ = ran
    said = ("The 2 processes hold different models: variable 0 (sequential_1/dense_1/kernel) is "
            "float32 of shape (2, 4) on process 1 and float32 of shape (2, 3) on process 0. "
            "Every process must build the same model")
    for models in (r["models"] for r in results):
        assert models[0] == "same"
        assert models[1].startswith(said), models[1]


def test_processes_given_different_data_are_told_how(ran):
    results, _ = ran
    for data in (r["data"] for r in results):
        assert data[0] == "same"
        assert data[2].startswith("The 2 processes were given different data: 12 rows on "
                                  "process 1 and 10 rows on process 0."), data[2]
        assert data[3].startswith("The 2 processes were given different data: arrays of float64 "
                                  "rows of shape (2,), float64 rows of shape (1,) on process 1 and "
                                  "of float32 rows of shape (2,), float32 rows of shape (1,) on "
                                  "process 0."), data[3]
        assert data[4].startswith("The 2 processes were given different data: batch_size=5 "
                                  "on process 1 and batch_size=4 on process 0."), data[4]
        assert data[5].startswith("The 2 processes were given different data: a stream on "
                                  "process 1 and 20 rows on process 0."), data[5]
    # Only the values differ (a shard per rank of equal size): process 0 warns, and each
    # process goes on with its own data.
    warned, quiet = (r["data"][1] for r in results)
    assert warned.startswith("warned: The 2 processes were given different data: 10 rows on "
                             "every process, with other values on process 1. Each process "
                             "trains on its own devices' share of its own data"), warned
    assert quiet == "same"
    assert [r["data"][:1] + r["data"][2:] for r in results] == [
        results[0]["data"][:1] + results[0]["data"][2:]] * 2


def test_process_zero_alone_writes_a_direct_keras_save(ran):
    (first, second), _ = ran
    assert (first["writes"], second["writes"]) == (3, 0)  # Keras refused the fourth by its name
    assert first["read"] == second["read"] == 2  # each read what process 0 wrote
    assert first["files"] == second["files"] == ["direct.keras", "model.keras", "unzipped"]
    assert first["kept"].startswith("FileExistsError: ") and "overwrite=False" in first["kept"]
    assert second["kept"].endswith(first["kept"]), second["kept"]


def test_process_zeros_failed_save_is_every_process_error(ran):
    (first, second), _ = ran
    assert first["error"].startswith("ValueError: "), first["error"]
    assert second["error"] == ("RuntimeError: Process 0 could not write lost.txt (save number "
                               f"1): {first['error']}")


def test_process_zero_leaves_after_the_others(ran):
    _, (output, _) = ran
    assert "PROCESS 1 HAD LEFT: True" in output, output[-3000:]


def test_a_process_that_does_not_arrive_is_named_within_the_timeout(ran):
    _, (output, _) = ran
    assert ("NAMED: Process 0 of 2 waited 3 s (KERAS_MULTIGPU_TIMEOUT) for process 1 at a "
            "gather process 1 never reaches, and it did not get there") in output, output[-3000:]
