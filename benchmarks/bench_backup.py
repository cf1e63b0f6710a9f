"""What backups cost: ``BackupAndRestore(save_freq=50)`` against the same fit without backups.

A 25 M-parameter MLP trained with Adam (a checkpoint of ~300 MB: weights and
two moments), batch 64 of random data held in memory, ``--steps`` optimizer
steps; runs interleaved. Three contenders: no backup; the backup as
``BackupAndRestore`` makes it (the state copied to CPU memory, the file
written by a background thread); and the same backup written before training
goes on (``model.save(..., wait=True)``, the blocking way). Also printed: how
long one blocking save of this checkpoint takes. Target: the background
backup costs <= 3% for a checkpoint that takes >= 0.5 s to write.

Two figures per contender. The ratio of whole runs, as the other benchmarks
give it -- but this machine's speed drifts by up to 30% between runs of the
same thing, more than what is measured. And the cost of each backup measured
inside its run: the time the ``BackupAndRestore`` step and the following
``--window`` steps took beyond the run's median step (the write runs during
them), less the same for runs without backups, as a share of the
``save_freq`` steps it covers; one column per backup.

With ``--paired-steps N``, also one run of N steps per contender in which
the blocks of ``save_freq`` steps alternate between beginning with a backup
and not: each backup's cost is its block's extra time over the two blocks
beside it, which the machine's slow drifts hit alike (``--repeats 0``: only
this). The first two backups of a run are reported apart, in seconds, once
per run (the first also allocates the CPU copy later backups reuse).

Run with training on one core (as GPU training leaves the host's cores mostly
free, the writing thread then has one) and on every core (the write's CPU
work then competes with training's: it can only be moved, not hidden).

    python benchmarks/bench_backup.py [--repeats 2] [--steps 220] [--threads 1,2] [--width 4096]
    python benchmarks/bench_backup.py --repeats 0 --paired-steps 900
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
from common import interleave, machine, quiet_stdout, table, wide_mlp
from torch import nn

from callbacks import BackupAndRestore, Callback
from hapi import Model


class BlockingBackup(BackupAndRestore):
    """BackupAndRestore as it was: every process waits while the file is written."""

    def _back_up(self) -> None:
        self.model.save(self.path, resumable=True, sharded=self.model.sharded, wait=True)


class StepTimes(Callback):
    """Wall time of each training step (from one step's end to the next's)."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []
        self._last: float | None = None

    def on_train_batch_end(self, step, logs=None):
        now = time.perf_counter()
        if self._last is not None:
            self.times.append(now - self._last)
        self._last = now


class EveryOtherBackup(BackupAndRestore):
    """Backs up at every second ``save_freq`` point only: the blocks of ``save_freq`` steps
    then alternate, one starting with a backup and one without, inside one run."""

    def __init__(self, *args, blocking: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.blocking = blocking
        self.points = 0

    def _back_up(self) -> None:
        self.points += 1
        if self.points % 2 == 1:
            self.model.save(
                self.path, resumable=True, sharded=self.model.sharded, wait=self.blocking
            )


def paired_blocks(times: list[float], save_freq: int) -> list[float]:
    """The extra time of each block that begins with a backup, against the blocks beside it.

    One entry per backup, in order. The first block holds the first backup and
    has one neighbour (the block after it); every later one is set against the
    mean of the blocks just before and after it, which begin with no backup.
    """
    blocks = [
        sum(times[start : start + save_freq])
        for start in range(save_freq - 1, len(times) - save_freq + 1, save_freq)
    ]
    extra = [blocks[0] / blocks[1] - 1] if len(blocks) > 1 else []
    return extra + [
        blocks[k] / ((blocks[k - 1] + blocks[k + 1]) / 2) - 1 for k in range(2, len(blocks) - 1, 2)
    ]


def network(width: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return wide_mlp(width)


def excess_after_backups(
    times: list[float], save_freq: int, window: int
) -> tuple[list[float], float]:
    """Seconds each backup's window took beyond the median step (one entry per backup); and that median."""
    starts = [s for s in range(save_freq - 1, len(times), save_freq) if s + window <= len(times)]
    inside = {i for s in starts for i in range(s, s + window)}
    median = statistics.median(t for i, t in enumerate(times) if i not in inside)
    return [sum(times[i] - median for i in range(s, s + window)) for s in starts], median


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=220)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--save-freq", type=int, default=50)
    parser.add_argument("--window", type=int, default=15)
    parser.add_argument(
        "--threads",
        type=lambda text: [int(t) for t in text.split(",")],
        default=[1, torch.get_num_threads()],
        help="training threads, one table each (default: 1, then all)",
    )
    parser.add_argument(
        "--paired-steps",
        type=int,
        default=0,
        help="also (or, with --repeats 0, only) one long run per contender in which "
        "blocks of save_freq steps with and without a backup alternate",
    )
    args = parser.parse_args()
    if args.paired_steps:
        paired(args)
        if args.repeats == 0:
            return
    generator = torch.Generator().manual_seed(0)
    samples = 64 * args.steps
    data = (
        torch.randn(samples, 1024, generator=generator),
        torch.randint(0, 10, (samples,), generator=generator),
    )
    backup_dir = tempfile.mkdtemp(prefix="hapi-bench-backup-")

    # One blocking save of the full training state, as a backup writes it.
    model = Model(network(args.width))
    model.prepare(torch.optim.Adam(model.parameters(), lr=1e-4), nn.CrossEntropyLoss())
    model.fit((data[0][:64], data[1][:64]), batch_size=64, verbose=0)  # creates Adam's moments
    writes = []
    for _ in range(3):
        started = time.perf_counter()
        file = model.save(f"{backup_dir}/probe")
        writes.append(time.perf_counter() - started)
    size = os.path.getsize(file)
    parameters = sum(p.numel() for p in model.parameters())
    del model

    background = f"BackupAndRestore(save_freq={args.save_freq}), background write"
    kinds = {
        "no backup": None,
        background: BackupAndRestore,
        "the same, blocking write": BlockingBackup,
    }
    for threads in args.threads:
        torch.set_num_threads(threads)
        excess: dict[str, list[list[float]]] = {name: [] for name in kinds}
        medians: list[float] = []

        def fit(name: str):
            def run():
                model = Model(network(args.width))
                model.prepare(torch.optim.Adam(model.parameters(), lr=1e-4), nn.CrossEntropyLoss())
                steps = StepTimes()
                chosen = kinds[name]
                callbacks = [steps] + (
                    [] if chosen is None else [chosen(backup_dir, save_freq=args.save_freq)]
                )
                with quiet_stdout():
                    model.fit(
                        data, batch_size=64, epochs=1, shuffle=False, verbose=0, callbacks=callbacks
                    )
                extra, median = excess_after_backups(steps.times, args.save_freq, args.window)
                excess[name].append(extra)
                medians.append(median)

            return run

        times = interleave({name: fit(name) for name in kinds}, args.repeats)
        print(
            table(
                times,
                "no backup",
                f"Backups every {args.save_freq} steps, {args.steps} steps of batch 64, "
                f"training on {threads} of {os.cpu_count()} cores (whole runs)",
            )
        )
        print()
        backups = min(len(runs) for runs in excess["no backup"])
        noise = [statistics.median(runs[k] for runs in excess["no backup"]) for k in range(backups)]
        period = args.save_freq * statistics.median(medians)
        print(
            f"Cost of each backup inside its run ({args.window} steps from the backup step, beyond the "
            f"run's median step, less the same steps of runs without backups), as a share of the "
            f"{args.save_freq} steps of {statistics.median(medians):.3f} s it covers. The first "
            "backup of a run also allocates the CPU copy that later ones reuse:\n"
        )
        print("| contender | " + " | ".join(f"backup {k + 1}" for k in range(backups)) + " |")
        print("|---|" + "---|" * backups)
        for name in list(kinds)[1:]:
            cells = []
            for k in range(backups):
                cost = statistics.median(runs[k] for runs in excess[name]) - noise[k]
                cells.append(f"{cost:.2f} s, {cost / period:.1%}")
            print(f"| {name} | " + " | ".join(cells) + " |")
        print()
    print(
        f"checkpoint: {parameters / 1e6:.1f} M parameters, {size / 2**20:.0f} MiB; one blocking save: "
        f"median {statistics.median(writes):.2f} s ({', '.join(f'{w:.2f}' for w in writes)})"
    )
    print(f"machine: {machine()}")


def paired(args: argparse.Namespace) -> None:
    """The cost of a backup as the extra time of the save_freq steps it begins, against the
    blocks just before and after it that begin with none: slow drifts of the machine's
    speed hit both alike, which whole runs minutes apart do not.

    The first backup of a run costs more than the others: it allocates the CPU copy
    that later backups reuse. The first two are printed apart, in seconds, once per
    run; from the third on, each is the cost per ``save_freq`` steps of a long run.
    """
    generator = torch.Generator().manual_seed(1)
    samples = 64 * args.paired_steps
    data = (
        torch.randn(samples, 1024, generator=generator),
        torch.randint(0, 10, (samples,), generator=generator),
    )
    backup_dir = tempfile.mkdtemp(prefix="hapi-bench-paired-")
    print(
        f"## One run of {args.paired_steps} steps per contender: blocks of {args.save_freq} steps that begin "
        "with a backup against their neighbours that do not\n"
    )
    print(
        f"| training on | contender | each backup from the third on: extra time of its {args.save_freq} steps "
        "(median; each) | first and second backup, once per run |\n|---|---|---|---|"
    )
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name, blocking in (("background write", False), ("blocking write", True)):
            model = Model(network(args.width))
            model.prepare(torch.optim.Adam(model.parameters(), lr=1e-4), nn.CrossEntropyLoss())
            steps = StepTimes()
            backups = EveryOtherBackup(backup_dir, save_freq=args.save_freq, blocking=blocking)
            with quiet_stdout():
                model.fit(
                    data,
                    batch_size=64,
                    epochs=1,
                    shuffle=False,
                    verbose=0,
                    callbacks=[steps, backups],
                )
            extra = paired_blocks(steps.times, args.save_freq)
            block = args.save_freq * statistics.median(steps.times)
            first = ", ".join(f"{e:+.1%} = {e * block:+.2f} s" for e in extra[:2])
            later = extra[2:]
            steady = (
                f"**{statistics.median(later):+.1%}** ({', '.join(f'{e:+.1%}' for e in later)})"
                if later
                else "(run more steps)"
            )
            print(f"| {threads} of {os.cpu_count()} cores | {name} | {steady} | {first} |")
    print()


if __name__ == "__main__":
    main()
