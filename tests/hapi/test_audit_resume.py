"""Resumes and saves off the usual pattern: two callbacks of one class, relative directories,
an unreadable newest backup, and a save while another is still being written.

Each test here was checked against a one-line regression made by hand that the other
tests let through (callbacks of one class swapping their states on resume, a relative
``ModelCheckpoint`` directory losing its rotation after a resume, the unreadable backup
rotated into ``backup-previous.pt``, a blocking save not waiting for a background one).
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from conftest import make_tiny_data, tiny_model

from callbacks import BackupAndRestore, Callback, EarlyStopping, ModelCheckpoint
from hapi import Model
from hapi.metrics import Accuracy

DATA, EVAL = make_tiny_data(96), make_tiny_data(48, seed=1)


def small_model() -> Model:
    return tiny_model(0.05, Accuracy(), device="cpu")


class CrashAtEpoch(Callback):
    """Dies as epoch ``epoch`` begins: the backup of the epoch before is on disk."""

    def __init__(self, epoch: int) -> None:
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise KeyboardInterrupt


class States(Callback):
    """Every watched callback's state as each epoch begins (after a resume restored them)."""

    def __init__(self, watched: list[Callback]) -> None:
        super().__init__()
        self.watched, self.seen = watched, {}

    def on_epoch_begin(self, epoch, logs=None):
        self.seen[epoch] = [
            {k: v for k, v in c.state_dict().items() if k not in ("best_weights", "save_dir")}
            for c in self.watched
        ]


def two_of_each(root: str) -> list[Callback]:
    """Two EarlyStoppings and two ModelCheckpoints whose states differ: swapped on a resume,
    the patient one would stop, the impatient one not, and each would rotate the other's files."""
    return [
        EarlyStopping("val_loss", patience=10),
        EarlyStopping("val_acc", mode="max", patience=3, min_delta=0.5),  # stops at epoch 3
        ModelCheckpoint(os.path.join(root, "ckpt_a"), keep=2),
        ModelCheckpoint(os.path.join(root, "ckpt_b"), monitor="val_acc", keep=1, save_freq=2),
    ]


def run(root: str, crash: int = -1) -> tuple[int, States]:
    kept = two_of_each(root)
    states = States(kept)
    model = small_model()
    history = model.fit(
        DATA,
        eval_data=EVAL,
        batch_size=16,
        epochs=6,
        verbose=0,
        callbacks=[
            *kept,
            states,
            CrashAtEpoch(crash),
            BackupAndRestore(os.path.join(root, "backup")),
        ],
    )
    model.wait_for_saves()
    return len(history.history["loss"]), states


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_two_callbacks_of_one_class_resume_their_own_states(tmp_path, monkeypatch, where):
    monkeypatch.chdir(tmp_path)
    root = lambda name: name if where == "relative" else str(tmp_path / name)  # noqa: E731
    trained, reference = run(root("reference"))
    with pytest.raises(KeyboardInterrupt):
        run(root("crashed"), crash=2)
    resumed_trained, resumed = run(root("crashed"))
    assert resumed_trained == trained
    assert resumed.seen[2] == reference.seen[2]  # each callback got its own state back
    for name in ("ckpt_a", "ckpt_b"):  # rotation went on with the files the crashed run wrote
        assert sorted(os.listdir(tmp_path / "crashed" / name)) == sorted(
            os.listdir(tmp_path / "reference" / name)
        ), name
    assert len([f for f in os.listdir(tmp_path / "crashed" / "ckpt_a") if f[0].isdigit()]) == 2


def test_a_model_checkpoint_in_a_relative_directory_keeps_rotating_after_resume_from(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    model = small_model()
    checkpoint = ModelCheckpoint("ckpt", keep=2, resumable=True)
    model.fit(DATA, batch_size=16, epochs=2, verbose=0, callbacks=[checkpoint])
    model = small_model()
    checkpoint = ModelCheckpoint("ckpt", keep=2, resumable=True)
    model.fit(
        DATA, batch_size=16, epochs=4, verbose=0, callbacks=[checkpoint], resume_from="ckpt/1"
    )
    assert sorted(os.listdir("ckpt")) == ["2.pt", "3.pt", "final.pt"]


def test_after_falling_back_from_an_unreadable_backup_the_previous_stays_readable(tmp_path):
    def crash_at_epoch_3() -> None:
        model = small_model()
        with pytest.raises(KeyboardInterrupt):
            model.fit(
                DATA,
                batch_size=16,
                epochs=6,
                verbose=0,
                callbacks=[CrashAtEpoch(3), BackupAndRestore(tmp_path, double_checkpoint=True)],
            )
        model.wait_for_saves()

    crash_at_epoch_3()  # backups at epochs 0, 1, 2: backup.pt holds 3 epochs, backup-previous.pt 2
    (tmp_path / "backup.pt").write_bytes(b"not a checkpoint")  # the newest is lost
    with pytest.warns(UserWarning, match="resuming from the previous backup"):
        crash_at_epoch_3()  # resumed at 2 epochs done, backed up epoch 2 again, then died
    # The unreadable file was not kept as the previous backup: both backups still resume.
    for name in ("backup", "backup-previous"):
        model = small_model()
        model.load(tmp_path / name)
        assert model.epoch == {"backup": 3, "backup-previous": 2}[name], name


def test_a_blocking_save_lands_after_a_background_one_still_being_written(tmp_path, monkeypatch):
    model = small_model()
    real_save = torch.save

    def slow_in_the_background(*args, **kwargs):
        if threading.current_thread().name == "hapi-checkpoint-write":
            time.sleep(1.5)  # a large backup, still being written
        return real_save(*args, **kwargs)

    monkeypatch.setattr(torch, "save", slow_in_the_background)
    model.save(tmp_path / "model", wait=False)  # in flight for a while yet
    with torch.no_grad():
        model.network.out.bias.fill_(7.0)
    model.save(tmp_path / "model")  # returns once this state is on disk: the newest, for good
    model.wait_for_saves()
    saved = torch.load(tmp_path / "model.pt", weights_only=True)["network"]["out.bias"]
    assert saved.eq(7.0).all(), saved  # not the older background write, landed last
