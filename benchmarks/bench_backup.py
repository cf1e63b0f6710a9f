"""What backups cost: ``BackupAndRestore(save_freq=50)`` against the same fit without backups.

A 25 M-parameter MLP trained with Adam (a checkpoint of ~300 MB: weights and
two moments), batch 64 of random data held in memory, ``--steps`` optimizer
steps; interleaved runs, medians. Three contenders: no backup; the backup as
``BackupAndRestore`` makes it (the state copied to CPU memory, the file
written by a background thread); and the same backup written before training
goes on (``model.save(..., wait=True)``, the blocking way). Also printed: how
long one blocking save of this checkpoint takes. Target: the background
backup costs <= 3% for a checkpoint that takes >= 0.5 s to write.

Run twice: training on one core (as GPU training leaves the host's cores
mostly free, the writing thread then has one) and on every core (the write's
CPU work then competes with training's; it can only be moved, not hidden).

    python benchmarks/bench_backup.py [--repeats 3] [--steps 120] [--threads 1,2] [--width 4096]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
from torch import nn

from callbacks import BackupAndRestore
from common import interleave, machine, quiet_stdout, table
from hapi import Model


class BlockingBackup(BackupAndRestore):
    """BackupAndRestore as it was: every process waits while the file is written."""

    def _back_up(self) -> None:
        self.model.save(self.path, resumable=True, sharded=self.model.sharded, wait=True)


def network(width: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(1024, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 1024), nn.ReLU(), nn.Linear(1024, 10))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--save-freq", type=int, default=50)
    parser.add_argument("--threads", type=lambda text: [int(t) for t in text.split(",")],
                        default=[1, torch.get_num_threads()],
                        help="training threads, one table each (default: 1, then all)")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    samples = 64 * args.steps
    data = (torch.randn(samples, 1024, generator=generator), torch.randint(0, 10, (samples,), generator=generator))
    backup_dir = tempfile.mkdtemp(prefix="hapi-bench-backup-")

    def fit(callback_class=None):
        def run():
            model = Model(network(args.width))
            model.prepare(torch.optim.Adam(model.parameters(), lr=1e-4), nn.CrossEntropyLoss())
            callbacks = [] if callback_class is None else [callback_class(backup_dir, save_freq=args.save_freq)]
            with quiet_stdout():
                model.fit(data, batch_size=64, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
        return run

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

    for threads in args.threads:
        torch.set_num_threads(threads)
        times = interleave({"no backup": fit(),
                            f"BackupAndRestore(save_freq={args.save_freq}), background write": fit(BackupAndRestore),
                            "the same, blocking write": fit(BlockingBackup)}, args.repeats)
        print(table(times, "no backup", f"Backups every {args.save_freq} steps, {args.steps} steps of batch 64, "
                                        f"training on {threads} of {os.cpu_count()} cores"))
        print()
    print(f"checkpoint: {parameters / 1e6:.1f} M parameters, {size / 2**20:.0f} MiB; one blocking save: "
          f"median {statistics.median(writes):.2f} s ({', '.join(f'{w:.2f}' for w in writes)})")
    print(f"machine: {machine()}")


if __name__ == "__main__":
    main()
