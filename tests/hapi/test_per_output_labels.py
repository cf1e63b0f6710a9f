"""Per-output metrics score each output against its own label, not label 0.

tests/hapi/test_per_output.py gives output 1 no metric, so a metric scored
against the first label would pass there. Here output 1's label differs
from output 0's on every sample, and each output predicts its own label
exactly: scoring against the wrong label gives 0 instead of 1.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_data
from torch import nn

from hapi import Model
from hapi.metrics import Accuracy


class ShiftedHeads(nn.Module):
    """Output 0: the first three features (argmax = label 0); output 1: them rolled by one class."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))  # something for the optimizer; lr=0 keeps it

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = x[:, :3] * self.scale
        return scores, scores.roll(1, dims=1)


def _data(n: int = 30) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, first = make_tiny_data(n)  # first = argmax of x[:, :3]
    return x, first, (first + 1) % 3  # argmax of the rolled scores: never equal to first


def _model() -> Model:
    model = Model(ShiftedHeads(), inputs=1, labels=2)
    model.prepare(
        torch.optim.SGD(model.parameters(), lr=0.0),
        loss=[nn.CrossEntropyLoss(), nn.CrossEntropyLoss()],
        metrics=[[Accuracy()], [Accuracy()]],
    )
    return model


def test_each_outputs_metric_uses_its_own_label_in_fit_and_evaluate():
    x, first, second = _data()
    assert bool((first != second).all())
    model = _model()
    history = model.fit((x, first, second), batch_size=10, epochs=1, shuffle=False, verbose=0)
    assert history.history["output_0_acc"] == [pytest.approx(1.0)]
    assert history.history["output_1_acc"] == [pytest.approx(1.0)]  # 0.0 against label 0
    figures = model.evaluate((x, first, second), batch_size=7, verbose=0)
    assert figures["output_0_acc"] == pytest.approx(1.0)
    assert figures["output_1_acc"] == pytest.approx(1.0)


def test_swapped_labels_give_zero_for_both_outputs():
    # The same model with the labels exchanged: each output now faces the other's label.
    x, first, second = _data()
    figures = _model().evaluate((x, second, first), batch_size=10, verbose=0)
    assert figures["output_0_acc"] == pytest.approx(0.0)
    assert figures["output_1_acc"] == pytest.approx(0.0)
