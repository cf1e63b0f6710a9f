"""World-size-aware schedules and EarlyStopping's restoration, on one process or several (torchrun).

python schedule_script.py OUT_DIR [BATCH]: each rank writes OUT_DIR/schedule.rank<R>.json with
the learning rate of every optimizer update of a OneCycleLR made by LRScheduler's factory (plain
and under gradient accumulation), and the weights EarlyStopping(restore_best_weights=True) left,
next to the weights of each epoch, under DDP and FSDP, also after a crash and resume under FSDP.
BATCH is the per-process batch (default 4); the test runs one process at twice it.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import torch
from torch import nn
from torch.optim.lr_scheduler import OneCycleLR

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from fsdp_script import Blocks, data, full_weights  # noqa: E402

import hapi  # noqa: E402
from callbacks import BackupAndRestore, Callback, EarlyStopping, LRScheduler  # noqa: E402
from hapi.checkpoint import CheckpointError  # noqa: E402

MAX_LR = 0.5
EPOCHS = 2
SAMPLES = 40  # 5 batches of 4 per process on 2 processes, 5 of 8 on one


class LrPerUpdate(Callback):
    def __init__(self) -> None:
        super().__init__()
        self.lrs: list[float] = []

    def on_before_optimizer_step(self, step, logs=None):
        self.lrs.append(float(self.model.optimizer.param_groups[0]["lr"]))


class Weights(Callback):
    """Every weight at each epoch end, gathered on every process (a collective under FSDP)."""

    def __init__(self) -> None:
        super().__init__()
        self.per_epoch: list[list[float]] = []

    def on_epoch_end(self, epoch, logs=None):
        self.per_epoch.append(full_weights(self.model))


class Interrupted(Exception):
    pass


class InterruptAt(Callback):
    def __init__(self, epoch: int | None, step: int | None = None) -> None:
        super().__init__()
        self.epoch, self.step = epoch, step

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise Interrupted

    def on_train_batch_begin(self, step, logs=None):
        if self.model.step == self.step:
            self.model.wait_for_saves()  # the backup of the step before is on disk
            raise Interrupted


def _model(strategy=None, lr: float = 0.1) -> hapi.Model:
    torch.manual_seed(0)
    model = hapi.Model(Blocks())
    model.prepare(
        torch.optim.SGD(model.parameters(), lr=lr), nn.CrossEntropyLoss(), strategy=strategy
    )
    return model


def one_cycle() -> LRScheduler:
    """The documented OneCycleLR recipe: a factory sized by the fit's number of updates."""
    return LRScheduler(
        lambda optimizer, total: OneCycleLR(optimizer, max_lr=MAX_LR, total_steps=total),
        by_step=True,
    )


def schedule(batch: int, accumulate: int) -> dict:
    model = _model()
    lrs = LrPerUpdate()
    factory = one_cycle()
    model.fit(
        data(SAMPLES),
        batch_size=batch,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        accumulate_grad_batches=accumulate,
        callbacks=[factory, lrs],
    )
    return {
        "lrs": lrs.lrs,
        "final_lr": model.optimizer.param_groups[0]["lr"],
        "total": factory.total,
        "updates": model.step,
        "params_have_accumulation": "accumulate_grad_batches" in lrs.params,
    }


def shrink(batch: int, backup: pathlib.Path, crash_at: int | None = None) -> dict:
    """The documented OneCycleLR recipe with a backup every update: interrupted before update
    ``crash_at`` (on several processes), resumed on however many processes run it."""
    model = _model()
    lrs = LrPerUpdate()
    factory = one_cycle()
    model.fit(
        data(SAMPLES),
        batch_size=batch,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=[
            factory,
            lrs,
            InterruptAt(None, crash_at),
            BackupAndRestore(backup, save_freq=1),
        ],
    )
    return {"lrs": lrs.lrs, "total": factory.total, "updates": model.step}


def refused_on_every_rank(out: pathlib.Path, batch: int) -> str | None:
    """Resume from a copy of the shrink backup whose rank-1 part is crafted: what each raises."""
    if hapi.distributed.rank() == 0:
        state = torch.load(out / "shrink" / "backup.pt", weights_only=True)
        state["fit"]["per_rank"][1]["rng"] = None
        torch.save(state, out / "crafted.pt")
    hapi.distributed.barrier()
    try:
        _model().fit(data(SAMPLES), batch_size=batch, verbose=0, resume_from=out / "crafted.pt")
    except CheckpointError as error:
        return str(error)
    return None


def restore(
    batch: int, strategy, crash_at: int | None = None, backup: pathlib.Path | None = None
) -> dict:
    """Three epochs; mode="max" on the falling training loss makes epoch 0 the best."""
    model = _model(strategy)
    weights = Weights()
    stopper = EarlyStopping(
        monitor="loss", mode="max", patience=10, restore_best_weights=True, verbose=0
    )
    extra = [] if backup is None else [InterruptAt(crash_at), BackupAndRestore(backup)]
    model.fit(
        data(SAMPLES),
        batch_size=batch,
        epochs=3,
        shuffle=False,
        verbose=0,
        callbacks=[weights, stopper, *extra],
    )
    return {
        "per_epoch": weights.per_epoch,
        "best_epoch": stopper.best_epoch,
        "final": full_weights(model),
    }


def run(out: pathlib.Path, batch: int) -> dict:
    results = {
        "schedule": schedule(batch, 1),
        "accumulate": schedule(batch, 2),
        "restore_ddp": restore(batch, None),
    }
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        results["restore_fsdp"] = restore(batch, "fsdp")
        try:
            restore(
                batch, "fsdp", crash_at=2, backup=out / "backup"
            )  # backups after epochs 0 and 1
        except Interrupted:
            pass
        results["resumed_fsdp"] = restore(batch, "fsdp", backup=out / "backup")
        try:  # a backup at update 7 of 10, for the test to resume on one process
            shrink(batch, out / "shrink", crash_at=7)
        except Interrupted:
            pass
        results["shrink_backup"] = str(out / "shrink")
        results["refused"] = refused_on_every_rank(out, batch)
    return results


if __name__ == "__main__":
    out_dir = pathlib.Path(sys.argv[1])
    outcome = run(out_dir, int(sys.argv[2]) if len(sys.argv) > 2 else 4)
    (out_dir / f"schedule.rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(outcome))
