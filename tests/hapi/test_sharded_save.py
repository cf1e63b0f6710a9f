"""model.save(path, sharded=True) on one process: the directory, its safety, and crashes while saving."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from conftest import TinyNet, make_tiny_data
from torch import nn

import hapi
from hapi.checkpoint import CheckpointError, dcp_io


def trained(lr: float = 0.01, seed: int = 0) -> hapi.Model:
    torch.manual_seed(seed)
    model = hapi.Model(TinyNet())
    model.prepare(torch.optim.Adam(model.parameters(), lr=lr), nn.CrossEntropyLoss())
    model.fit(make_tiny_data(32), batch_size=8, verbose=0)
    return model


def same_weights(a: hapi.Model, b: hapi.Model) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_a_sharded_save_loads_back_and_trains_on_exactly(tmp_path):
    model = trained()
    assert model.save(tmp_path / "ckpt", sharded=True) == str(tmp_path / "ckpt")
    other = trained(lr=0.01, seed=1)
    other.load(tmp_path / "ckpt")
    assert same_weights(model, other) and other.step == model.step
    torch.manual_seed(5)
    model.fit(make_tiny_data(32), batch_size=8, verbose=0)
    torch.manual_seed(5)
    other.fit(make_tiny_data(32), batch_size=8, verbose=0)
    assert same_weights(model, other)  # Adam's moments and step came back too


def test_saving_again_keeps_one_shards_directory(tmp_path):
    model = trained()
    model.save(tmp_path / "ckpt", sharded=True)
    model.save(tmp_path / "ckpt", sharded=True)
    entries = sorted(os.listdir(tmp_path / "ckpt"))
    assert entries[0] == "checkpoint.pt" and len(entries) == 2 and entries[1].startswith("shards-")


def test_a_crash_while_writing_shards_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    model = trained()
    model.save(tmp_path / "ckpt", sharded=True)
    before = [p.detach().clone() for p in model.parameters()]
    model.fit(make_tiny_data(32), batch_size=8, verbose=0)
    real_save = dcp_io.save_shards

    def dies_half_way(directory, *tensors_of, **options):
        real_save(directory, *tensors_of, **{**options, "then_on_main": lambda rest: None})
        os.remove(os.path.join(directory, ".metadata"))  # as if killed before the metadata
        raise KeyboardInterrupt

    monkeypatch.setattr(dcp_io, "save_shards", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        model.save(tmp_path / "ckpt", sharded=True)
    fresh = hapi.Model(TinyNet())
    fresh.prepare(torch.optim.Adam(fresh.parameters()), nn.CrossEntropyLoss())
    fresh.load(tmp_path / "ckpt")
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters()))


class WritesMarker:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (exec, (f"open({str(self.path)!r}, 'w').close()",))


def test_a_planted_metadata_file_is_refused_and_never_run(tmp_path):
    model = trained()
    model.save(tmp_path / "ckpt", sharded=True)
    shards = next((tmp_path / "ckpt").glob("shards-*"))
    marker = tmp_path / "ran"
    (shards / ".metadata").write_bytes(pickle.dumps(WritesMarker(marker)))
    with pytest.raises(CheckpointError, match=r"asks to import builtins.exec.*refuses to run code"):
        trained().load(tmp_path / "ckpt")
    assert not marker.exists()


def test_another_architecture_is_named_and_skip_mismatch_loads_the_rest(tmp_path):
    model = trained()
    model.save(tmp_path / "ckpt", sharded=True)
    torch.manual_seed(0)
    wider = hapi.Model(TinyNet(classes=5))
    wider.prepare(torch.optim.Adam(wider.parameters()), nn.CrossEntropyLoss())
    with pytest.raises(
        CheckpointError, match=r"shape mismatch: out.weight: file \(3, 16\) vs network \(5, 16\)"
    ):
        wider.load(tmp_path / "ckpt")
    with pytest.warns(UserWarning, match=r"skipped 2 tensors"):
        wider.load(tmp_path / "ckpt", skip_mismatch=True)
    assert torch.equal(wider.network.hidden.weight, model.network.hidden.weight)


def test_loading_before_prepare_says_the_optimizer_state_was_not_loaded(tmp_path):
    model = trained()
    model.save(tmp_path / "ckpt", sharded=True)
    fresh = hapi.Model(TinyNet())
    with pytest.warns(
        UserWarning,
        match=r"optimizer state .* was not loaded.*Call prepare\(optimizer=...\) before",
    ):
        fresh.load(tmp_path / "ckpt")
    assert same_weights(model, fresh)
