"""Scaling: 2 processes under torchrun against 1, at the same per-process batch, in samples/s.

Threads: the cores are shared out so no run oversubscribes the CPU: two processes get
one thread each (torchrun's own default, OMP_NUM_THREADS=1). One process is measured
twice: with one thread (the same share of the machine per process, which is what a
process-count speed-up compares) and with every core (what a single process can get
from intra-op threads). Target on a 2-core machine: >= 1.6x.

    python benchmarks/bench_scaling.py [--repeats 3] [--samples 12800] [--plain]

``--plain`` also times a hand-written DDP loop (whole batches by index, Gloo) the
same three ways, to tell torch-hapi's cost from DDP's.
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


def worker(samples: int, contender: str) -> None:
    sys.path.insert(0, HERE)
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DistributedSampler

    from common import BATCH, lenet_and_adam, real_train_data
    from hapi import Model

    data = real_train_data(samples)
    network, optimizer = lenet_and_adam()
    if contender == "hapi":
        model = Model(network)
        model.prepare(optimizer, nn.CrossEntropyLoss())
        epoch = lambda: model.fit(data, batch_size=BATCH, epochs=1, verbose=0)
        epoch()  # warm-up: a whole epoch, as for the hand-written loop
    else:  # the hand-written DDP loop a user would write, for comparison
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1:
            dist.init_process_group("gloo")
            network = nn.parallel.DistributedDataParallel(network)
        sampler = DistributedSampler(data, num_replicas=world, rank=int(os.environ.get("RANK", "0")))
        images, labels = data.images, data.labels
        loss_fn = nn.CrossEntropyLoss()

        def epoch():
            order = torch.tensor(list(sampler))
            for start in range(0, len(order), BATCH):  # whole batches by index, as hapi does
                index = order[start:start + BATCH]
                batch = images[index].unsqueeze(1).to(torch.float32).div_(255.0)
                loss = loss_fn(network(batch), labels[index])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
        epoch()  # warm-up
    started = time.perf_counter()
    epoch()
    seconds = time.perf_counter() - started
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"seconds": seconds, "samples_per_s": len(data) / seconds,
                          "threads": torch.get_num_threads()}))


def run(nproc: int, samples: int, threads: int, contender: str = "hapi") -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               os.path.abspath(__file__), "--worker", contender, "--samples", str(samples)]
    result = subprocess.run(command, capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samples", type=int, default=12_800)
    parser.add_argument("--worker", choices=["hapi", "plain"])
    parser.add_argument("--plain", action="store_true",
                        help="also time a hand-written DDP loop the same ways")
    args = parser.parse_args()
    if args.worker:
        return worker(args.samples, args.worker)
    cores = os.cpu_count() or 1
    setups = [(1, 1), (1, cores), (2, max(1, cores // 2))]  # (processes, threads each)
    contenders = ["hapi", "plain"] if args.plain else ["hapi"]
    rates: dict[tuple[str, int, int], list[float]] = {
        (who, *setup): [] for who in contenders for setup in setups}
    for _ in range(args.repeats):
        for who, nproc, threads in rates:
            rates[(who, nproc, threads)].append(run(nproc, args.samples, threads, who)["samples_per_s"])
    print(f"## Scaling: one epoch of {args.samples} images, batch 64 per process\n")
    print("| loop | processes | threads each | median samples/s | runs | vs 1 process x 1 thread | "
          f"vs 1 process x {cores} threads |\n|---|---|---|---|---|---|---|")
    for who, nproc, threads in rates:
        one = statistics.median(rates[(who, 1, 1)])
        all_cores = statistics.median(rates[(who, 1, cores)])
        median = statistics.median(rates[(who, nproc, threads)])
        runs = ", ".join(f"{r:.0f}" for r in rates[(who, nproc, threads)])
        name = "Model.fit" if who == "hapi" else "hand-written DDP"
        print(f"| {name} | {nproc} | {threads} | {median:.0f} | {runs} | {median / one:.2f}x | "
              f"{median / all_cores:.2f}x |")

if __name__ == "__main__":
    main()
