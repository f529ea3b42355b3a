"""Where array data lives: on every device (resident) or on the host with prefetch.

A thin front to `keras_multigpu.bench`: our setup at 2, 4 and 8 devices, each
twice, with the data forced resident (one copy per device, every batch
gathered there) and forced onto the host (each batch sliced, placed on the
devices split, and the next one prefetched while a step runs). Prints images/s
and the peak host memory of each, so the cost of each copy and the speed of
the host path show side by side.

    python benchmarks/placement.py --rounds 2 --samples 16384
"""

import argparse
import os

from keras_multigpu import bench


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="2,4,8")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", choices=("minigooglenet", "dense"), default="dense")
    parser.add_argument("--width", type=float, default=0.25)
    parser.add_argument("--samples", type=int, default=16384)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-per-device", type=int, default=64)
    parser.add_argument("--output", default=os.path.join("runs", "bench-placement"))
    args = parser.parse_args()
    setups = [bench.parse(f"ours-{n}") for n in args.devices.split(",")]
    table = []
    for placement in ("resident", "host"):
        spec = bench.spec(model=args.model, width=args.width, samples=args.samples,
                          epochs=args.epochs, batch_per_device=args.batch_per_device,
                          fit_calls=0, placement=placement)
        results = bench.run(setups, spec, rounds=args.rounds,
                            output=os.path.join(args.output, placement))
        for setup in setups:
            row = results["table"].get(setup.name)
            if row is None:
                table.append((setup.name, placement, float("nan"), float("nan"), float("nan")))
                continue
            raw = results["raw"][setup.name]
            table.append((setup.name, placement, row["images_per_second"]["median"],
                          row["peak_host_memory_mb"]["max"], raw[0]["data_mb"]))
    print(f"{'setup':8} {'placement':9} {'img/s':>10} {'peak MB':>9} {'data MB':>8}")
    for name, placement, speed, peak, data in table:
        print(f"{name:8} {placement:9} {speed:10.1f} {peak:9.0f} {data:8.0f}")


if __name__ == "__main__":
    main()
