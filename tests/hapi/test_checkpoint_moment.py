"""A save captures one moment: what a load reads back, on every process, is the state at the call."""

from __future__ import annotations

import json
import pathlib
import threading

import pytest
import torch
from conftest import TinyNet, make_tiny_data
from dist_helpers import torchrun
from torch import nn

import hapi
import hapi.checkpoint
from callbacks import Callback
from hapi.checkpoint import CheckpointError

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "distributed" / "moment_script.py"


def test_a_load_after_a_background_save_reads_it_on_every_process(tmp_path):
    # Only rank 0 writes; rank 1 once read the previous file (1.0) while rank 0 read 2.0,
    # and the replicas trained apart from there.
    torchrun(["--standalone", "--nproc_per_node=2", str(SCRIPT), str(tmp_path)], timeout=120)
    loaded = [json.loads((tmp_path / f"rank{r}.json").read_text())["loaded"] for r in (0, 1)]
    assert loaded == [[2.0, 2.0], [2.0, 2.0]]


class SavesAt(Callback):
    """Saves sharded in the background at optimizer step ``at``; lets the write go on at ``release``.

    Its state is a live list, as many a user's callback returns it.
    """

    def __init__(self, path=None, at=None, release=None, go_on=None) -> None:
        super().__init__()
        self.path, self.at, self.release, self.go_on = path, at, release, go_on
        self.seen: list[int] = []
        self.at_call: dict = {}

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.seen = list(state["seen"])

    def on_train_batch_end(self, step, logs=None) -> None:
        self.seen.append(self.model.step)
        if self.model.step == self.at:
            self.at_call = {
                "seen": list(self.seen),
                "loss_sum": float(self.model._metrics.state_dict()["loss_sum"]),
                "step": self.model.step,
                "weights": [p.detach().clone() for p in self.model.parameters()],
            }
            self.model.save(self.path, sharded=True, wait=False, resumable=True)
        if self.model.step == self.release:
            self.go_on.set()


class Records(Callback):
    """What a resumed fit starts from, recorded before its first batch."""

    resumed: dict | None = None

    def __init__(self, other: SavesAt) -> None:
        super().__init__()
        self.other = other

    def on_train_batch_begin(self, step, logs=None) -> None:
        if self.resumed is None:
            self.resumed = {
                "seen": list(self.other.seen),
                "loss_sum": float(self.model._metrics.state_dict()["loss_sum"]),
                "step": self.model.step,
                "weights": [p.detach().clone() for p in self.model.parameters()],
            }


def _prepared(seed: int = 0) -> hapi.Model:
    torch.manual_seed(seed)
    model = hapi.Model(TinyNet())
    model.prepare(torch.optim.Adam(model.parameters(), lr=0.01), nn.CrossEntropyLoss())
    return model


def test_a_sharded_background_save_holds_the_moment_of_the_call(tmp_path, monkeypatch):
    go_on = threading.Event()
    # The module whose write_file writes the manifest.
    module = hapi.checkpoint.state
    real_write = module.write_file

    def held_write(state, target, **options):
        go_on.wait(30)  # the manifest is written once training has gone on
        real_write(state, target, **options)

    monkeypatch.setattr(module, "write_file", held_write)
    model = _prepared()
    saver = SavesAt(tmp_path / "ckpt", at=3, release=9, go_on=go_on)
    model.fit(make_tiny_data(96), batch_size=8, epochs=1, verbose=0, callbacks=[saver])
    model.wait_for_saves()
    monkeypatch.undo()
    assert model.step == 12 and saver.at_call["step"] == 3

    later = SavesAt()
    resumed, records = _prepared(seed=1), Records(later)
    resumed.fit(
        make_tiny_data(96),
        batch_size=8,
        epochs=1,
        verbose=0,
        callbacks=[later, records],
        resume_from=tmp_path / "ckpt",
    )
    got = records.resumed
    assert got["step"] == 3
    assert got["seen"] == saver.at_call["seen"] == [1, 2, 3]
    assert got["loss_sum"] == saver.at_call["loss_sum"]
    assert all(torch.equal(a, b) for a, b in zip(got["weights"], saver.at_call["weights"]))


def test_a_file_without_the_state_a_setting_needs_is_refused_at_load(tmp_path):
    # Adam(amsgrad=True) keeps max_exp_avg_sq, which a file saved with amsgrad=False lacks:
    # the first update failed with KeyError 'max_exp_avg_sq'.
    model = _prepared()
    model.fit(make_tiny_data(32), batch_size=8, verbose=0)
    model.save(tmp_path / "ckpt")
    other = hapi.Model(TinyNet())
    other.prepare(
        torch.optim.Adam(other.parameters(), lr=0.01, amsgrad=True), nn.CrossEntropyLoss()
    )
    with pytest.raises(
        CheckpointError, match=r"amsgrad=False in the file.*amsgrad=True given to prepare"
    ):
        other.load(tmp_path / "ckpt")
    other.fit(make_tiny_data(32), batch_size=8, verbose=0)  # the optimizer was left untouched
    other.load(tmp_path / "ckpt", reset_optimizer=True)  # what the message suggests


@pytest.mark.parametrize(
    ("saved", "given", "setting"),
    [
        (
            lambda p: torch.optim.Adam(p, amsgrad=False),
            lambda p: torch.optim.Adam(p, amsgrad=True),
            "amsgrad",
        ),
        (
            lambda p: torch.optim.AdamW(p, amsgrad=False),
            lambda p: torch.optim.AdamW(p, amsgrad=True),
            "amsgrad",
        ),
        (
            lambda p: torch.optim.RMSprop(p, centered=False),
            lambda p: torch.optim.RMSprop(p, centered=True),
            "centered",
        ),
        (
            lambda p: torch.optim.RMSprop(p, momentum=0.0),
            lambda p: torch.optim.RMSprop(p, momentum=0.9),
            "momentum",
        ),
        (
            lambda p: torch.optim.Adam(p, amsgrad=True),
            lambda p: torch.optim.Adam(p, amsgrad=False),
            "amsgrad",
        ),
    ],
    ids=["Adam amsgrad", "AdamW amsgrad", "RMSprop centered", "RMSprop momentum", "Adam back"],
)
@pytest.mark.parametrize("sharded", [False, True], ids=["file", "sharded"])
def test_a_setting_that_changes_the_per_parameter_state_must_match(
    tmp_path, saved, given, setting, sharded
):
    torch.manual_seed(0)
    model = hapi.Model(TinyNet())
    model.prepare(saved(model.parameters()), nn.CrossEntropyLoss())
    model.fit(make_tiny_data(32), batch_size=8, verbose=0)
    model.save(tmp_path / "ckpt", sharded=sharded)
    other = hapi.Model(TinyNet())
    other.prepare(given(other.parameters()), nn.CrossEntropyLoss())
    with pytest.raises(CheckpointError, match=rf"{setting}=\S+ in the file.*{setting}=\S+ given"):
        other.load(tmp_path / "ckpt")


def test_settings_that_keep_the_state_shape_still_load_with_a_warning(tmp_path):
    model = _prepared()
    model.fit(make_tiny_data(32), batch_size=8, verbose=0)
    model.save(tmp_path / "ckpt")
    other = hapi.Model(TinyNet())
    other.prepare(
        torch.optim.Adam(other.parameters(), lr=0.001, betas=(0.8, 0.9)), nn.CrossEntropyLoss()
    )
    with pytest.warns(UserWarning, match=r"lr=0.01 in the file, 0.001 given"):
        other.load(tmp_path / "ckpt")
    other.fit(make_tiny_data(32), batch_size=8, verbose=0)
