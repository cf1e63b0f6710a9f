"""Scaling: 2 processes under torchrun against 1, at the same per-process batch, in samples/s.

Threads: the machine's cores are shared out, one process gets them all (2 threads on
2 cores) and two processes get one each (torchrun's OMP_NUM_THREADS=1), so neither
run oversubscribes the CPU. Target on a 2-core machine: >= 1.6x.

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


def run(nproc: int, samples: int) -> dict:
    threads = max(1, (os.cpu_count() or 1) // nproc)
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
    rates: dict[int, list[float]] = {1: [], 2: []}
    threads = {}
    for _ in range(args.repeats):
        for nproc in (1, 2):
            result = run(nproc, args.samples)
            rates[nproc].append(result["samples_per_s"])
            threads[nproc] = result["threads"]
    one = statistics.median(rates[1])
    print(f"## Scaling: one epoch of {args.samples} images, batch 64 per process\n")
    print("| processes | threads each | median samples/s | runs | speed-up |\n|---|---|---|---|---|")
    for nproc in (1, 2):
        runs = ", ".join(f"{r:.0f}" for r in rates[nproc])
        print(f"| {nproc} | {threads[nproc]} | {statistics.median(rates[nproc]):.0f} | {runs} | "
              f"{statistics.median(rates[nproc]) / one:.2f}x |")


if __name__ == "__main__":
    main()
