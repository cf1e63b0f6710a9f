"""Scaling: 2 processes under torchrun against 1, at the same per-process batch, in samples/s.

Threads: the cores are shared out so no run oversubscribes the CPU: two processes get
one thread each (torchrun's own default, OMP_NUM_THREADS=1). One process is measured
twice: with one thread (the same share of the machine per process, which is what a
process-count speed-up compares) and with every core (what a single process can get
from intra-op threads). Target on a 2-core machine: >= 1.6x.

    python benchmarks/bench_scaling.py [--repeats 3] [--samples 12800]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(samples: int) -> None:
    sys.path.insert(0, HERE)
    import torch
    from torch import nn

    from common import BATCH, lenet_and_adam, real_train_data
    from hapi import Model

    data = real_train_data(samples)
    network, optimizer = lenet_and_adam()
    model = Model(network)
    model.prepare(optimizer, nn.CrossEntropyLoss())
    model.fit(data, batch_size=BATCH, epochs=1, verbose=0, num_iters=5)  # warm-up
    started = time.perf_counter()
    model.fit(data, batch_size=BATCH, epochs=1, verbose=0)
    seconds = time.perf_counter() - started
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"seconds": seconds, "samples_per_s": len(data) / seconds,
                          "threads": torch.get_num_threads()}))


def run(nproc: int, samples: int, threads: int) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               os.path.abspath(__file__), "--worker", "--samples", str(samples)]
    result = subprocess.run(command, capture_output=True, text=True, check=True,
                            env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    return json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samples", type=int, default=12_800)
    parser.add_argument("--worker", action="store_true")
    args = parser.parse_args()
    if args.worker:
        return worker(args.samples)
    cores = os.cpu_count() or 1
    setups = [(1, 1), (1, cores), (2, max(1, cores // 2))]  # (processes, threads each)
    rates: dict[tuple[int, int], list[float]] = {setup: [] for setup in setups}
    for _ in range(args.repeats):
        for nproc, threads in setups:
            rates[(nproc, threads)].append(run(nproc, args.samples, threads)["samples_per_s"])
    print(f"## Scaling: one epoch of {args.samples} images, batch 64 per process\n")
    print("| processes | threads each | median samples/s | runs | vs 1 process x 1 thread | "
          f"vs 1 process x {cores} threads |\n|---|---|---|---|---|---|")
    one, all_cores = statistics.median(rates[(1, 1)]), statistics.median(rates[(1, cores)])
    for setup in setups:
        median = statistics.median(rates[setup])
        runs = ", ".join(f"{r:.0f}" for r in rates[setup])
        print(f"| {setup[0]} | {setup[1]} | {median:.0f} | {runs} | {median / one:.2f}x | {median / all_cores:.2f}x |")


if __name__ == "__main__":
    main()
