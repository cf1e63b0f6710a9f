"""A symbolic link planted in the middle of a sharded save or load is never followed.

The backup matrix in ``test_confinement.py`` plants links between hooks; here
a link replaces the shards directory just after torch's distributed checkpoint
made it (so every shard is then written through its name), or a shard just
after its metadata was read. Each is refused with a ``CheckpointError`` naming
the link, and the directory the link points to is untouched.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from conftest import TinyNet, make_tiny_data, tiny_model
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystem

import hapi
from hapi.checkpoint import CheckpointError
from hapi.checkpoint.dcp_io import SafeFileSystemReader

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _model() -> hapi.Model:
    model = tiny_model(1e-3, adam=True)
    model.fit(make_tiny_data(32), batch_size=8, verbose=0)
    return model


def _swap_for_link(path: str, outside) -> None:
    """``path`` (a directory or file) becomes a link to ``outside``, which gets its content."""
    if os.path.isdir(path):
        shutil.copytree(path, outside)
        shutil.rmtree(path)
    else:
        shutil.copy(path, outside)
        os.remove(path)
    os.symlink(outside, path)


def _contents(directory) -> dict:
    return {p.name: p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_link_planted_as_the_shards_directory_while_saving_is_refused(tmp_path, monkeypatch):
    outside, planted = tmp_path / "outside", []
    real_mkdir = FileSystem.mkdir

    def mkdir_then_plant(self, path):
        real_mkdir(self, path)
        _swap_for_link(os.fspath(path), outside)
        planted.append(os.fspath(path))

    monkeypatch.setattr(FileSystem, "mkdir", mkdir_then_plant)
    with pytest.raises(CheckpointError, match="is a symbolic link") as caught:
        _model().save(tmp_path / "ckpt", sharded=True)
    assert planted and planted[0] in str(caught.value)
    assert _contents(outside) == {}  # nothing was written through the link
    assert not (tmp_path / "ckpt" / "checkpoint.pt").exists()


@pytest.mark.parametrize("which", ["metadata", "shard"])
def test_a_link_planted_as_a_shard_while_loading_is_refused(tmp_path, monkeypatch, which):
    model = _model()
    model.save(tmp_path / "ckpt", sharded=True)
    other = _model()
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.add_(1.0)
    other.save(tmp_path / "other", sharded=True)  # readable shards of other weights
    shards = next((tmp_path / "ckpt").glob("shards-*"))
    target = next((tmp_path / "other").glob("shards-*/*.distcp"))
    real_read = SafeFileSystemReader.read_metadata
    planted = []

    def read_then_plant(self, *args, **kwargs):
        metadata = real_read(self, *args, **kwargs)
        if not planted:
            name = ".metadata" if which == "metadata" else target.name
            os.remove(shards / name)
            os.symlink(target.parent / name, shards / name)
            planted.append(str(shards / name))
        return metadata

    monkeypatch.setattr(SafeFileSystemReader, "read_metadata", read_then_plant)
    before = _contents(tmp_path / "other")
    loaded = hapi.Model(TinyNet())
    loaded.prepare(torch.optim.Adam(loaded.parameters()), nn.CrossEntropyLoss())
    with pytest.raises(CheckpointError, match="is a symbolic link") as caught:
        loaded.load(tmp_path / "ckpt")
    assert planted and planted[0] in str(caught.value)
    assert _contents(tmp_path / "other") == before


def test_a_resumed_checkpoint_file_that_is_a_link_is_refused_but_a_loaded_one_is_read(tmp_path):
    """Resuming reads what torch-hapi wrote in its own directory: a link there is refused,
    never read. A link the user passes to load (a ``latest.pt``, a download cache) is theirs."""
    model, outside = _model(), tmp_path / "outside"
    outside.mkdir()
    model.save(tmp_path / "ckpt" / "1", resumable=True)
    _swap_for_link(os.fspath(tmp_path / "ckpt" / "1.pt"), outside / "1.pt")
    before = _contents(outside)
    with pytest.raises(ValueError, match=r"1\.pt' is a symbolic link") as refused:
        _model().fit(make_tiny_data(32), batch_size=8, verbose=0, resume_from=tmp_path / "ckpt/1")
    assert "os.path.realpath" in str(refused.value)
    assert _contents(outside) == before
    loaded = _model()
    loaded.load(tmp_path / "ckpt" / "1")
    assert all(torch.equal(a, b) for a, b in zip(loaded.parameters(), model.parameters()))
