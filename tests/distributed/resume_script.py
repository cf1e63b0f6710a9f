"""A training run that can be killed mid-epoch and resumed by BackupAndRestore.

python resume_script.py OUT_DIR [KILL_AT_STEP]: with AUGMENT_WORKERS=N in the environment,
the training samples get random noise from torch, NumPy and Python in __getitem__,
loaded by N worker processes (0: in the main process); BACKUP_EVERY sets the backup's
save_freq in optimizer steps (default 3). With KILL_AT_STEP, the process with
rank KILL_RANK (default 0) calls os._exit at that optimizer step, once per job: it first
creates the file KILL_MARKER (default OUT_DIR/killed), and no process kills itself once
it exists. (torchrun's TORCHELASTIC_RESTART_COUNT cannot tell: an agent restarted by
another node's failure keeps its count, and the ranks may move between machines.)
Each rank writes OUT_DIR/result.rank<R>.json.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import sys

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))

from conftest import make_tiny_data  # noqa: E402

from callbacks import (  # noqa: E402
    BackupAndRestore,
    Callback,
    CSVLogger,
    EarlyStopping,
    LRScheduler,
    ModelCheckpoint,
)
from hapi import Model  # noqa: E402
from hapi.metrics import Accuracy  # noqa: E402


class DropoutNet(nn.Module):
    """Dropout makes the result depend on the RNG state, which a resume must restore."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3))

    def forward(self, x):
        return self.body(x)


class NoisySamples(torch.utils.data.Dataset):
    """Augmentation drawing from all three global generators, as transforms do."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        noise = 0.1 * torch.randn(4) + float(np.random.normal(0, 0.1)) + random.uniform(-0.1, 0.1)
        return self.x[index] + noise, self.y[index]


class KillAt(Callback):
    def __init__(self, step: int, rank: int, marker: pathlib.Path):
        super().__init__()
        self.step, self.rank, self.marker = step, rank, marker

    def on_train_batch_end(self, step, logs=None):
        if (
            self.params["rank"] == self.rank
            and self.model.step == self.step
            and not self.marker.exists()
        ):
            self.marker.touch()
            os._exit(17)  # no cleanup, no exception: like a kill


def run(out: pathlib.Path, kill_at: int | None = None, kill_rank: int = 0) -> dict:
    torch.manual_seed(0)
    model = Model(DropoutNet())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.prepare(optimizer, nn.CrossEntropyLoss(), Accuracy())
    x, y = make_tiny_data(96)
    stopper = EarlyStopping(monitor="val_loss", patience=10, verbose=0)
    checkpoints = ModelCheckpoint(out / "ckpt", monitor="val_acc")
    schedule = LRScheduler(
        torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.7), by_step=True
    )
    callbacks = [
        stopper,
        checkpoints,
        schedule,
        CSVLogger(out / "log.csv"),
        BackupAndRestore(out / "backup", save_freq=int(os.environ.get("BACKUP_EVERY", "3"))),
    ]
    if kill_at is not None:
        marker = pathlib.Path(os.environ.get("KILL_MARKER", out / "killed"))
        callbacks.append(KillAt(kill_at, kill_rank, marker))
    workers = os.environ.get("AUGMENT_WORKERS")
    train = (x, y) if workers is None else NoisySamples(x, y)
    history = model.fit(
        train,
        eval_data=(x[:30], y[:30]),
        batch_size=8,
        epochs=3,
        shuffle=True,
        accumulate_grad_batches=2,
        verbose=0,
        callbacks=callbacks,
        num_workers=int(workers or 0),
    )
    return {
        "weights": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist(),
        "history": history.history,
        "early_stopping": [stopper.best, stopper.wait],
        "checkpoint_best": checkpoints.best,
        "lr": optimizer.param_groups[0]["lr"],
        "step": model.step,
        "backup_left": (out / "backup" / "backup.pt").exists(),
    }


if __name__ == "__main__":
    out_dir = pathlib.Path(sys.argv[1])
    kill = int(sys.argv[2]) if len(sys.argv) > 2 else None
    result = run(out_dir, kill, int(os.environ.get("KILL_RANK", "0")))
    (out_dir / f"result.rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(result))
