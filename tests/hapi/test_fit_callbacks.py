"""The built-in callbacks inside a real Model.fit: what the user sees afterwards."""

from __future__ import annotations

import csv

import pytest
import torch
from conftest import make_tiny_data, tiny_model
from torch import nn

from callbacks import (
    CSVLogger,
    EarlyStopping,
    LRScheduler,
    ModelCheckpoint,
    ReduceLROnPlateau,
    TerminateOnNaN,
    VisualDL,
)
from hapi.metrics import Accuracy


def _model(lr=0.05, loss=None):
    return tiny_model(lr, Accuracy(), loss=loss)


DATA = make_tiny_data(60)


def test_visualdl_scalars_read_back(tmp_path):
    from visualdl import LogReader

    _model().fit(
        DATA,
        eval_data=DATA,
        batch_size=10,
        epochs=2,
        log_freq=3,
        verbose=0,
        callbacks=[VisualDL(tmp_path / "vdl")],
    )
    records = list((tmp_path / "vdl" / "version_0").glob("vdlrecords.*.log"))
    assert len(records) == 1
    reader = LogReader(file_path=str(records[0]))
    tags = set(reader.get_tags()["scalar"])
    assert {"train/loss", "train/acc", "train/lr", "eval/loss", "eval/acc"} <= tags
    train_steps = [r.id for r in reader.get_data("scalar", "train/loss")]
    assert train_steps == [3, 6, 9, 12]  # every 3 steps and the last of each 6-step epoch
    assert [r.id for r in reader.get_data("scalar", "eval/acc")] == [0, 1]
    assert reader.get_data("scalar", "train/lr")[0].value == pytest.approx(0.05)


def test_early_stopping_on_a_flat_val_loss_stops_after_the_third_epoch():
    model = _model(lr=0.0)  # nothing changes: val_loss is flat
    history = model.fit(
        DATA,
        eval_data=DATA,
        batch_size=20,
        epochs=10,
        verbose=0,
        callbacks=[EarlyStopping(monitor="val_loss", patience=2, verbose=0)],
    )
    assert history.epoch == [0, 1, 2]


def test_early_stopping_restores_the_best_weights():
    model = _model(lr=0.05)
    snapshots = []

    from callbacks import Callback

    class Snap(Callback):
        def on_epoch_end(self, epoch, logs=None):
            snapshots.append({k: v.clone() for k, v in self.model.network.state_dict().items()})

    # Evaluate on data with flipped labels: training makes val_loss worse every epoch.
    x, y = DATA
    stopper = EarlyStopping(monitor="val_loss", patience=1, restore_best_weights=True, verbose=0)
    history = model.fit(
        DATA,
        eval_data=(x, (y + 1) % 3),
        batch_size=10,
        epochs=10,
        verbose=0,
        callbacks=[Snap(), stopper],
    )
    val = history.history["val_loss"]
    best = min(range(len(val)), key=val.__getitem__)
    assert len(val) < 10 and best < len(val) - 1
    for key, value in model.network.state_dict().items():
        torch.testing.assert_close(value, snapshots[best][key])


def test_lr_scheduler_steps_once_per_epoch_by_default():
    model = _model(lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(model.optimizer, step_size=1, gamma=0.5)
    model.fit(DATA, batch_size=10, epochs=3, verbose=0, callbacks=[LRScheduler(scheduler)])
    assert model.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)


def test_lr_scheduler_by_step_follows_optimizer_steps():
    model = _model(lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(model.optimizer, step_size=1, gamma=0.9)
    model.fit(
        DATA,
        batch_size=10,
        epochs=1,
        accumulate_grad_batches=2,
        verbose=0,
        callbacks=[LRScheduler(scheduler, by_step=True)],
    )
    assert model.step == 3  # 6 batches, 2 per optimizer step
    assert model.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.9**3)


def test_reduce_lr_on_plateau_lowers_the_learning_rate():
    model = _model(lr=1e-12)  # too small to move val_loss: a plateau from the start
    reducer = ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=1, verbose=0)
    model.fit(DATA, eval_data=DATA, batch_size=20, epochs=3, verbose=0, callbacks=[reducer])
    assert model.optimizer.param_groups[0]["lr"] == pytest.approx(1e-12 * 0.5)


def test_terminate_on_nan_stops_and_says_where(capsys):
    calls = {"n": 0}

    def exploding(output, label):
        calls["n"] += 1
        loss = nn.functional.cross_entropy(output, label)
        return loss * float("nan") if calls["n"] >= 4 else loss

    model = _model(loss=exploding)
    history = model.fit(
        DATA, batch_size=10, epochs=5, log_freq=1, verbose=0, callbacks=[TerminateOnNaN()]
    )
    assert history.epoch == [0]
    assert model.step == 4
    assert "Epoch 1, step 4: loss is nan" in capsys.readouterr().out


def test_csv_logger_and_checkpoints_after_fit(tmp_path):
    _model().fit(
        DATA,
        eval_data=DATA,
        batch_size=20,
        epochs=3,
        verbose=0,
        callbacks=[
            CSVLogger(tmp_path / "log.csv"),
            ModelCheckpoint(tmp_path / "ckpt", monitor="val_acc"),
        ],
    )
    rows = list(csv.DictReader(open(tmp_path / "log.csv")))
    assert [r["epoch"] for r in rows] == ["0", "1", "2"]
    assert set(rows[0]) == {"epoch", "loss", "acc", "val_loss", "val_acc"}
    assert {p.name for p in (tmp_path / "ckpt").iterdir()} == {
        "0.pt",
        "1.pt",
        "2.pt",
        "best.pt",
        "final.pt",
    }
    restored = _model()
    restored.load(tmp_path / "ckpt" / "final")
    assert restored.evaluate(DATA, verbose=0)["acc"] > 0.5


def test_one_visualdl_callback_for_fit_and_evaluate_writes_one_file(tmp_path):
    from visualdl import LogReader

    model = _model()
    board = VisualDL(tmp_path / "vdl")
    model.fit(DATA, batch_size=10, epochs=1, verbose=0, callbacks=[board])
    model.evaluate(DATA, verbose=0, callbacks=[board])
    records = list((tmp_path / "vdl" / "version_0").glob("vdlrecords.*.log"))
    assert len(records) == 1
    tags = set(LogReader(file_path=str(records[0])).get_tags()["scalar"])
    assert {"train/loss", "eval/loss", "eval/acc"} <= tags
