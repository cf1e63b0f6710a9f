"""Random augmentation in __getitem__ under fit: new noise every epoch, the same noise in a rerun.

Each training batch loads under a seed made from (fit seed, epoch, position,
rank) (hapi.data.SeededDataset). Resume tests compare a resumed run with an
uninterrupted one using the same seeds, where a seed that forgot the epoch
would go unnoticed; every epoch would then repeat epoch 0's augmentation.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from conftest import TinyNet
from torch import nn
from torch.utils.data import Dataset

from hapi import Model
from hapi.data import EpochBatches

SAMPLES = 8
BATCH = 4
EPOCHS = 3


class NoisyData(Dataset):
    """Each sample gets torch, NumPy and Python noise, recorded in the order it is drawn."""

    def __init__(self) -> None:
        self.x = torch.randn(SAMPLES, 4, generator=torch.Generator().manual_seed(0))
        self.y = torch.arange(SAMPLES) % 3
        self.drawn: list[tuple[int, float, float, float]] = []

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int):
        noise = (torch.rand(()).item(), float(np.random.rand()), random.random())
        self.drawn.append((index, *noise))
        return self.x[index] + noise[0], self.y[index]


def _noise_by_epoch() -> list[dict[int, tuple[float, float, float]]]:
    """{index: (torch, numpy, python) noise} for each epoch of one fit."""
    torch.manual_seed(0)  # the fit's seed is drawn from torch's generator
    data = NoisyData()
    model = Model(TinyNet())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    model.fit(data, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    assert len(data.drawn) == SAMPLES * EPOCHS
    return [
        {index: noise for index, *noise in data.drawn[e * SAMPLES : (e + 1) * SAMPLES]}
        for e in range(EPOCHS)
    ]


def test_the_same_sample_gets_new_noise_each_epoch_and_the_same_noise_in_a_second_run():
    first, second = _noise_by_epoch(), _noise_by_epoch()
    assert first == second  # the same (epoch, position): the same draws, for all three libraries
    for index in range(SAMPLES):
        for source in range(3):  # torch, NumPy, Python
            drawn = [epoch[index][source] for epoch in first]
            assert len(set(drawn)) == EPOCHS, (index, source, drawn)


def test_batch_seeds_depend_on_the_epoch_the_position_and_the_rank():
    def seeds(seed=7, epoch=0, rank=0, done=0):
        stream = [[i] for i in range(6)]  # a batch sampler's batches, split over 2 processes
        sampler = EpochBatches(
            lambda *_: stream, 6, batch_size=None, seed=seed, num_replicas=2, rank=rank
        )
        sampler.set_epoch(epoch)
        if done:  # a resumed epoch: the rest of the stream, from batch `done` of each process
            sampler.resume(epoch, stream[2 * done :], stream[:2], done)
        return [b.seed for b in sampler]

    assert seeds() == seeds()
    assert len(set(seeds())) == 3
    assert not set(seeds()) & set(seeds(epoch=1))
    assert not set(seeds()) & set(seeds(rank=1))
    assert not set(seeds()) & set(seeds(seed=8))
    assert seeds(done=1) == seeds()[1:]
