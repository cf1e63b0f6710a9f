"""Several outputs: a loss and metrics per output (Keras' lists), and errors that name what was received."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_data
from torch import nn

from hapi import Model
from hapi.metrics import Accuracy


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 16)
        self.classes = nn.Linear(16, 3)
        self.size = nn.Linear(16, 1)

    def forward(self, x):
        hidden = torch.relu(self.body(x))
        return self.classes(hidden), self.size(hidden).squeeze(1)


def _data(n=40):
    x, y = make_tiny_data(n)
    return x, y, x.norm(dim=1)


def _model():
    torch.manual_seed(0)
    return Model(TwoHeads(), inputs=1, labels=2)


def test_a_loss_and_metrics_per_output_train_like_a_hand_loop_and_log_each_part():
    x, y, size = _data()
    model = _model()
    model.prepare(
        torch.optim.SGD(model.parameters(), lr=0.1),
        loss=[nn.CrossEntropyLoss(), nn.MSELoss()],
        loss_weights=[1.0, 0.5],
        metrics=[[Accuracy()], []],
    )
    history = model.fit((x, y, size), batch_size=10, epochs=1, shuffle=False, verbose=0)

    torch.manual_seed(0)
    network = TwoHeads()
    optimizer = torch.optim.SGD(network.parameters(), lr=0.1)
    sums = [0.0, 0.0]
    for xb, yb, sb in zip(x.split(10), y.split(10), size.split(10)):
        classes, predicted = network(xb)
        parts = [nn.functional.cross_entropy(classes, yb), nn.functional.mse_loss(predicted, sb)]
        (parts[0] + 0.5 * parts[1]).backward()
        optimizer.step()
        optimizer.zero_grad()
        sums = [total + part.item() * len(xb) for total, part in zip(sums, parts)]
    for mine, theirs in zip(model.parameters(), network.parameters()):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=0)
    assert set(history.history) == {
        "loss",
        "output_0_loss",
        "output_1_loss",
        "output_0_acc",
        "lr",
    }
    assert history.history["output_0_loss"][0] == pytest.approx(sums[0] / 40, rel=1e-5)
    assert history.history["output_1_loss"][0] == pytest.approx(sums[1] / 40, rel=1e-5)
    assert history.history["loss"][0] == pytest.approx((sums[0] + 0.5 * sums[1]) / 40, rel=1e-5)
    figures = model.evaluate((x, y, size), batch_size=15, verbose=0)
    with torch.no_grad():
        classes, _ = model.network(x)
    assert figures["output_0_acc"] == pytest.approx((classes.argmax(1) == y).float().mean().item())


def test_a_metric_given_two_outputs_says_what_it_received_and_how_to_give_one_per_output():
    x, y, size = _data(10)
    model = _model()
    model.prepare(
        torch.optim.SGD(model.parameters(), lr=0.1),
        loss=[nn.CrossEntropyLoss(), nn.MSELoss()],
        metrics=Accuracy(),
    )
    with pytest.raises(
        TypeError,
        match=r"The metric 'acc' \(Accuracy\) failed on outputs \(float32\[10, 3\], "
        r"float32\[10\]\) and labels \(int64\[10\], float32\[10\]\).*"
        r"metrics=\[\[metrics of output 0\]",
    ):
        model.fit((x, y, size), batch_size=10, verbose=0)


def test_losses_that_do_not_match_the_outputs_are_explained():
    x, y, size = _data(10)
    model = _model()
    model.prepare(
        torch.optim.SGD(model.parameters(), lr=0.1),
        loss=[nn.CrossEntropyLoss(), nn.MSELoss(), nn.MSELoss()],
    )
    with pytest.raises(ValueError, match=r"3 losses, one per output, but a batch gave 2 outputs"):
        model.fit((x, y, size), batch_size=10, verbose=0)
    with pytest.raises(ValueError, match=r"loss_weights has 1 entries for 2 losses"):
        model.prepare(loss=[nn.CrossEntropyLoss(), nn.MSELoss()], loss_weights=[1.0])
    with pytest.raises(ValueError, match=r"loss_weights weighs per-output losses"):
        model.prepare(loss=nn.CrossEntropyLoss(), loss_weights=[1.0])
