"""Every resumable file a fit writes continues that fit exactly: a step file, an epoch file, and a
``best.pt`` written during an ``eval_steps`` evaluation, in the middle of a step.

Each file must hold the whole step it was written at -- the EMA's average, the schedule, a
batch-end callback's state -- so that the fit continued from it ends with the very weights (the
EMA's, swapped in at the end) and the very callback state of the run never interrupted.
"""

from __future__ import annotations

import os
import shutil
import warnings

import torch
from conftest import TinyNet, make_tiny_data
from torch import nn
from torch.optim.lr_scheduler import OneCycleLR

from callbacks import EMA, Callback, LRScheduler, ModelCheckpoint
from hapi import Model


class Steps(Callback):
    """A user's batch-end callback with a state: the optimizer step of every batch it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []

    def on_train_batch_end(self, step, logs=None):
        self.seen.append(self.model.step)

    def state_dict(self):
        return {"seen": list(self.seen)}

    def load_state_dict(self, state):
        self.seen = list(state["seen"])


def run(save_dir, resume_from=None, snapshots=None, seed: int = 0):
    """Two epochs of 6 batches, an evaluation every 2 steps; every resumable save copied into
    ``snapshots``. Returns the final weights and what ``Steps`` saw."""
    torch.manual_seed(seed)
    model = Model(TinyNet())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), nn.CrossEntropyLoss())
    if snapshots is not None:
        save = model.save

        def copying(path, *args, **kwargs):
            written = save(path, *args, **kwargs)
            name = f"{len(os.listdir(snapshots)):02d}-{os.path.basename(written)}"
            shutil.copy(written, snapshots / name)
            return written

        model.save = copying
    steps = Steps()
    model.fit(
        make_tiny_data(48),
        eval_data=make_tiny_data(16, seed=1),
        batch_size=8,
        epochs=2,
        eval_steps=2,
        verbose=0,
        resume_from=resume_from,
        callbacks=[
            EMA(decay=0.9),
            LRScheduler(lambda opt, total: OneCycleLR(opt, max_lr=0.2, total_steps=total), True),
            steps,
            ModelCheckpoint(save_dir, save_steps=5, resumable=True),
        ],
    )
    return torch.cat([p.detach().flatten() for p in model.parameters()]), steps.seen


def test_a_fit_continued_from_any_file_it_wrote_ends_as_if_never_interrupted(tmp_path):
    snapshots = tmp_path / "snapshots"
    snapshots.mkdir()
    weights, seen = run(tmp_path / "whole", snapshots=snapshots)
    files = sorted(os.listdir(snapshots))
    # best.pt during evaluations at steps 2, 4, 8 or 10 (mid-epoch) and at epoch ends; step-5, -10.
    assert sum(name.endswith("best.pt") for name in files) >= 3, files
    assert {"step-5.pt", "step-10.pt", "0.pt", "1.pt", "final.pt"} <= {f[3:] for f in files}
    differ = {}
    for index, name in enumerate(files):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            resumed, resumed_seen = run(tmp_path / str(index), snapshots / name, seed=1)
        if not torch.equal(resumed, weights) or resumed_seen != seen:
            differ[name] = (float((resumed - weights).abs().max()), len(resumed_seen) - len(seen))
    assert differ == {}, f"{len(differ)} of {len(files)} files resume elsewhere: {differ}"
