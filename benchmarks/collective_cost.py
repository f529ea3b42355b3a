"""What one torch.distributed all-reduce costs here: gloo, N processes on this machine.

Issue 25 asks, where a throughput target cannot be met on 2 shared CPU cores, for the cost
of one all-reduce of the sizes a step sends: BatchNormalization's buffer (replicas x 3 x
channels floats, one forward and one backward per layer) and the gradients. This times
`torch.distributed.all_reduce` back to back (no compute between calls, so it is the floor,
not what a step pays while its processes drift apart) for each size, as the median of
`--repeats` calls, and prints one row per size: microseconds per call and the cost of the
count a step makes.

    python benchmarks/collective_cost.py    # MiniGoogLeNet at width 0.25, 2 processes
    python benchmarks/collective_cost.py --output benchmarks/results/cpu-2core-epyc/collectives.json

The defaults are MiniGoogLeNet's at width 0.25: 19 BatchNormalization layers of 22.5
channels on average (a 2 x 3 x 22.5 = 135-float buffer, 38 a step) and 105,390 trainable
parameters (one all-reduce a step).

Every process uses one thread (the bench's torch setups share the cores the same way).
"""

import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, world, port, sizes, repeats, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = []
    for size in sizes:
        tensor = torch.ones(size)
        for _ in range(10):  # warm-up
            dist.all_reduce(tensor)
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            times.append(time.perf_counter() - start)
        rows.append({"floats": size, "bytes": 4 * size,
                     "median_us": 1e6 * statistics.median(times),
                     "p90_us": 1e6 * sorted(times)[int(0.9 * len(times))]})
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--sizes", default="135,105390",
                        help="floats per all-reduce, comma-separated")
    parser.add_argument("--per-step", default="38,1",
                        help="how many of each size a step makes, comma-separated")
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--output", default=None, help="a .json file for the rows")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    counts = [int(c) for c in args.per_step.split(",")]
    if len(counts) != len(sizes):
        parser.error(f"--per-step needs one count per size: {len(sizes)} sizes, "
                     f"{len(counts)} counts")
    with socket.socket() as probe:  # a free port for the processes to meet on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.start_processes(_worker, args=(args.world, port, sizes, args.repeats, results),
                       nprocs=args.world, start_method="spawn")
    rows = results.get()
    print(f"gloo all_reduce, {args.world} processes, {os.cpu_count()} cores, median of "
          f"{args.repeats} back-to-back calls:")
    print(f"{'floats':>10}{'bytes':>10}{'median us':>12}{'p90 us':>10}{'per step':>10}"
          f"{'ms a step':>11}")
    for row, count in zip(rows, counts):
        row["per_step"] = count
        row["ms_per_step"] = count * row["median_us"] / 1000
        print(f"{row['floats']:>10}{row['bytes']:>10}{row['median_us']:>12.1f}"
              f"{row['p90_us']:>10.1f}{count:>10}{row['ms_per_step']:>11.2f}")
    print(f"total: {sum(r['ms_per_step'] for r in rows):.2f} ms a step")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"world": args.world, "cores": os.cpu_count(), "repeats": args.repeats,
                       "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
