"""The library on a real GPU (issue 26, item 2), in one command.

    python benchmarks/gpu/library.py OUT_DIR [--toy]

Each check runs in its own process, with a time limit, and reports JSON:

- `devices`: `keras-multigpu devices` (NVML's view);
- `equal-jax`, `equal-torch`: `multi_gpu_model(model, gpus=1)` against plain Keras on
  the same device, from the same weights and seed (a small conv net with BatchNorm and
  Dropout, shuffled, 2 epochs): the largest weight and loss differences, and where the
  variables live;
- `launch-nccl`: the same training as a torch process under `keras-multigpu launch -n 1`:
  the process group's backend (NCCL where CUDA is there) and the loss;
- `monitor`: `DeviceMonitor` over a short JAX fit: its timeline's rows, how many carry
  GPM's SM activity, the peak utilisation, its verdict; `monitor.png` is kept.

Writes OUT_DIR/library.json (and monitor.png) and prints the table. Without a GPU
(or with --toy) the same checks run on the CPU, where the GPU-only figures are null.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
LIMIT_S = {"devices": 30, "equal-jax": 75, "equal-torch": 75, "launch-nccl": 75,
           "monitor": 75}
# float32 on one device: the two fits compile separate programs, whose fusions and
# cuDNN/cuBLAS algorithms (TF32 where the framework allows it: a 10-bit mantissa) may
# order sums differently; the tolerance is chosen for that, before any GPU run.
RTOL, ATOL = 1e-3, 1e-4


def _data(n=512):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 16, 16, 3)).astype("float32")
    y = rng.integers(0, 10, n)
    return x, y


def _model():
    import keras

    keras.utils.set_random_seed(1)
    return keras.Sequential([
        keras.Input((16, 16, 3)),
        keras.layers.Conv2D(16, 3, padding="same"),
        keras.layers.BatchNormalization(),
        keras.layers.ReLU(),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dropout(0.2),
        keras.layers.Dense(10),
    ])


def _fit(model, x, y):
    import keras

    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    keras.utils.set_random_seed(7)  # the shuffle and the dropout masks
    history = model.fit(x, y, batch_size=64, epochs=2, shuffle=True, verbose=0)
    return history.history


def _where(model):
    import keras

    value = model.trainable_variables[0].value
    backend = keras.backend.backend()
    if backend == "jax":
        return str(next(iter(value.devices())))
    if backend == "torch":
        return str(value.device)
    return str(getattr(value, "device", "?"))


def child_equal():
    """Plain Keras, then ours, from the same weights: differences after 2 epochs."""
    import numpy as np

    import keras_multigpu

    x, y = _data()
    plain = _model()
    start = [w.copy() for w in plain.get_weights()]
    plain_history = _fit(plain, x, y)
    ours_template = _model()
    ours_template.set_weights(start)
    parallel = keras_multigpu.multi_gpu_model(ours_template, gpus=1)
    ours_history = _fit(parallel, x, y)
    weights = max(float(np.max(np.abs(a - b)))
                  for a, b in zip(plain.get_weights(), ours_template.get_weights()))
    scale = max(float(np.max(np.abs(a))) for a in plain.get_weights())
    losses = [abs(a - b) for a, b in zip(plain_history["loss"], ours_history["loss"])]
    predict = float(np.max(np.abs(plain.predict(x[:100], verbose=0)
                                  - parallel.predict(x[:100], verbose=0))))
    close = all(np.allclose(a, b, rtol=RTOL, atol=ATOL)
                for a, b in zip(plain.get_weights(), ours_template.get_weights()))
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "ours.keras")
        parallel.save(path)
        import keras

        reloaded = keras.saving.load_model(path)
        reload_diff = max(float(np.max(np.abs(a - b)))
                          for a, b in zip(reloaded.get_weights(), ours_template.get_weights()))
    return {"devices": [str(d) for d in parallel.devices], "plain_on": _where(plain),
            "ours_on": _where(ours_template), "loss_plain": plain_history["loss"],
            "loss_ours": ours_history["loss"], "max_loss_diff": max(losses),
            "max_weight_diff": weights, "largest_weight": scale,
            "max_predict_diff": predict, "saved_and_reloaded_diff": reload_diff,
            "rtol": RTOL, "atol": ATOL, "ok": bool(close and reload_diff == 0.0)}


def child_launch():
    """One process of `keras-multigpu launch`: the group's backend and the training."""
    import torch
    import torch.distributed as dist

    import keras_multigpu
    from keras_multigpu.backends import _torch_group
    from keras_multigpu.backends import torch as engine

    x, y = _data()
    parallel = keras_multigpu.multi_gpu_model(_model())
    history = _fit(parallel, x, y)
    # One process needs no collectives, so the engine joins no group; the group it
    # would join (NCCL on a GPU), over the launcher's rendezvous, and one all-reduce:
    joined_by_fit = dist.is_initialized()
    _torch_group._join(generator=(engine.random_state, engine.set_random_state))
    tensor = torch.ones(4, device=_torch_group._device())
    dist.all_reduce(tensor)
    return {"joined_by_fit": joined_by_fit, "process_group": dist.get_backend(),
            "world_size": dist.get_world_size(), "all_reduce_on": str(tensor.device),
            "all_reduce_sum": float(tensor.sum()), "devices": [str(d) for d in parallel.devices],
            "on": _where(parallel.template), "loss": history["loss"],
            "ok": bool(all(v == v for v in history["loss"])
                       and float(tensor.sum()) == 4.0)}


def child_monitor(out):
    import csv

    import keras_multigpu
    import keras_multigpu.callbacks

    x, y = _data(4096)
    folder = tempfile.mkdtemp(prefix="monitor-")
    monitor = keras_multigpu.callbacks.DeviceMonitor(folder, interval=0.1)
    parallel = keras_multigpu.multi_gpu_model(_model(), gpus=1)
    parallel.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    parallel.fit(x, y, batch_size=64, epochs=1, verbose=0)  # compiles
    started = time.time()  # one epoch timed, then about 6 s under the monitor
    parallel.fit(x, y, batch_size=64, epochs=1, verbose=0)
    epoch_s = max(time.time() - started, 1e-3)
    epochs = max(3, min(200, round(6 / epoch_s)))
    parallel.fit(x, y, batch_size=64, epochs=epochs, verbose=0, callbacks=[monitor])
    rows = []
    timeline = os.path.join(folder, "timeline.csv")
    if os.path.exists(timeline):
        with open(timeline) as f:
            rows = list(csv.DictReader(f))

    def numbers(name):
        return [float(r[name]) for r in rows if r.get(name) not in (None, "", "nan")]

    util, sm = numbers("util"), numbers("sm_activity")
    png = os.path.join(folder, "monitor.png")
    if os.path.exists(png):
        import shutil

        shutil.copy(png, os.path.join(out, "monitor.png"))
    return {"files": sorted(os.listdir(folder)), "epochs": epochs, "timeline_rows": len(rows),
            "rows_with_sm_activity": len(sm), "max_util": max(util) if util else None,
            "mean_sm_activity": sum(sm) / len(sm) if sm else None,
            "verdict": monitor.verdict,
            # No GPU (toy): no samples, only the step times.
            "ok": bool(rows) if _on_gpu() else "steps.csv" in os.listdir(folder)}


def _on_gpu():
    from keras_multigpu import devices

    return bool(devices._nvml_gpus())


def _run(name, command, env, out):
    started = time.time()
    try:
        done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True,
                              timeout=LIMIT_S[name])
        code, text = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as error:
        code = f"timed out after {LIMIT_S[name]} s"
        text = (error.stdout or b"").decode(errors="replace") if isinstance(
            error.stdout, bytes) else (error.stdout or "")
    result = None
    for line in text.splitlines():
        if "LIBRARY-RESULT " in line:  # under the launcher: "[rank 0] LIBRARY-RESULT ..."
            result = json.loads(line.split("LIBRARY-RESULT ", 1)[1])
    with open(os.path.join(out, "library-log.txt"), "a") as log:
        log.write(f"==== {name}: {' '.join(command)} (exit {code})\n{text}\n")
    entry = {"exit": code, "seconds": round(time.time() - started, 1)}
    if name == "devices":
        entry.update(output=text.strip()[-2000:], ok=code == 0)
    elif result is None:
        entry.update(ok=False, error=text.strip()[-1500:])
    else:
        entry.update(result)
    return entry


def main(argv):
    if argv and argv[0] == "--child":
        kind, out = argv[1], argv[2]
        found = {"equal": child_equal, "launch": child_launch,
                 "monitor": lambda: child_monitor(out)}[kind]()
        print("LIBRARY-RESULT " + json.dumps(found, default=str), flush=True)
        return 0
    out = argv[0] if argv else os.environ.get("OUT", "runs/gpu-library")
    toy = "--toy" in argv
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.path.join(REPO, "src") + os.pathsep + env.get("PYTHONPATH", "")
    if toy:
        env["CUDA_VISIBLE_DEVICES"] = ""
    me = [sys.executable, os.path.abspath(__file__), "--child"]
    checks = {
        "devices": ([sys.executable, "-m", "keras_multigpu.cli", "devices"], "jax"),
        "equal-jax": (me + ["equal", out], "jax"),
        "equal-torch": (me + ["equal", out], "torch"),
        "launch-nccl": ([sys.executable, "-m", "keras_multigpu.cli", "launch", "-n", "1",
                         os.path.abspath(__file__), "--child", "launch", out], "torch"),
        "monitor": (me + ["monitor", out], "jax"),
    }
    results = {}
    for name, (command, backend) in checks.items():
        results[name] = _run(name, command, dict(env, KERAS_BACKEND=backend), out)
        print(f"[library] {name}: {'ok' if results[name].get('ok') else 'FAILED'} "
              f"({results[name]['seconds']} s)", flush=True)
        with open(os.path.join(out, "library.json"), "w") as f:  # after each: kept if cut
            json.dump({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "checks": results}, f, indent=2, default=str)
    print(json.dumps(results, indent=1, default=str)[-6000:])
    return 0 if all(r.get("ok") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
