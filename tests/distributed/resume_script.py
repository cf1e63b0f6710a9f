"""A training run that can be killed mid-epoch and resumed by BackupAndRestore.

python resume_script.py OUT_DIR [KILL_AT_STEP]: with AUGMENT_WORKERS=N in the environment,
the training samples get random noise from torch, NumPy and Python in __getitem__,
loaded by N worker processes (0: in the main process); BACKUP_EVERY sets the backup's
save_freq in optimizer steps (default 3). With KILL_AT_STEP, the process with
rank KILL_RANK (default 0) calls os._exit at that optimizer step, once per job: it first
creates the file KILL_MARKER (default OUT_DIR/killed), and no process kills itself once
it exists. (torchrun's TORCHELASTIC_RESTART_COUNT cannot tell: an agent restarted by
another node's failure keeps its count, and the ranks may move between machines.)
Before the kill every process waits for the backups already started (they are written
in the background), so the run resumes from the last backup before the kill however
slow the disk; BACKUP_DELAY_S delays each background write of the killed run, as a
loaded disk would; RESTARTED_RANK_0_LATE_S delays rank 0 of a torchrun restart. Each rank
writes OUT_DIR/result.rank<R>.json.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import sys
import time

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
from hapi import checkpoint as hapi_checkpoint  # noqa: E402
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
    """Ends this process with os._exit(17) at optimizer step ``step``, on rank ``rank``, once per job.

    Every process first waits for the backups already started (``wait_for_saves``, a
    collective, so all take part): which backup the run resumes from then depends on
    the step, not on how fast the background write was. Whether this run kills is
    decided at its start, alike on every process: the marker appears only at the kill.
    """

    def __init__(self, step: int, rank: int, marker: pathlib.Path):
        super().__init__()
        self.step, self.rank, self.marker = step, rank, marker
        self.armed = False

    def on_train_begin(self, logs=None):
        self.armed = not self.marker.exists()

    def on_train_batch_end(self, step, logs=None):
        if self.armed and self.model.step == self.step:
            self.armed = False
            self.model.wait_for_saves()
            if self.params["rank"] == self.rank:
                self.marker.touch()
                os._exit(17)  # no cleanup, no exception: like a kill


def delay_background_writes(seconds: float) -> None:
    """Each checkpoint write sleeps ``seconds`` first, as on a loaded disk."""
    write = hapi_checkpoint.write_file

    def slow_write(*args, **kwargs):
        time.sleep(seconds)
        return write(*args, **kwargs)

    hapi_checkpoint.write_file = slow_write


def run(out: pathlib.Path, kill_at: int | None = None, kill_rank: int = 0) -> dict:
    if os.environ.get("RANK") == "0" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        # The others meet the failed attempt's store publication first, as when rank 0 restarts late.
        time.sleep(float(os.environ.get("RESTARTED_RANK_0_LATE_S", "0")))
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
        if float(os.environ.get("BACKUP_DELAY_S", "0")) > 0:
            delay_background_writes(float(os.environ["BACKUP_DELAY_S"]))
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
