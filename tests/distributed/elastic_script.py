"""A job that loses a process: trained on 2, killed mid-epoch, resumed from the backup on 1.

python elastic_script.py OUT_DIR [KILL_AT_STEP]: rank 1 exits (os._exit) at that optimizer
step. Every sample a process loads is logged as "epoch index" to
OUT_DIR/reads.<world size>.rank<R>.txt (written at once: the kill leaves no buffer behind).
"""

from __future__ import annotations

import os
import pathlib
import sys
import time

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


def _saved_step(path: pathlib.Path) -> int:
    try:
        return int(torch.load(path, weights_only=True)["step"])
    except (OSError, RuntimeError, KeyError, EOFError):  # not there yet, or being replaced
        return -1


class Epochs(Callback):
    def __init__(self, data, kill_at, backup):
        super().__init__()
        self.data, self.kill_at, self.backup = data, kill_at, backup

    def on_epoch_begin(self, epoch, logs=None):
        self.data.epoch = epoch

    def on_train_batch_end(self, step, logs=None):
        if self.params["rank"] == 1 and self.model.step == self.kill_at:
            # The moment is after the last backup's write, which rank 0 may still be finishing
            # in the background: wait until the file holds it (a busy machine once lost it).
            backup, deadline = self.backup / "backup.pt", time.monotonic() + 60
            while time.monotonic() < deadline and _saved_step(backup) < self.kill_at - 1:
                time.sleep(0.05)
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
        callbacks=[
            Epochs(data, kill_at, out / "backup"),
            BackupAndRestore(out / "backup", save_freq=BACKUP_EVERY),
        ],
    )
