"""Where a resumed epoch cannot equal the uninterrupted one, fit says so before training."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import tiny_model
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from callbacks import BackupAndRestore, ModelCheckpoint


class Stream(IterableDataset):
    def __iter__(self):
        for i in range(8):
            yield torch.full((4,), float(i)), torch.tensor(i % 2)


def _model():
    return tiny_model(0.1, network=lambda: nn.Linear(4, 2))


def _tensors():
    return TensorDataset(torch.randn(8, 4), torch.zeros(8, dtype=torch.long))


@pytest.mark.parametrize(
    "data, reason",
    [
        (lambda: DataLoader(Stream(), batch_size=2), "IterableDataset"),
        (
            lambda: DataLoader(_tensors(), batch_size=2, num_workers=1, persistent_workers=True),
            "persistent_workers=True",
        ),
    ],
    ids=["iterable", "persistent-workers"],
)
@pytest.mark.parametrize(
    "callback",
    [BackupAndRestore, lambda d: ModelCheckpoint(d, resumable=True)],
    ids=["backup", "ckpt"],
)
def test_a_fit_that_can_resume_warns_once_before_training_naming_the_reason(
    tmp_path, data, reason, callback
):
    with pytest.warns(UserWarning, match=f"not equal the uninterrupted one.*{reason}") as caught:
        _model().fit(data(), epochs=1, verbose=0, callbacks=[callback(tmp_path / "files")])
    assert sum("not equal the uninterrupted" in str(w.message) for w in caught) == 1


def test_no_warning_where_the_resume_is_exact_or_nothing_resumes(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _model().fit(
            DataLoader(_tensors(), batch_size=2, shuffle=True),
            verbose=0,
            callbacks=[BackupAndRestore(tmp_path / "backup")],
        )
        _model().fit(DataLoader(Stream(), batch_size=2), verbose=0)  # nothing to resume from
