"""BackupAndRestore deletes what it wrote, and only that: never a user's file or directory."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import TinyNet, make_tiny_data
from torch import nn

import hapi
from callbacks import BackupAndRestore


def _fit(backup: BackupAndRestore, epochs: int = 2) -> hapi.Model:
    torch.manual_seed(0)
    model = hapi.Model(TinyNet())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    model.fit(make_tiny_data(32), batch_size=8, epochs=epochs, verbose=0, callbacks=[backup])
    return model


def test_a_users_directory_named_backup_survives_the_end_of_training(tmp_path):
    mine = tmp_path / "backup"  # <backup_dir>/backup: where a sharded backup would go
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    _fit(BackupAndRestore(tmp_path))
    assert (mine / "notes.txt").read_text() == "mine"
    assert sorted(os.listdir(tmp_path)) == ["backup"]  # backup.pt and its spare are gone


def test_a_sharded_backup_is_deleted_without_the_files_beside_it(tmp_path, monkeypatch):
    # save(sharded=True) works on one process too: pretend the weights are sharded.
    monkeypatch.setattr(hapi.Model, "sharded", property(lambda self: True))
    sharded = tmp_path / "backup"
    sharded.mkdir()
    (sharded / "notes.txt").write_text("mine")
    (sharded / "shards-of-mine").mkdir()
    seen = []

    class Looks(BackupAndRestore):
        def on_epoch_end(self, epoch, logs=None):
            super().on_epoch_end(epoch, logs)
            self.model.wait_for_saves()
            seen.append(sorted(os.listdir(sharded)))

    _fit(Looks(tmp_path))
    assert seen[-1][0] == "checkpoint.pt" and any(n.startswith("shards-") for n in seen[-1])
    assert sorted(os.listdir(sharded)) == ["notes.txt", "shards-of-mine"]
    assert (sharded / "notes.txt").read_text() == "mine"


def test_the_directory_it_created_goes_when_empty(tmp_path):
    _fit(BackupAndRestore(tmp_path / "made" / "here"))
    assert os.listdir(tmp_path / "made") == []  # the parent was made by makedirs: it stays


def test_a_directory_that_existed_stays_even_when_empty(tmp_path):
    (tmp_path / "mine").mkdir()
    _fit(BackupAndRestore(tmp_path / "mine"))
    assert os.listdir(tmp_path / "mine") == []


def test_a_directory_holding_other_files_stays_with_them(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    _fit(BackupAndRestore(tmp_path / "mine"))
    assert os.listdir(tmp_path / "mine") == ["notes.txt"]


def test_a_resumed_run_removes_the_directory_its_interrupted_run_made(tmp_path):
    backup = BackupAndRestore(tmp_path / "made", delete_checkpoint=False)
    _fit(backup, epochs=1)  # as if interrupted after one epoch: the backup stays
    assert sorted(os.listdir(tmp_path / "made"))[-1] == "backup.pt"
    _fit(BackupAndRestore(tmp_path / "made"), epochs=2)
    assert not (tmp_path / "made").exists()


def test_delete_checkpoint_false_keeps_everything(tmp_path):
    _fit(BackupAndRestore(tmp_path / "made", delete_checkpoint=False))
    assert "backup.pt" in os.listdir(tmp_path / "made")


@pytest.mark.parametrize("backup_dir", ["", None])
def test_an_empty_or_missing_backup_dir_is_a_value_error(backup_dir):
    # Keras and Paddle refuse it too; "" would back up into the working directory.
    with pytest.raises(ValueError, match=r"backup_dir must name a directory; received"):
        BackupAndRestore(backup_dir)


def test_a_backup_dir_of_another_type_is_still_a_type_error():
    with pytest.raises(TypeError, match=r"received 3 of type int"):
        BackupAndRestore(3)
