"""What fit, evaluate and predict draw from the global generators: nothing a run does not need.

A fit draws one int64 from torch's global generator when it starts, and only when it shuffles
or its data set may draw random numbers while loading (hapi/data.py); evaluate and predict
draw nothing. So a network with dropout trained by fit(shuffle=False) equals a hand loop
seeded alike, weights bit for bit.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from conftest import make_tiny_data
from torch import nn
from torch.utils.data import DataLoader, Dataset

from hapi import Model


class DropNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(4, 32)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(torch.relu(self.hidden(x))))


class Pairs(Dataset):
    """A data set of one's own: torch-hapi cannot know that loading it draws nothing."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        return self.x[index], self.y[index]


class QuietPairs(Pairs):
    draws_random_numbers = False  # says so: its batches need no seeds, and no seed is drawn


def _states() -> tuple:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()


def _same_states(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0], b[0]) and a[1] == b[1] and np.array_equal(a[2], b[2])


def _weights(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


def _hand_loop(batches, epochs: int = 2):
    """The reference: a network built after manual_seed(0), trained after manual_seed(7)."""
    torch.manual_seed(0)
    network = DropNet()
    optimizer = torch.optim.SGD(network.parameters(), lr=0.1)
    torch.manual_seed(7)
    for _ in range(epochs):
        network.train()
        for xb, yb in batches():
            loss = nn.functional.cross_entropy(network(xb), yb)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return network, _states()


def _model() -> Model:
    torch.manual_seed(0)
    model = Model(DropNet())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    return model


X, Y = make_tiny_data(50)


@pytest.mark.parametrize(
    "data",
    [(X, Y), list(zip(X, Y)), QuietPairs(X, Y)],
    ids=["tensors", "list-of-samples", "quiet-dataset"],
)
def test_fit_without_shuffle_trains_dropout_like_a_hand_loop_seeded_alike(data):
    """The old code drew the data seed anyway: the dropout masks moved by one draw."""
    network, after = _hand_loop(lambda: zip(X.split(16), Y.split(16)))
    model = _model()
    torch.manual_seed(7)
    model.fit(data, eval_data=(X, Y), batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert torch.equal(_weights(model.network), _weights(network))
    assert _same_states(_states(), after)  # dropout drew the same, and nothing else was drawn


def test_a_dataloader_of_ones_own_draws_in_fit_what_it_draws_in_a_hand_loop():
    """One process, the loader used as given: its RandomSampler draws its seed each epoch from
    the global generator, in fit as in a hand loop; the old code drew one number more first."""
    loader = DataLoader(Pairs(X, Y), batch_size=16, shuffle=True)
    network, after = _hand_loop(lambda: loader)
    model = _model()
    torch.manual_seed(7)
    model.fit(loader, batch_size=16, epochs=2, verbose=0)
    assert torch.equal(_weights(model.network), _weights(network))
    assert _same_states(_states(), after)


@pytest.mark.parametrize("data", [(X, Y), Pairs(X, Y)], ids=["tensors", "dataset"])
def test_evaluate_and_predict_leave_the_global_generators_untouched(data):
    model = _model()
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    before = _states()
    model.evaluate(data, batch_size=16, verbose=0)
    model.predict(data, batch_size=16, verbose=0)
    assert _same_states(_states(), before)


def _after_one_draw(seed: int) -> tuple:
    """The states after the one number a fit draws: an int64 in [0, 2**31 - 1) from torch's."""
    torch.manual_seed(seed)
    torch.randint(0, 2**31 - 1, (), dtype=torch.int64)
    return _states()


@pytest.mark.parametrize(
    "data, shuffle",
    [((X, Y), True), (Pairs(X, Y), True), (Pairs(X, Y), False)],
    ids=["tensors-shuffled", "dataset-shuffled", "dataset-that-may-draw"],
)
def test_a_fit_that_needs_a_seed_draws_exactly_one_number_from_torch(data, shuffle):
    """Shuffling needs the seed; so does a data set that may draw random numbers while loading
    (its batches load under seeds made from it), also without shuffling."""
    model = Model(nn.Linear(4, 3))  # no dropout: whatever moves the generator is the fit's own
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    expected = _after_one_draw(7)
    torch.manual_seed(7)
    model.fit(data, eval_data=data, batch_size=16, epochs=2, shuffle=shuffle, verbose=0)
    assert torch.equal(_states()[0], expected[0])
