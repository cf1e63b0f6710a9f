"""A forward's error names the inputs; it advises about them only when it is about them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hapi import Model

ADVICE = "Check that the data's inputs have the shape and dtype"


class Failing(nn.Module):
    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)
        self.error = error

    def forward(self, x):
        raise self.error


def _fit(network):
    model = Model(network)
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    model.fit((torch.randn(8, 4), torch.zeros(8, dtype=torch.long)), batch_size=4, verbose=0)


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x2)"),
        RuntimeError("expected scalar type Float but found Long"),
        TypeError("forward() takes 2 positional arguments but 3 were given"),
    ],
    ids=["shapes", "dtype", "arguments"],
)
def test_an_error_about_the_inputs_gets_advice_about_them(error):
    with pytest.raises(type(error), match="failed on inputs") as raised:
        _fit(Failing(error))
    assert ADVICE in str(raised.value) and "Failing" in str(raised.value)


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError(
            "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"
        ),
        RuntimeError("Tensor shared with a parameter already managed by another FSDP group"),
        ValueError("my own check failed"),
    ],
    ids=["gloo", "fsdp", "own"],
)
def test_an_error_not_about_the_inputs_does_not_blame_them(error):
    with pytest.raises(type(error), match="failed on inputs") as raised:
        _fit(Failing(error))
    assert ADVICE not in str(raised.value)
    assert str(error) in str(raised.value)
