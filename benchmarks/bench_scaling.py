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

    python benchmarks/bench_scaling.py [--repeats 7] [--samples 12800] [--plain] [--profile]

``--plain`` also times, in the same servers, a hand-written loop (whole batches by
index) on one process, the same loop under DDP with Gloo on two, and two copies of it
that never communicate: what the hardware gives two processes that never wait for each
other, the ceiling for any synchronous data-parallel training here.

``--profile`` (implies ``--plain``) adds the hand-written loop under DDP with torch-hapi's
shared-memory gradient average on two processes, and a second table with both ranks'
time split: waiting for the other process inside the average, the average's own copy
and sum, and the rest (the loop itself). For the two loops that never communicate it
also prices synchronisation from their own step times: how much longer their epochs
would have taken had every step waited for the slower of the two (the sum over steps of
the slower rank's step against each rank's own sum).
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
SHARED = "hand-written loop, shared-memory average"  # DDP with torch-hapi's hook, no Model


class HookClock:
    """Seconds this process spent in the shared-memory average since the last reset: waiting
    for the other processes, and in all (copy, wait, sum)."""

    wait = 0.0
    total = 0.0

    @classmethod
    def install(cls) -> None:
        from hapi.distributed import shared_memory

        averager = shared_memory.SharedMemoryAllReduce
        wait_for_everyone, average = averager._wait_for_everyone, averager.average

        def timed_wait(self) -> None:
            started = time.perf_counter()
            wait_for_everyone(self)
            cls.wait += time.perf_counter() - started

        def timed_average(self, gradients):
            started = time.perf_counter()
            averaged = average(self, gradients)
            cls.total += time.perf_counter() - started
            return averaged

        averager._wait_for_everyone, averager.average = timed_wait, timed_average

    @classmethod
    def read_and_reset(cls) -> dict[str, float]:
        figures = {"wait": cls.wait, "average": cls.total - cls.wait}
        cls.wait = cls.total = 0.0
        return figures


def serve(samples: int, plain: bool, profile: bool) -> None:
    """Build every contender, warm each up for a whole epoch, then train one epoch per
    ``epoch NAME`` line on stdin (rank 0 reads it and tells the others), printing its seconds."""
    sys.path.insert(0, HERE)
    import torch.distributed as dist
    from common import BATCH, lenet_and_adam, real_train_data
    from torch import nn

    from hapi import Model

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if profile:
        HookClock.install()
    data = real_train_data(samples)
    network, optimizer = lenet_and_adam()
    model = Model(network)  # joins the process group under torchrun
    model.prepare(optimizer, nn.CrossEntropyLoss())
    epochs: dict[str, Callable[[], None]] = {
        HAPI: lambda: model.fit(data, batch_size=BATCH, epochs=1, verbose=0)
    }
    step_seconds: list[float] = []  # the hand-written loops' steps, this epoch
    if plain:
        epochs[HAND] = hand_written_epoch(data, BATCH, world, rank, "gloo", step_seconds)
        if world > 1:
            epochs[APART] = hand_written_epoch(data, BATCH, world, rank, None, step_seconds)
        if world > 1 and profile:
            epochs[SHARED] = hand_written_epoch(data, BATCH, world, rank, "shared", step_seconds)
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
        step_seconds.clear()
        HookClock.read_and_reset()
        started = time.perf_counter()
        epochs[name]()
        mine = {"seconds": time.perf_counter() - started, **HookClock.read_and_reset()}
        mine["steps"] = list(step_seconds)
        ranks = [mine]
        if world > 1:  # after the clock stopped: every rank's figures to rank 0
            ranks = [None] * world
            dist.all_gather_object(ranks, mine)
        report({"seconds": mine["seconds"], "ranks": ranks}, rank)


def hand_written_epoch(
    data, batch: int, world: int, rank: int, averaging: str | None, step_seconds: list[float]
) -> Callable[[], None]:
    """The loop a user writes by hand: this rank's shard, whole batches by index, DDP on
    several processes with ``averaging`` "gloo" (DDP's own all-reduce) or "shared"
    (torch-hapi's shared-memory hook), or each process on its own (``None``). Each step's
    seconds are appended to ``step_seconds`` (two clock reads a step)."""
    import torch
    import torch.distributed as dist
    from common import index_batch, lenet_and_adam
    from torch import nn
    from torch.utils.data import DistributedSampler

    network, optimizer = lenet_and_adam()
    if averaging == "gloo" and world > 1:
        network = nn.parallel.DistributedDataParallel(network)
    elif averaging == "shared" and world > 1:
        from hapi.distributed import ddp

        network = ddp.wrap(network, torch.device("cpu"))
        if not type(network).__name__ == "DistributedDataParallel":
            raise SystemExit("torch-hapi did not wrap the network in DDP")
    sampler = DistributedSampler(data, num_replicas=world, rank=rank)
    loss_fn = nn.CrossEntropyLoss()

    def epoch() -> None:
        order = torch.tensor(list(sampler))
        clock = time.perf_counter
        for start in range(0, len(order), batch):
            began = clock()
            inputs, labels = index_batch(data, order[start : start + batch])
            loss = loss_fn(network(inputs), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step_seconds.append(clock() - began)
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

    def __init__(self, nproc: int, threads: int, samples: int, plain: bool, profile: bool) -> None:
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
        self.command += ["--profile"] if profile else []
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

    def epoch(self, contender: str) -> dict:
        """One epoch of ``contender``: its seconds, and each rank's (``ranks``: seconds, waiting
        and averaging seconds in the shared-memory average, the hand loops' step seconds)."""
        self.process.stdin.write(f"epoch {contender}\n")
        self.process.stdin.flush()
        return self._answer()

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
    parser.add_argument(
        "--profile",
        action="store_true",
        help="(with --plain) split both ranks' time: waiting, averaging, the rest",
    )
    args = parser.parse_args()
    args.plain = args.plain or args.profile
    if args.serve:
        return serve(args.samples, args.plain, args.profile)
    cores = os.cpu_count() or 1
    setups = [(1, 1), (1, cores), (2, max(1, cores // 2))]  # (processes, threads each)
    options = (args.samples, args.plain, args.profile)
    servers = {setup: Server(*setup, *options) for setup in setups}
    for server in servers.values():  # they load and warm up at the same time: wait for all
        server.ready()
    contenders = [(HAPI, setup) for setup in setups]
    if args.plain:
        contenders += [(HAND, (1, 1)), (HAND, setups[2]), (APART, setups[2])]
    if args.profile:
        contenders += [(SHARED, setups[2])]
    rates: dict[tuple[str, tuple[int, int]], list[float]] = {key: [] for key in contenders}
    ranks: dict[str, list[list[dict]]] = {}  # 2-process contender -> per round, each rank's figures
    try:
        for _ in range(args.repeats):
            for name, setup in contenders:
                answer = servers[setup].epoch(name)
                rates[(name, setup)].append(args.samples / answer["seconds"])
                if setup[0] > 1:
                    ranks.setdefault(name, []).append(answer["ranks"])
    finally:
        for server in servers.values():
            server.stop()
    print_table(rates, args.samples, cores)
    if args.plain:
        two = setups[2]
        speed_ups = [
            (fit2 / fit1) / (apart / hand1)
            for fit2, fit1, apart, hand1 in zip(
                rates[(HAPI, two)],
                rates[(HAPI, (1, 1))],
                rates[(APART, two)],
                rates[(HAND, (1, 1))],
            )
        ]
        print(
            f"\nModel.fit's speed-up on {two[0]} processes as a share of the no-communication "
            f"ceiling's, per round: median {statistics.median(speed_ups):.3f} "
            f"(rounds {', '.join(f'{share:.2f}' for share in speed_ups)})"
        )
    if args.profile:
        print_profile(ranks)


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


def print_profile(ranks: dict[str, list[list[dict]]]) -> None:
    """Both ranks' epochs split into waiting for the other process inside the gradient average,
    the average's own work (copy, sum, division), and the rest; medians over the rounds. For
    hand loops, the step times, and what waiting every step for the slower rank would cost."""
    print(
        "\n## Where the time of two processes goes (per rank, medians over rounds, seconds)\n\n"
        "| loop | rank | epoch | waiting for the other | averaging | the rest | "
        "median step (ms) | slower-of-two per step vs own steps |\n|---|---|---|---|---|---|---|---|"
    )
    for name, rounds in ranks.items():
        for rank in range(len(rounds[0])):
            mine = [each[rank] for each in rounds]

            def median(key: str) -> float:
                return statistics.median(figures[key] for figures in mine)

            rest = statistics.median(f["seconds"] - f["wait"] - f["average"] for f in mine)
            steps = [step for figures in mine for step in figures["steps"]]
            step = f"{statistics.median(steps) * 1000:.2f}" if steps else "-"
            price = "-"
            if steps and all(len({len(r["steps"]) for r in each}) == 1 for each in rounds):
                slower = [  # per round: sum over steps of the slowest rank's step / this rank's sum
                    sum(map(max, *(r["steps"] for r in each))) / sum(each[rank]["steps"])
                    for each in rounds
                ]
                price = f"+{(statistics.median(slower) - 1) * 100:.1f}%"
            print(
                f"| {name} | {rank} | {median('seconds'):.3f} | {median('wait'):.3f} | "
                f"{median('average'):.3f} | {rest:.3f} | {step} | {price} |"
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
