"""Scaling: 2 processes under torchrun against 1, at the same per-process batch, in samples/s.

Every setup runs as a long-lived job that trains one epoch each time it is told to
(a "server"): one process with one thread, one process with every core, and two
processes under torchrun with one thread each. The servers take turns, one epoch at a
time (A, B, C, A, B, C, ...), so all of them are warm and a slow minute of this noisy
machine hits every setup alike; only the one training is busy (the others block on a
read or in Gloo's receive, which sleeps).

Threads: the cores are shared out so no run oversubscribes the CPU: two processes get
one thread each (torchrun's own default, OMP_NUM_THREADS=1). One process is measured
twice: with one thread (the same share of the machine per process, which is what a
process-count speed-up compares) and with every core (what a single process can get
from intra-op threads). Target on a 2-core machine: >= 1.6x.

    python benchmarks/bench_scaling.py [--repeats 7] [--samples 12800] [--plain]

``--plain`` also times, in the same servers, a hand-written loop (whole batches by
index) on one process, the same loop under DDP with Gloo on two, and two copies of it
that never communicate: what the hardware gives two processes that never wait for each
other, the ceiling for any synchronous data-parallel training here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
HAPI = "Model.fit"
HAND = "hand-written loop"  # DDP (Gloo) on two processes
APART = "two hand-written loops, no communication"


def serve(samples: int, plain: bool) -> None:
    """Build every contender, warm each up for a whole epoch, then train one epoch per
    ``epoch NAME`` line on stdin (rank 0 reads it and tells the others), printing its seconds."""
    sys.path.insert(0, HERE)
    import torch
    import torch.distributed as dist
    from common import BATCH, lenet_and_adam, real_train_data
    from torch import nn

    from hapi import Model

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    data = real_train_data(samples)
    network, optimizer = lenet_and_adam()
    model = Model(network)  # joins the process group under torchrun
    model.prepare(optimizer, nn.CrossEntropyLoss())
    epochs: dict[str, Callable[[], None]] = {
        HAPI: lambda: model.fit(data, batch_size=BATCH, epochs=1, verbose=0)
    }
    if plain:
        epochs[HAND] = hand_written_epoch(data, BATCH, world, rank, synchronised=True)
        if world > 1:
            epochs[APART] = hand_written_epoch(data, BATCH, world, rank, synchronised=False)
    for epoch in epochs.values():
        epoch()
    report({"ready": True}, rank)
    while True:
        command = [sys.stdin.readline().split() if rank == 0 else None]
        if world > 1:
            dist.broadcast_object_list(command, src=0)
        if not command[0] or command[0][0] != "epoch":
            return
        name = " ".join(command[0][1:])
        started = time.perf_counter()
        epochs[name]()
        report({"seconds": time.perf_counter() - started, "threads": torch.get_num_threads()}, rank)


def hand_written_epoch(
    data, batch: int, world: int, rank: int, synchronised: bool
) -> Callable[[], None]:
    """The loop a user writes by hand: this rank's shard, whole batches by index, DDP when
    ``synchronised`` and several processes (else each process trains on its own)."""
    import torch
    import torch.distributed as dist
    from common import lenet_and_adam
    from torch import nn
    from torch.utils.data import DistributedSampler

    network, optimizer = lenet_and_adam()
    if synchronised and world > 1:
        network = nn.parallel.DistributedDataParallel(network)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank)
    images, labels, loss_fn = data.images, data.labels, nn.CrossEntropyLoss()

    def epoch() -> None:
        order = torch.tensor(list(sampler))
        for start in range(0, len(order), batch):
            index = order[start : start + batch]
            inputs = images[index].unsqueeze(1).to(torch.float32).div_(255.0)
            loss = loss_fn(network(inputs), labels[index])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        if (
            world > 1
        ):  # the epoch ends when every process is done (DDP's last step is in step already)
            dist.barrier()

    return epoch


def report(figures: dict, rank: int) -> None:
    if rank == 0:
        print(json.dumps(figures), flush=True)


class Server:
    """One setup (processes x threads) as a running job that trains an epoch on request."""

    def __init__(self, nproc: int, threads: int, samples: int, plain: bool) -> None:
        self.nproc, self.threads = nproc, threads
        launcher = (
            [sys.executable]
            if nproc == 1
            else [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={nproc}",
            ]
        )
        self.command = launcher + [os.path.abspath(__file__), "--serve", "--samples", str(samples)]
        self.command += ["--plain"] if plain else []
        env = {
            key: value
            for key, value in os.environ.items()
            if key not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        }
        self.process = subprocess.Popen(
            self.command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**env, "OMP_NUM_THREADS": str(threads)},
        )

    def ready(self) -> None:
        self._answer()

    def epoch(self, contender: str) -> float:
        """Samples per second of one epoch of ``contender``, all processes together."""
        self.process.stdin.write(f"epoch {contender}\n")
        self.process.stdin.flush()
        return self._answer()["seconds"]

    def stop(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)

    def _answer(self) -> dict:
        for line in self.process.stdout:
            if line.startswith("{"):
                return json.loads(line)
        self.process.wait()
        raise SystemExit(
            f"{' '.join(self.command)} failed (exit code {self.process.returncode}):\n"
            f"{self.process.stderr.read()[-4000:]}"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--samples", type=int, default=12_800)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--plain",
        action="store_true",
        help="also time hand-written loops: one process, DDP on two, two uncoupled",
    )
    args = parser.parse_args()
    if args.serve:
        return serve(args.samples, args.plain)
    cores = os.cpu_count() or 1
    setups = [(1, 1), (1, cores), (2, max(1, cores // 2))]  # (processes, threads each)
    servers = {setup: Server(*setup, args.samples, args.plain) for setup in setups}
    for server in servers.values():  # they load and warm up at the same time: wait for all
        server.ready()
    contenders = [(HAPI, setup) for setup in setups]
    if args.plain:
        contenders += [(HAND, (1, 1)), (HAND, setups[2]), (APART, setups[2])]
    rates: dict[tuple[str, tuple[int, int]], list[float]] = {key: [] for key in contenders}
    try:
        for _ in range(args.repeats):
            for name, setup in contenders:
                rates[(name, setup)].append(args.samples / servers[setup].epoch(name))
    finally:
        for server in servers.values():
            server.stop()
    print_table(rates, args.samples, cores)


def print_table(
    rates: dict[tuple[str, tuple[int, int]], list[float]], samples: int, cores: int
) -> None:
    """Medians, and ratios as the median of each round's ratio (the contenders of a round
    ran one after the other, so a slow minute of the machine cancels out of its ratio),
    with the middle half of the rounds' ratios in brackets."""
    print(f"## Scaling: one epoch of {samples} images, batch 64 per process, runs interleaved\n")
    print(
        "| loop | processes | threads each | median samples/s | runs | vs its 1 process x 1 thread | "
        f"vs Model.fit, 1 process x {cores} threads |\n|---|---|---|---|---|---|---|"
    )
    for (name, (nproc, threads)), values in rates.items():
        one = rates[(HAPI if name == HAPI else HAND, (1, 1))]
        all_cores = rates[(HAPI, (1, cores))]
        runs = ", ".join(f"{rate:.0f}" for rate in values)
        loop = f"{name} (DDP, Gloo)" if name == HAND and nproc > 1 else name
        print(
            f"| {loop} | {nproc} | {threads} | {statistics.median(values):.0f} | {runs} | "
            f"{paired_ratio(values, one)} | {paired_ratio(values, all_cores)} |"
        )


def paired_ratio(values: list[float], baseline: list[float]) -> str:
    """The median of the rounds' ratios, with the middle half of them (25th-75th percentile)."""
    ratios = [value / base for value, base in zip(values, baseline)]
    if len(ratios) < 2:
        return f"{ratios[0]:.2f}x"
    low, median, high = statistics.quantiles(ratios, n=4)
    return f"{median:.2f}x ({low:.2f}-{high:.2f})"


if __name__ == "__main__":
    main()
