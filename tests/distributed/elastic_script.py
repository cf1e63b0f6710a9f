"""A job that loses a process: trained on 2, killed mid-epoch, resumed from the backup on 1.

python elastic_script.py OUT_DIR [KILL_AT_STEP]: rank 1 exits (os._exit) at that optimizer
step. Every sample a process loads is logged as "epoch index" to
OUT_DIR/reads.<world size>.rank<R>.txt (written at once: the kill leaves no buffer behind).
"""

from __future__ import annotations

import os
import pathlib
import sys

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))

from conftest import TinyNet, make_tiny_data  # noqa: E402

from callbacks import BackupAndRestore, Callback  # noqa: E402
from hapi import Model  # noqa: E402

SAMPLES, BATCH, BACKUP_EVERY = 48, 4, 2


class LoggedReads(torch.utils.data.Dataset):
    def __init__(self, log: pathlib.Path):
        self.x, self.y = make_tiny_data(SAMPLES)
        self.log, self.epoch = log, 0

    def __len__(self):
        return SAMPLES

    def __getitem__(self, index):
        with open(self.log, "a") as handle:
            handle.write(f"{self.epoch} {index}\n")
        return self.x[index], self.y[index]


class Epochs(Callback):
    def __init__(self, data, kill_at):
        super().__init__()
        self.data, self.kill_at = data, kill_at

    def on_epoch_begin(self, epoch, logs=None):
        self.data.epoch = epoch

    def on_train_batch_end(self, step, logs=None):
        if self.params["rank"] == 1 and self.model.step == self.kill_at:
            os._exit(17)


if __name__ == "__main__":
    out = pathlib.Path(sys.argv[1])
    kill_at = int(sys.argv[2]) if len(sys.argv) > 2 else None
    world, rank = os.environ.get("WORLD_SIZE", "1"), os.environ.get("RANK", "0")
    data = LoggedReads(out / f"reads.{world}.rank{rank}.txt")
    torch.manual_seed(0)
    model = Model(TinyNet())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    model.fit(
        data,
        batch_size=BATCH,
        epochs=3,
        verbose=0,
        callbacks=[Epochs(data, kill_at), BackupAndRestore(out / "backup", save_freq=BACKUP_EVERY)],
    )
