"""hapi.seed_everything on one process: torch's, NumPy's and Python's generators, its errors."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import hapi
from hapi.rng import mix, streams_for_training


def _draws():
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]


def test_on_one_process_it_equals_seeding_each_library_by_hand(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("SLURM_STEP_NUM_TASKS", raising=False)
    assert hapi.seed_everything(123) == 123
    seeded = _draws()
    torch.manual_seed(123)
    np.random.seed(123)
    random.seed(123)
    assert seeded == _draws()


def test_every_rank_is_seeded_alike_and_fit_moves_the_others_to_their_own_stream(monkeypatch):
    """Data made after seeding agrees across ranks; training's draws differ (rank 1 shown)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")  # as torchrun tells the second process, before any Model
    assert hapi.seed_everything(123) == 123
    made = _draws()
    torch.manual_seed(123)
    np.random.seed(123)
    random.seed(123)
    assert made == _draws()  # the same on rank 0 and rank 1: the script's data agrees

    streams_for_training()  # what fit does first
    first_fit = _draws()
    streams_for_training()  # a second fit gets streams of its own
    second_fit = _draws()
    torch.manual_seed(mix(123, 1, 1))
    np.random.seed(mix(123, 1, 1) & 0xFFFFFFFF)
    random.seed(mix(123, 1, 1))
    assert first_fit == _draws() != second_fit

    hapi.seed_everything(123)  # seeding again starts the count again: the same run again
    _draws()
    streams_for_training()
    assert _draws() == first_fit

    hapi.seed_everything(123, per_process=False)
    streams_for_training()  # nothing moves: every process on one stream
    alike = _draws()
    torch.manual_seed(123)
    np.random.seed(123)
    random.seed(123)
    assert alike == _draws()


def test_a_seed_that_is_no_integer_or_out_of_range_is_refused_with_the_fix():
    for seed in (1.5, "7", True, None):
        with pytest.raises(TypeError, match="needs an integer seed; received"):
            hapi.seed_everything(seed)
    for seed in (-1, 2**63):
        with pytest.raises(ValueError, match=r"from 0 to 2\*\*63 - 1; received"):
            hapi.seed_everything(seed)
    assert hapi.seed_everything(np.int64(5)) == 5
    assert hapi.seed_everything(2**40) == 2**40  # NumPy gets the low 32 bits
