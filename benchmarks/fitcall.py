"""What a whole `fit` call costs: ours against plain Keras, call by call.

A thin front to `keras_multigpu.bench` with the workload of the issue's
independent harness (MiniGoogLeNet, width 0.5, 384 images, fit calls of 2
epochs, 2 virtual devices present): each setup in its own process, one warm-up
`fit`, then `--fit-calls` whole `fit` calls timed, interleaved over rounds.
It prints the bench table (steady epochs and whole calls) and the per-call
ratios next to the steady-epoch ones, so a gap between the two views, which
is what each call pays beyond its epochs, shows at once.

    python benchmarks/fitcall.py --rounds 3 --fit-calls 3
"""

import argparse
import os

from keras_multigpu import bench

SETUPS = ("plain-1", "ours-1", "ours-2", "dataparallel-2")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", choices=("minigooglenet", "dense"), default="minigooglenet")
    parser.add_argument("--width", type=float, default=0.5)
    parser.add_argument("--samples", type=int, default=384)
    parser.add_argument("--batch-per-device", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=1,
                        help="steady epochs timed in the warm-up fit (after its first)")
    parser.add_argument("--fit-calls", type=int, default=3, help="whole fit calls timed")
    parser.add_argument("--fit-epochs", type=int, default=2, help="epochs per timed fit call")
    parser.add_argument("--output", default=os.path.join("runs", "bench-fitcall"))
    args = parser.parse_args()
    spec = bench.spec(model=args.model, width=args.width, samples=args.samples,
                      epochs=args.epochs, batch_per_device=args.batch_per_device,
                      fit_calls=args.fit_calls, fit_epochs=args.fit_epochs)
    setups = [bench.parse(name) for name in args.setups.split(",") if name.strip()]
    results = bench.run(setups, spec, rounds=args.rounds, output=args.output)
    print(bench.format_table(results))
    print()
    for name, steady in results["ratios"].items():
        call = results["fit_call_ratios"].get(name)
        print(f"{name:26} steady epochs {steady:.3f}   whole fit calls "
              f"{'-' if call is None else f'{call:.3f}'}")


if __name__ == "__main__":
    main()
