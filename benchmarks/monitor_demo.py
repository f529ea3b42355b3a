"""DeviceMonitor's verdict on two ways of feeding the same training, from real runs.

The README's monitor figure and verdicts come from here. MiniGoogLeNet on the
CIFAR-10 images at hand, on every device (virtual CPU devices here), trained
twice with a DeviceMonitor:

- `arrays`: the images as arrays, which `multi_gpu_model` keeps on the devices,
  with the random shifts and flips inside the model (on the device);
- `pydataset`: the same images through a `keras.utils.PyDataset` that augments each
  image on the host in PIL (random crop of the padded image, flip, brightness,
  contrast and colour jitter), as torchvision-style loaders do.

Each run's `monitor/` folder (timeline.csv, steps.csv, monitor.png) and its
verdict go to OUTPUT; `summary.json` holds both verdicts.

    python benchmarks/monitor_demo.py --output benchmarks/results/cpu-2core/monitor
"""

import argparse
import os
import platform
import shutil
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("KERAS_MULTIGPU_CPU_DEVICES", "2")  # on a machine without GPUs

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_multigpu as kmg  # noqa: E402
from keras_multigpu import data as data_lib  # noqa: E402
from keras_multigpu import experiment  # noqa: E402
from keras_multigpu._io import write_json  # noqa: E402


class HostAugmented(keras.utils.PyDataset):
    """A torchvision-style CIFAR pipeline on the host, image by image, in PIL: pad by 4 and
    crop back to 32x32 at random, flip half, jitter brightness, contrast and colour."""

    def __init__(self, x, y, batch_size, seed=0):
        super().__init__()
        self.x, self.y, self.batch_size = x.astype("uint8"), y, batch_size
        self.rng = np.random.default_rng(seed)

    def __len__(self):
        return -(-len(self.x) // self.batch_size)

    def __getitem__(self, index):
        rows = slice(index * self.batch_size, (index + 1) * self.batch_size)
        return np.stack([self.augment(image) for image in self.x[rows]]), self.y[rows]

    def augment(self, image):
        from PIL import Image, ImageEnhance, ImageOps

        picture = ImageOps.expand(Image.fromarray(image), border=4)
        left, top = self.rng.integers(0, 9, size=2)
        picture = picture.crop((left, top, left + 32, top + 32))
        if self.rng.random() < 0.5:
            picture = ImageOps.mirror(picture)
        for enhance in (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color):
            picture = enhance(picture).enhance(self.rng.uniform(0.8, 1.2))
        return np.asarray(picture, dtype="float32")


def train(name, args, x, y, mean):
    keras.utils.set_random_seed(1)
    template, _ = experiment.build_models(mean, args.width, augment=name == "arrays", seed=1)
    parallel = kmg.multi_gpu_model(template)
    parallel.compile(optimizer=keras.optimizers.SGD(5e-3, momentum=0.9),
                     loss="categorical_crossentropy", metrics=["accuracy"])
    batch = args.batch_per_device * parallel.num_replicas
    folder = os.path.join(args.output, name)
    shutil.rmtree(folder, ignore_errors=True)
    watch = kmg.callbacks.DeviceMonitor(folder)
    if name == "arrays":
        parallel.fit(x, y, batch_size=batch, epochs=args.epochs, verbose=2, callbacks=[watch])
    else:
        parallel.fit(HostAugmented(x, y, batch), epochs=args.epochs, verbose=2,
                     callbacks=[watch])
    found = watch.verdict
    return {"devices": [str(d) for d in parallel.devices], "global_batch": batch,
            "bound": found["bound"], "input": found["input"], "lines": found["lines"],
            "fixes": found["fixes"],
            "evidence": {k: found["evidence"][k] for k in (
                "steps", "data_ms_per_step", "step_ms_per_step", "data_share",
                "data_measured")}}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="runs/monitor-demo")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--width", type=float, default=0.25)
    parser.add_argument("--limit", type=int, default=2048)
    parser.add_argument("--batch-per-device", type=int, default=64)
    args = parser.parse_args(argv)
    (x, y), _ = data_lib.load_cifar10(None, args.limit, download=False)
    x = x.astype("float32")
    y = keras.utils.to_categorical(y, 10)
    mean = x.mean(axis=0)
    runs = {name: train(name, args, x, y, mean) for name in ("arrays", "pydataset")}
    write_json(os.path.join(args.output, "summary.json"), {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": {"platform": platform.platform(), "cores": os.cpu_count()},
        "images": len(x), "epochs": args.epochs, "width": args.width, "runs": runs})
    for name, run in runs.items():
        print(f"{name}: {run['bound']}-bound; " + " ".join(run["lines"]))


if __name__ == "__main__":
    main()
