"""No file may make torch-hapi write, delete or read outside the directories the user gave it.

A checkpoint is data from outside (plain strings pass ``weights_only``), so
every name torch-hapi reads back from one and later joins to a directory is
fuzzed here with crafted files built by ``torch.save`` of plain dicts: a
resumable backup whose callback states name other places, and a sharded
checkpoint whose manifest names another shards directory. Each case checks
that a sentinel directory outside is untouched (its entries, inodes, sizes and
mtimes) and that a refusal names the entry and the value.
"""

from __future__ import annotations

import os
import pathlib
import shutil

import pytest
import torch
from conftest import make_tiny_data, tiny_model

import hapi
from callbacks import (
    BackupAndRestore,
    Callback,
    CSVLogger,
    ModelCheckpoint,
    TensorBoard,
    VisualDL,
)


def _model(seed: int = 0) -> hapi.Model:
    return tiny_model(0.1, seed=seed)


def _snapshot(directory: pathlib.Path) -> dict[str, tuple]:
    """Every entry under ``directory`` (links not followed) with its inode, size and mtime."""
    seen = {}
    for root, dirs, names in os.walk(directory):
        for name in dirs + names:
            path = os.path.join(root, name)
            status = os.lstat(path)
            seen[os.path.relpath(path, directory)] = (
                status.st_ino,
                status.st_size,
                status.st_mtime_ns,
            )
    return seen


def _sentinel(root: pathlib.Path) -> pathlib.Path:
    """A directory outside every directory given to torch-hapi, with files a crafted name could hit."""
    outside = root / "outside"
    outside.mkdir()
    for name in ("victim.pt", "precious_model.pt", "victim"):
        (outside / name).write_bytes(b"the user's own file")
    (outside / "version_0").mkdir()
    return outside


def _hostile_names(outside: pathlib.Path, base: pathlib.Path) -> dict[str, object]:
    """Names that would lead from ``base`` (the directory they are joined to) into ``outside``."""
    up = os.path.relpath(outside, base)
    return {
        "absolute": str(outside / "victim"),
        "absolute directory": str(outside),
        "dot-dot path": f"{up}/victim",
        "a/../../x": f"a/../{up}/victim",
        "dot-dot": "..",
        "dot": ".",
        "separator": "sub/victim",
        "backslash": "sub\\victim",
        "trailing separator": "victim/",
        "empty": "",
        "NUL": "victim\0",
        "absolute with NUL": str(outside / "victim") + "\0.pt",
        "not a string": 7,
    }


GENUINE_EPOCHS = 1


@pytest.fixture(scope="module")
def genuine_backup(tmp_path_factory) -> dict:
    """A real resumable backup (one epoch in), with every path-holding callback's state."""
    root = tmp_path_factory.mktemp("genuine")
    callbacks = [
        ModelCheckpoint(root / "ckpt", save_steps=2, keep=1, resumable=True),
        VisualDL(root / "vdl"),
        TensorBoard(root / "tb"),
        CSVLogger(root / "log.csv"),
        BackupAndRestore(root / "backup", delete_checkpoint=False),
    ]
    _model().fit(
        make_tiny_data(32), batch_size=8, epochs=GENUINE_EPOCHS, verbose=0, callbacks=callbacks
    )
    return torch.load(root / "backup" / "backup.pt", weights_only=True)


def _with_state(backup: dict, name: str, change) -> dict:
    """A copy of ``backup`` whose callback ``name``'s state is changed by ``change(state)``."""
    crafted = {**backup, "fit": {**backup["fit"], "callbacks": []}}
    for callback_name, state in backup["fit"]["callbacks"]:
        state = dict(state)
        if callback_name == name:
            change(state)
        crafted["fit"]["callbacks"].append([callback_name, state])
    return crafted


def _resume(case: pathlib.Path, crafted: dict, callbacks: list) -> Exception | None:
    """Fit on from ``crafted`` (as BackupAndRestore finds it); the error, or None."""
    backup = case / "backup"
    backup.mkdir(parents=True)
    torch.save(crafted, backup / "backup.pt")
    try:
        _model().fit(
            make_tiny_data(32),
            batch_size=8,
            epochs=GENUINE_EPOCHS + 1,
            verbose=0,
            callbacks=[*callbacks, BackupAndRestore(backup)],
        )
    except Exception as error:  # noqa: BLE001 -- whatever it is, _check says whether it names the entry
        return error
    return None


def _callbacks(case: pathlib.Path) -> list:
    # save_steps=3 with 4 batches an epoch: no step checkpoint at the resumed epoch's last
    # batch, so a restored pending_step reaches the epoch's end, where it is written.
    return [
        ModelCheckpoint(case / "ckpt", save_steps=3, keep=1, resumable=True),
        VisualDL(case / "vdl"),
        TensorBoard(case / "tb"),
        CSVLogger(case / "log.csv"),
    ]


def _check(failures: list[str], label: str, outside, before, error, entry: str, value) -> None:
    after = _snapshot(outside)
    if after != before:
        changed = sorted(set(before) ^ set(after)) or [k for k in after if after[k] != before[k]]
        failures.append(f"{label}: the sentinel directory changed: {changed}")
    if error is None:
        failures.append(f"{label}: {value!r} was accepted")
    elif entry not in str(error) or repr(value) not in str(error):
        failures.append(f"{label}: the error does not name {entry} and {value!r}: {error}")


# What each fuzzed entry is, where its name is joined, and how a crafted state sets it.
CALLBACK_ENTRIES = {
    "ModelCheckpoint 'pending_step'": (
        "ModelCheckpoint",
        "ckpt",
        lambda state, value: state.update(pending_step=value),
    ),
    "ModelCheckpoint 'written'": (
        "ModelCheckpoint",
        "ckpt",
        lambda state, value: state.update(written=[value]),
    ),
    "VisualDL 'version'": ("VisualDL", "vdl", lambda state, value: state.update(version=value)),
    "TensorBoard 'version'": (
        "TensorBoard",
        "tb",
        lambda state, value: state.update(version=value),
    ),
}


@pytest.mark.parametrize("entry", sorted(CALLBACK_ENTRIES))
def test_no_name_restored_from_a_backup_leads_outside(entry, genuine_backup, tmp_path):
    owner, directory, change = CALLBACK_ENTRIES[entry]
    failures, tried = [], 0
    root = tmp_path / "fuzz"
    root.mkdir()
    outside = _sentinel(root)
    for label, value in _hostile_names(outside, root / "case" / directory).items():
        if value == "" and "pending_step" in entry:
            continue  # "" is how the state says "no pending step": tried below as accepted
        case = root / "case"
        before = _snapshot(outside)

        def craft(state, value=value):
            change(state, value)
            state["save_dir"] = os.path.abspath(case / "ckpt")  # else 'written' is not restored

        error = _resume(case, _with_state(genuine_backup, owner, craft), _callbacks(case))
        _check(failures, label, outside, before, error, entry.split()[-1], value)
        shutil.rmtree(case)
        tried += 1
    print(f"{entry}: {tried} hostile values tried")
    assert failures == []


@pytest.mark.parametrize("entry", sorted(CALLBACK_ENTRIES))
def test_a_restored_name_that_is_a_link_outside_never_leads_there(entry, genuine_backup, tmp_path):
    """A plain name, as torch-hapi writes it, planted as a link into the sentinel directory."""
    owner, directory, change = CALLBACK_ENTRIES[entry]
    outside = _sentinel(tmp_path)
    case = tmp_path / "case"
    (case / directory).mkdir(parents=True)
    if owner == "ModelCheckpoint":
        name = "step-4"
        os.symlink(outside / "victim.pt", case / directory / f"{name}.pt")
    else:
        name = "version_7"
        os.symlink(outside, case / directory / name)
    before = _snapshot(outside)

    def craft(state):
        change(state, name)
        state["save_dir"] = os.path.abspath(case / "ckpt")

    error = _resume(case, _with_state(genuine_backup, owner, craft), _callbacks(case))
    assert _snapshot(outside) == before
    if owner != "ModelCheckpoint":  # a run directory that is a link is refused
        assert error is not None and "version" in str(error) and "symbolic link" in str(error)
    else:  # replaced or unlinked, never followed
        assert error is None, error


def test_text_restored_into_a_csv_log_stays_text(genuine_backup, tmp_path):
    """CSVLogger's restored keys and rows are the file's content, never a path."""
    outside = _sentinel(tmp_path)
    values = [v for v in _hostile_names(outside, tmp_path / "case").values() if isinstance(v, str)]

    def craft(state):
        state["keys"] = [*state["keys"], *values]
        state["rows"] = [*state["rows"], {value: value for value in values}]

    case = tmp_path / "case"
    before = _snapshot(outside)
    assert _resume(case, _with_state(genuine_backup, "CSVLogger", craft), _callbacks(case)) is None
    assert _snapshot(outside) == before


def _sharded_checkpoint(directory: pathlib.Path) -> str:
    model = _model()
    model.fit(make_tiny_data(32), batch_size=8, verbose=0)
    model.save(directory, sharded=True)
    return next(p.name for p in directory.iterdir() if p.name.startswith("shards-"))


def test_a_manifest_names_no_shards_outside_its_directory(tmp_path):
    failures, tried = [], 0
    outside = _sentinel(tmp_path)
    checkpoint = tmp_path / "ckpt"
    shards = _sharded_checkpoint(checkpoint)
    # Readable shards outside: a load that reached them would succeed.
    (outside / "victim").unlink()
    shutil.copytree(checkpoint / shards, outside / "victim")
    os.symlink(outside / "victim", checkpoint / "shards-0123456789abcdef")
    manifest = torch.load(checkpoint / "checkpoint.pt", weights_only=True)
    values = {**_hostile_names(outside, checkpoint), "link outside": "shards-0123456789abcdef"}
    for label, value in values.items():
        before = _snapshot(outside)
        torch.save({**manifest, "shards": value}, checkpoint / "checkpoint.pt")
        error = None
        try:
            _model(seed=1).load(checkpoint)
        except Exception as caught:  # noqa: BLE001 -- _check says whether it names the entry
            error = caught
        _check(failures, label, outside, before, error, "'shards'", value)
        tried += 1
    print(f"manifest 'shards': {tried} hostile values tried")
    assert failures == []
    torch.save(manifest, checkpoint / "checkpoint.pt")
    _model(seed=1).load(checkpoint)  # the genuine manifest still loads


def test_a_link_planted_as_the_spare_is_never_written_through(tmp_path):
    outside = _sentinel(tmp_path)
    before = _snapshot(outside)
    os.symlink(outside / "victim", tmp_path / ".backup.pt.spare")
    model = _model()
    for _ in range(3):
        model.save(tmp_path / "backup", wait=False)
        model.wait_for_saves()
    assert _snapshot(outside) == before
    assert (outside / "victim").read_bytes() == b"the user's own file"
    _model(seed=1).load(tmp_path / "backup")


def test_a_second_hard_link_to_the_backup_never_becomes_the_spare(tmp_path):
    outside = _sentinel(tmp_path)
    os.link(outside / "victim", tmp_path / "backup.pt")  # a second name for the user's file
    model = _model()
    for _ in range(3):
        model.save(tmp_path / "backup", wait=False)
        model.wait_for_saves()
    assert (outside / "victim").read_bytes() == b"the user's own file"
    _model(seed=1).load(tmp_path / "backup")


def test_a_link_named_as_a_checkpoint_is_replaced_not_followed(tmp_path):
    outside = _sentinel(tmp_path)
    before = _snapshot(outside)
    os.symlink(outside / "victim.pt", tmp_path / "final.pt")
    model = _model()
    model.save(tmp_path / "final")
    assert _snapshot(outside) == before
    assert not os.path.islink(tmp_path / "final.pt")


def test_an_empty_path_is_refused_instead_of_a_hidden_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = _model()
    for path in ("", "ckpt/", ".", ".."):
        with pytest.raises(ValueError, match=r"must name a file; received '"):
            model.save(path)
        with pytest.raises(ValueError, match=r"must name a file"):
            model.save(path, wait=False)
    with pytest.raises(ValueError, match=r"must name a directory; received ''"):
        model.save("", sharded=True)
    assert sorted(os.listdir(tmp_path)) == []
    model.save("ckpt/", sharded=True)  # a directory may end in a separator
    assert sorted(os.listdir(tmp_path / "ckpt"))[0] == "checkpoint.pt"


# -- links planted before, between and during runs --------------------------------------------
#
# Every entry torch-hapi opens in a backup directory -- a single-file backup's files, a
# sharded backup's directory, manifest, shards directory and shard files, and ModelCheckpoint's
# files (kept in the same directory here) -- is replaced by a
# symbolic link into a sentinel directory that holds another run's copy of it (so following
# the link would "work"): before the first run, between an interrupted run and its resume, and
# during a run (after a backup, before the next). The sentinel must stay untouched, and the fit
# must either refuse with an error naming the link, or end with the weights of the same run
# never interrupted (the link replaced or left alone, never followed).

LINK_EPOCHS = 3
SINGLE = ["backup.pt", "backup-previous.pt", ".backup.pt.spare", "ckpt/0.pt", "ckpt/final.pt"]
SHARDED = [
    "backup",
    "backup/checkpoint.pt",
    "backup/shards-*",
    "backup/shards-*/.metadata",
    "backup/shards-*/__0_0.distcp",
]


class _Plant(Callback):
    """Calls ``plant()`` at epoch ``epoch``'s second batch, once the last backup is on disk."""

    def __init__(self, epoch: int, plant) -> None:
        super().__init__()
        self.epoch, self.plant = epoch, plant

    def on_train_batch_end(self, step, logs=None):
        if self.model.epoch == self.epoch and step == 1:
            self.model.wait_for_saves()
            self.plant()


class _Stop(Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 2:
            raise KeyboardInterrupt  # as a crash: no on_train_end


def _fit_backup(backup_dir, seed: int = 0, callbacks=(), sharded: bool = False) -> hapi.Model:
    model = _model(seed)
    backup = BackupAndRestore(backup_dir, double_checkpoint=not sharded)
    model.fit(
        make_tiny_data(32),
        batch_size=8,
        epochs=LINK_EPOCHS,
        verbose=0,
        callbacks=[*callbacks, ModelCheckpoint(backup_dir / "ckpt", keep=2), backup],
    )
    return model


def _flat(model: hapi.Model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.fixture(scope="module")
def link_runs(tmp_path_factory) -> dict:
    """Another run's backups (seed 1) to copy outside, and the uninterrupted run's weights."""
    root = tmp_path_factory.mktemp("links")
    found = {}
    with pytest.MonkeyPatch.context() as patch:
        for sharded in (False, True):
            patch.setattr(hapi.Model, "sharded", property(lambda self, s=sharded: s))
            other = root / f"other-{sharded}"
            with pytest.raises(KeyboardInterrupt):
                _fit_backup(other, seed=1, callbacks=[_Stop()], sharded=sharded)
            hapi.checkpoint.wait_for_writes()
            if not sharded:
                (other / ".backup.pt.spare").write_bytes((other / "backup.pt").read_bytes())
            found[sharded] = (other, _flat(_fit_backup(root / f"ref-{sharded}", sharded=sharded)))
    return found


def _entry(directory: pathlib.Path, entry: str) -> pathlib.Path:
    """``entry`` in ``directory``, a ``shards-*`` part resolved (a name of that shape if none)."""
    path = directory
    for part in entry.split("/"):
        matches = sorted(path.glob(part)) if "*" in part else [path / part]
        path = matches[0] if matches else path / part.replace("*", "0123456789abcdef")
    return path


def _plant_link(backup_dir: pathlib.Path, entry: str, outside: pathlib.Path) -> pathlib.Path:
    where, target = _entry(backup_dir, entry), _entry(outside, entry)
    if where.is_dir() and not where.is_symlink():
        shutil.rmtree(where)
    elif where.exists() or where.is_symlink():
        where.unlink()
    where.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, where)
    return where


@pytest.mark.parametrize("moment", ["before", "between", "during"])
@pytest.mark.parametrize("entry", SINGLE + SHARDED)
def test_a_link_planted_in_a_backup_directory_is_never_followed(
    entry, moment, link_runs, tmp_path, monkeypatch
):
    sharded = entry in SHARDED
    monkeypatch.setattr(hapi.Model, "sharded", property(lambda self: sharded))
    other, reference = link_runs[sharded]
    outside = tmp_path / "outside"
    shutil.copytree(other, outside, symlinks=True)
    before = _snapshot(outside)
    backup_dir = tmp_path / "run"
    planted = []

    def plant():
        planted.append(_plant_link(backup_dir, entry, outside))

    error, model = None, None
    try:
        if moment == "before":
            plant()
        elif moment == "between":
            with pytest.raises(KeyboardInterrupt):
                _fit_backup(backup_dir, callbacks=[_Stop()], sharded=sharded)
            hapi.checkpoint.wait_for_writes()
            plant()
        callbacks = [_Plant(1, plant)] if moment == "during" else []
        seed = 2 if moment == "between" else 0  # resumed: the weights must come from a backup
        model = _fit_backup(backup_dir, seed=seed, callbacks=callbacks, sharded=sharded)
    except Exception as caught:  # noqa: BLE001 -- checked below: it must name the link
        error = caught
    hapi.checkpoint.wait_for_writes()
    assert planted, "the link was never planted"
    assert _snapshot(outside) == before, f"{entry} {moment}: the sentinel directory changed"
    if error is not None:
        assert "symbolic link" in str(error) and str(planted[0]) in str(error), error
    else:
        assert (_flat(model) - reference).abs().max() < 1e-6, f"{entry} {moment}: other weights"
