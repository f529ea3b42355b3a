"""Issue 2's overhead figures: ours against plain Keras and keras.distribution.

A thin front to `keras_multigpu.bench` (each setup in its own process,
interleaved over rounds, medians): plain `fit` on one device, ours on one,
`keras.distribution.DataParallel` on two, ours on two. It prints the bench
table and the ratios the core issue states targets for.

    python benchmarks/overhead.py --model minigooglenet --width 0.25 --rounds 3 --epochs 3
"""

import argparse
import os

from keras_multigpu import bench

SETUPS = ("plain-1", "ours-1", "dataparallel-2", "ours-2")
TARGETS = {"ours-1 / plain-1": 0.97, "ours-2 / dataparallel-2": 0.95, "ours-2 / ours-1": None}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", choices=("minigooglenet", "dense"), default="minigooglenet")
    parser.add_argument("--width", type=float, default=0.25)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs per run")
    parser.add_argument("--batch-per-device", type=int, default=64)
    parser.add_argument("--fit-calls", type=int, default=3,
                        help="whole fit calls timed after the warm-up fit (0: none)")
    parser.add_argument("--fit-epochs", type=int, default=1, help="epochs per timed fit call")
    parser.add_argument("--output", default=os.path.join(
        os.path.dirname(__file__), "results", "cpu-2core", "overhead"))
    args = parser.parse_args()
    spec = bench.spec(model=args.model, width=args.width, samples=args.samples,
                      epochs=args.epochs, batch_per_device=args.batch_per_device,
                      fit_calls=args.fit_calls, fit_epochs=args.fit_epochs)
    results = bench.run([bench.parse(name) for name in SETUPS], spec, rounds=args.rounds,
                        output=args.output)
    print(bench.format_table(results))
    print()
    for name, target in TARGETS.items():
        value = results["ratios"].get(name)
        verdict = "" if target is None or value is None else (
            f"  (target >= {target}: {'met' if value >= target else 'NOT met'})")
        print(f"{name:26} {value if value is None else f'{value:.3f}'}{verdict}")
        call = results["fit_call_ratios"].get(name)
        if call is not None:
            print(f"{'':26} {call:.3f} per whole fit call")


if __name__ == "__main__":
    main()
