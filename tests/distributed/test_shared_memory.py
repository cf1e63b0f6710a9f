"""The shared-memory gradient average: its wait gives up with a clear error."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch

from hapi.shared_memory import SharedMemoryAllReduce


def _two_rank_state(timeout_s: float) -> SharedMemoryAllReduce:
    """Rank 0 of two, on private memory: what the constructor builds, minus the process group."""
    state = SharedMemoryAllReduce.__new__(SharedMemoryAllReduce)  # skips mapping a file
    state.world, state.rank, state.timeout_s, state.calls = 2, 0, timeout_s, 0
    state._mapping = mmap.mmap(-1, 2 * 2 * 4 * 4 + 64 * 2)
    state.rows = torch.from_numpy(np.ndarray((2, 2, 4), np.float32, buffer=state._mapping))
    state.published = np.ndarray((2, 8), np.int64, buffer=state._mapping, offset=2 * 2 * 4 * 4)
    return state


def test_the_average_is_over_every_rank_in_rank_order():
    state = _two_rank_state(timeout_s=5)
    state.rows[1, 1] = torch.tensor([3.0, 5.0, 7.0, 9.0])  # rank 1's gradients for call 1 (half 1)
    state.published[1, 0] = 1
    gradients = torch.tensor([1.0, 1.0, 1.0, 1.0])
    assert state.average(gradients) is gradients  # averaged in place, as DDP's bucket expects
    assert gradients.tolist() == [2.0, 3.0, 4.0, 5.0]
    assert state.published[0, 0] == 1  # rank 0 published its call


def test_a_rank_that_never_arrives_is_named_after_the_timeout():
    state = _two_rank_state(timeout_s=0.2)
    with pytest.raises(RuntimeError, match=r"waited 0 s for the gradients of rank\(s\) \[1\].*HAPI_DIST_TIMEOUT"):
        state.average(torch.ones(4))
