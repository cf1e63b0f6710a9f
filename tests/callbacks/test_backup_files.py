"""BackupAndRestore deletes what it wrote, and only that: never a user's file or directory."""

from __future__ import annotations

import io
import os
import pathlib
import warnings

import pytest
import torch
from conftest import TinyNet, make_tiny_data
from torch import nn

import hapi
from callbacks import BackupAndRestore, Callback, ModelCheckpoint
from hapi.checkpoint import files


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


@pytest.mark.parametrize("made_by", ["the interrupted run", "the user"])
def test_a_resumed_run_removes_the_directory_only_if_its_interrupted_run_made_it(tmp_path, made_by):
    if made_by == "the user":
        (tmp_path / "made").mkdir()
    backup = BackupAndRestore(tmp_path / "made", delete_checkpoint=False)
    _fit(backup, epochs=1)  # as if interrupted after one epoch: the backup stays
    assert sorted(os.listdir(tmp_path / "made")) == ["backup.pt"]  # either way: only the backup
    _fit(BackupAndRestore(tmp_path / "made"), epochs=2)
    assert (tmp_path / "made").exists() == (made_by == "the user")


def test_a_sharded_backup_is_named_as_it_lies_when_resumed_or_unreadable(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(hapi.Model, "sharded", property(lambda self: True))
    _fit(BackupAndRestore(tmp_path, delete_checkpoint=False), epochs=1)
    capsys.readouterr()
    _fit(BackupAndRestore(tmp_path, delete_checkpoint=False), epochs=2)
    said = capsys.readouterr().out
    assert f"resuming from {tmp_path / 'backup'} at epoch 2" in said, said
    shard = next((tmp_path / "backup").glob("shards-*/*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # cut off: torch raises a BaseException
    with pytest.raises(RuntimeError, match="delete .*/backup\\.$") as caught:
        _fit(BackupAndRestore(tmp_path), epochs=3)
    assert isinstance(caught.value.__cause__, hapi.checkpoint.CheckpointError)
    assert str(shard.parent) in str(caught.value)


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


# -- double_checkpoint: the previous backup, and falling back on it ---------------------------


class _Interrupt(Callback):
    """Stops the run at the beginning of epoch ``at``, as a crash would."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.at:
            raise RuntimeError("interrupted")


EPOCHS = 3


def _weights(model: hapi.Model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _resume(backup_dir, **options) -> tuple[hapi.Model, hapi.History, list[str]]:
    """A fit of EPOCHS epochs that resumes from ``backup_dir``; the warnings it gave."""
    torch.manual_seed(1)  # another start: the weights must come from a backup
    model = hapi.Model(TinyNet())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", message="ModelCheckpoint is monitoring")
        history = model.fit(
            make_tiny_data(32),
            batch_size=8,
            epochs=EPOCHS,
            verbose=0,
            callbacks=[
                _Interrupt(-1),
                ModelCheckpoint(pathlib.Path(backup_dir).parent / "ckpt"),
                BackupAndRestore(backup_dir, **options),
            ],
        )
    return model, history, [str(w.message) for w in caught]


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> dict:
    """The weights of an uninterrupted run, and the backups of one stopped before epoch 2."""
    reference = _fit(BackupAndRestore(tmp_path_factory.mktemp("reference")), epochs=EPOCHS)
    backup_dir = tmp_path_factory.mktemp("interrupted") / "backup"  # made by the run
    torch.manual_seed(0)
    model = hapi.Model(TinyNet())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    with pytest.raises(RuntimeError, match="interrupted"):
        model.fit(
            make_tiny_data(32),
            batch_size=8,
            epochs=EPOCHS,
            verbose=0,
            callbacks=[
                _Interrupt(2),
                ModelCheckpoint(backup_dir.parent / "ckpt"),
                BackupAndRestore(backup_dir, double_checkpoint=True),
            ],
        )
    model.wait_for_saves()
    return {
        "weights": _weights(reference),
        "newest": (backup_dir / "backup.pt").read_bytes(),
        "previous": (backup_dir / "backup-previous.pt").read_bytes(),
    }


def _backup_dir(tmp_path, interrupted, newest: bytes | None = None) -> pathlib.Path:
    backup_dir = tmp_path / "backup"
    backup_dir.mkdir()
    (backup_dir / "backup.pt").write_bytes(interrupted["newest"] if newest is None else newest)
    (backup_dir / "backup-previous.pt").write_bytes(interrupted["previous"])
    return backup_dir


def test_the_previous_backup_is_the_one_before_the_newest(interrupted):
    newest = torch.load(io.BytesIO(interrupted["newest"]), weights_only=True)
    previous = torch.load(io.BytesIO(interrupted["previous"]), weights_only=True)
    assert (newest["epoch"], newest["step"]) == (2, 8)
    assert (previous["epoch"], previous["step"]) == (1, 4)


def test_a_readable_newest_backup_is_resumed_and_both_are_deleted_at_the_end(tmp_path, interrupted):
    backup_dir = _backup_dir(tmp_path, interrupted)
    model, history, messages = _resume(backup_dir, double_checkpoint=True)
    assert messages == []
    assert history.epoch == [0, 1, 2]  # epochs 0 and 1 restored from the backup
    assert (_weights(model) - interrupted["weights"]).abs().max() < 1e-6
    assert not backup_dir.exists()  # backup.pt, backup-previous.pt, then the directory


def _crafted_newest(genuine: bytes, outside: pathlib.Path) -> dict[str, bytes]:
    """Newest backups that cannot be resumed from: a fuzz over truncation points, and worse."""
    cases = {
        f"truncated to {n} bytes": genuine[:n]
        for n in sorted(
            {0, 1, len(genuine) - 22, len(genuine) - 1}
            | set(range(0, len(genuine), len(genuine) // 3))
        )
    }
    cases["garbage"] = bytes(range(256)) * 64
    cases["a zip of nothing"] = b"PK\x05\x06" + b"\0" * 18
    state = torch.load(io.BytesIO(genuine), weights_only=True)

    def saved(value) -> bytes:
        buffer = io.BytesIO()
        torch.save(value, buffer)
        return buffer.getvalue()

    cases["carries code"] = saved({**state, "rng": _Payload()})
    cases["not resumable"] = saved({k: v for k, v in state.items() if k != "fit"})
    cases["another architecture"] = saved(
        {**state, "network": {k: torch.zeros(2, 2) for k in state["network"]}}
    )

    def with_checkpoint_state(**changes) -> bytes:
        listed = [
            [name, {**entry, **changes} if name == "ModelCheckpoint" else entry]
            for name, entry in state["fit"]["callbacks"]
        ]
        return saved({**state, "fit": {**state["fit"], "callbacks": listed}})

    cases["a name leading outside"] = with_checkpoint_state(written=[str(outside / "victim")])
    cases["a crafted deferred evaluation"] = with_checkpoint_state(deferred="x")
    return cases


class _Payload:
    """An object pickle stores by its class: a file holding one asks to import code."""


def test_an_unreadable_newest_backup_falls_back_on_the_previous_one(tmp_path, interrupted):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.pt").write_bytes(b"the user's own file")
    failures, tried = [], 0
    for label, newest in _crafted_newest(interrupted["newest"], outside).items():
        case = tmp_path / f"case{tried}"
        case.mkdir()
        backup_dir = _backup_dir(case, interrupted, newest)
        tried += 1
        try:
            model, history, messages = _resume(
                backup_dir, double_checkpoint=True, delete_checkpoint=False
            )
        except Exception as error:  # noqa: BLE001 -- each case is reported, not the first only
            failures.append(f"{label}: {type(error).__name__}: {error}")
            continue
        fell_back = [m for m in messages if "resuming from the previous backup" in m]
        if len(fell_back) != 1 or not all(
            str(backup_dir / name) in fell_back[0] for name in ("backup.pt", "backup-previous.pt")
        ):
            failures.append(f"{label}: no warning naming both files: {messages}")
        if (_weights(model) - interrupted["weights"]).abs().max() > 1e-6:
            failures.append(f"{label}: the resumed run differs from the uninterrupted one")
        if history.epoch != [0, 1, 2]:
            failures.append(f"{label}: history {history.epoch}")
        # The next backup did not make the unreadable file the previous one: both load.
        epochs = [
            torch.load(backup_dir / name, weights_only=True)["epoch"]
            for name in ("backup-previous.pt", "backup.pt")
        ]
        if epochs != [2, 3]:
            failures.append(f"{label}: backups of epochs {epochs}")
    assert (outside / "victim.pt").read_bytes() == b"the user's own file"
    assert sorted(os.listdir(outside)) == ["victim.pt"]
    print(f"{tried} unreadable newest backups tried")
    assert tried >= 12 and failures == []


def test_a_missing_newest_backup_falls_back_on_the_previous_one(tmp_path, interrupted):
    backup_dir = _backup_dir(tmp_path, interrupted)
    (backup_dir / "backup.pt").unlink()
    model, _, messages = _resume(backup_dir, double_checkpoint=True)
    assert len(messages) == 1 and "backup.pt is missing; resuming from the previous" in messages[0]
    assert (_weights(model) - interrupted["weights"]).abs().max() < 1e-6


@pytest.mark.parametrize("newest", [b"", b"PK\x03\x04 not really a checkpoint"])
def test_without_double_checkpoint_an_unreadable_backup_is_an_error(tmp_path, interrupted, newest):
    backup_dir = _backup_dir(tmp_path, interrupted, newest)
    with pytest.raises(
        RuntimeError,
        match=r"could not resume from .*backup\.pt: .*truncated or corrupt.*To start training from "
        r"scratch instead, delete .*backup\.pt\.$",
    ):
        _resume(backup_dir)


def test_both_backups_unreadable_is_an_error_naming_both(tmp_path, interrupted):
    backup_dir = _backup_dir(tmp_path, interrupted, b"\0" * 10)
    (backup_dir / "backup-previous.pt").write_bytes(b"")
    with pytest.raises(
        RuntimeError,
        match=r"newest backup .*backup\.pt cannot be read \(.*\), and the previous backup "
        r".*backup-previous\.pt cannot be read either \(.*0 bytes.*\)\. To start training from "
        r"scratch instead, delete .*backup\.pt and .*backup-previous\.pt\.",
    ):
        _resume(backup_dir, double_checkpoint=True)


def test_an_unreadable_backup_without_a_previous_one_is_an_error(tmp_path, interrupted):
    backup_dir = _backup_dir(tmp_path, interrupted, b"garbage")
    (backup_dir / "backup-previous.pt").unlink()
    with pytest.raises(
        RuntimeError, match=r"there is no previous backup \(.*backup-previous\.pt is missing\)"
    ):
        _resume(backup_dir, double_checkpoint=True)


def test_double_checkpoint_must_be_a_bool(tmp_path):
    with pytest.raises(TypeError, match=r"double_checkpoint must be True or False; received 'yes'"):
        BackupAndRestore(tmp_path, double_checkpoint="yes")


def test_a_link_planted_as_the_previous_backup_is_replaced_not_followed(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.pt").write_bytes(b"the user's own file")
    (tmp_path / "backup.pt").write_bytes(b"a backup")
    os.symlink(outside / "victim.pt", tmp_path / "backup-previous.pt")
    assert files.keep_as_previous(tmp_path / "backup.pt", tmp_path / "backup-previous.pt")
    assert (outside / "victim.pt").read_bytes() == b"the user's own file"
    assert not os.path.islink(tmp_path / "backup-previous.pt")
    assert os.path.samefile(tmp_path / "backup.pt", tmp_path / "backup-previous.pt")


def test_a_link_planted_as_the_backup_never_becomes_the_previous_one(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.pt").write_bytes(b"the user's own file")
    os.symlink(outside / "victim.pt", tmp_path / "backup.pt")
    assert not files.keep_as_previous(tmp_path / "backup.pt", tmp_path / "backup-previous.pt")
    assert not files.keep_as_previous(tmp_path / "missing.pt", tmp_path / "backup-previous.pt")
    assert sorted(os.listdir(tmp_path)) == ["backup.pt", "outside"]


def test_backups_keep_the_previous_one_during_training_and_delete_both_at_the_end(tmp_path):
    seen = []

    class Looks(Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.model.wait_for_saves()
            seen.append(
                [
                    torch.load(tmp_path / name, weights_only=True)["epoch"]
                    for name in ("backup.pt", "backup-previous.pt")
                    if (tmp_path / name).exists()
                ]
            )

    _fit_with(tmp_path, [Looks(), BackupAndRestore(tmp_path, double_checkpoint=True)], epochs=3)
    assert seen == [[], [1], [2, 1]]
    assert os.listdir(tmp_path) == []


def _fit_with(tmp_path, callbacks, epochs):
    torch.manual_seed(0)
    model = hapi.Model(TinyNet())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    model.fit(make_tiny_data(32), batch_size=8, epochs=epochs, verbose=0, callbacks=callbacks)
