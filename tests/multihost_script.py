"""One process of a multi-host JAX run (`test_multihost_jax.py`), or the whole run.

Run as `python multihost_script.py OUT_DIR`, with the launcher's variables set
(WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT, LOCAL_RANK, LOCAL_WORLD_SIZE) and
KERAS_MULTIGPU_CPU_DEVICES for this process's devices. It trains a small
model with BatchNormalization and Dropout on batches that do not divide by
the device count, and writes everything a comparison needs to
`OUT_DIR/rank<RANK>.npz`: with one process, for every device (`all`) and for
one device (`one`); with several, for every device of every process.
"""

import json
import os
import random
import sys

import numpy as np

os.environ.setdefault("KERAS_BACKEND", "jax")
# Each process draws differently until it joins the others, which gives it process 0's
# random state: the draws after the import must agree.
random.seed(int(os.environ.get("RANK", "0")))
np.random.seed(int(os.environ.get("RANK", "0")))

import keras  # noqa: E402
from keras.src.saving import saving_lib  # noqa: E402

import keras_multigpu as kmg  # noqa: E402  (before anything starts JAX: it joins the others)

ROWS, BATCH, EPOCHS = 99, 25, 2
DRAWS = [random.random(), float(np.random.random())]

data = np.random.RandomState(0)
x = data.normal(size=(ROWS, 6)).astype("float32")
y = data.randint(0, 3, size=ROWS)
val_x = data.normal(size=(21, 6)).astype("float32")
val_y = data.randint(0, 3, size=21)
test_x = data.normal(size=(37, 6)).astype("float32")

# Which process writes the .keras file: each counts its own writes.
writes = []
_write = saving_lib.save_model
saving_lib.save_model = lambda *args, **kwargs: (writes.append(1), _write(*args, **kwargs))[1]


def run(gpus, out):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.BatchNormalization(),
        keras.layers.Dropout(0.3),
        keras.layers.Dense(3, activation="softmax"),
    ])
    parallel = kmg.multi_gpu_model(model, gpus=gpus)
    parallel.compile(optimizer=keras.optimizers.Adam(0.01),
                     loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    watch = kmg.callbacks.DeviceMonitor(f"{out}-monitor")
    history = parallel.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=True, verbose=0,
                           validation_data=(val_x, val_y), callbacks=[watch])
    predictions = parallel.predict(test_x, batch_size=10, verbose=0)
    evaluation = parallel.evaluate(val_x, val_y, batch_size=10, verbose=0, return_dict=True)
    path = os.path.join(out, "model.keras")
    parallel.save(path)
    loaded = keras.models.load_model(path)  # every process: written by the time save returns
    # Keras's own function, straight on the template: process 0 alone writes it too.
    keras.saving.save_model(model, os.path.join(out, "direct.keras"))
    return {
        "weights": [np.asarray(w) for w in model.get_weights()],
        "loaded": [np.asarray(w) for w in loaded.get_weights()],
        "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
        "predictions": np.asarray(predictions),
        "evaluation": {k: float(v) for k, v in evaluation.items()},
        "replicas": parallel.num_replicas,
        "processes": kmg.backends.current().process_count(),
        "rank": kmg.backends.current().process_index(),
        "monitor": watch.ranks,
    }


def flatten(name, result):
    arrays = {f"{name}/weight{i}": w for i, w in enumerate(result["weights"])}
    arrays.update({f"{name}/loaded{i}": w for i, w in enumerate(result["loaded"])})
    arrays[f"{name}/predictions"] = result["predictions"]
    meta = {k: result[k] for k in ("history", "evaluation", "replicas", "processes", "rank",
                                   "monitor")}
    arrays[f"{name}/meta"] = np.array(json.dumps(meta))
    return arrays


def main(out):
    rank = int(os.environ.get("RANK", "0"))
    runs = {"all": None} if int(os.environ.get("WORLD_SIZE", "1")) > 1 else {"all": None,
                                                                              "one": 1}
    arrays = {}
    for name, gpus in runs.items():
        arrays.update(flatten(name, run(gpus, os.path.join(out, f"{name}-{rank}"
                                                           if len(runs) > 1 else name))))
    arrays["writes"] = np.array(len(writes))
    arrays["draws"] = np.array(DRAWS)
    if len(runs) == 1:  # several processes: a choice of devices that leaves one idle
        try:
            kmg.multi_gpu_model(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]),
                                gpus=2)
            arrays["idle"] = np.array("accepted")
        except ValueError as error:
            arrays["idle"] = np.array(str(error))
    np.savez(os.path.join(out, f"rank{rank}.npz"), **arrays)


if __name__ == "__main__":
    main(sys.argv[1])
