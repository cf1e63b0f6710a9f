"""Callbacks on several processes: every process runs every hook and sees the same figures;
only the main process prints; one process's ``stop_training`` stops them all.

    torchrun --standalone --nproc_per_node=2 examples/guide_callbacks_ranks.py

Run as one process (``python examples/guide_callbacks_ranks.py``) it trains the same way,
without the stop (that process is rank 0). With ``--output DIR`` each process also writes
what its callbacks saw to ``DIR/rank<R>.json``.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import torch
from torch import nn

import hapi
from callbacks import Callback


class Report(Callback):
    """Records on every process; prints on the main process only."""

    def __init__(self) -> None:
        super().__init__()
        self.batches = 0
        self.epoch_logs: list[dict] = []

    def on_train_begin(self, logs=None):
        if self.is_main:
            print(
                f"{self.params['world_size']} processes, {self.params['steps']} batches "
                f"of {self.params['batch_size']} per process and epoch"
            )

    def on_train_batch_end(self, step, logs=None):
        self.batches += 1

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_logs.append(logs)
        if self.is_main:
            print(f"epoch {epoch}: loss {logs['loss']:.4f}, val_loss {logs['val_loss']:.4f}")


class StopOnRankOne(Callback):
    """Rank 1 alone asks to stop after the second batch of the second epoch."""

    def on_train_batch_end(self, step, logs=None):
        if self.params["rank"] == 1 and self.model.epoch == 1 and step == 1:
            print("rank 1 sets stop_training")
            self.model.stop_training = True


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)

    hapi.seed_everything(0)
    x = torch.randn(64, 4)
    y = x[:, :3].argmax(dim=1)
    model = hapi.Model(nn.Linear(4, 3), device="cpu")
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    report = Report()
    # log_freq=1: the processes agree on stop_training after every batch.
    model.fit(
        (x, y),
        (x, y),
        batch_size=8,
        epochs=5,
        log_freq=1,
        verbose=0,
        callbacks=[report, StopOnRankOne()],
    )
    rank = hapi.distributed.rank()
    seen = {
        "rank": rank,
        "batches": report.batches,
        "steps": model.step,
        "epoch_logs": report.epoch_logs,
    }
    if args.output is not None:
        args.output.mkdir(parents=True, exist_ok=True)
        (args.output / f"rank{rank}.json").write_text(json.dumps(seen))
    if hapi.distributed.is_main():
        print(f"stopped after {report.batches} batches on each process")
    return seen


if __name__ == "__main__":
    main()
