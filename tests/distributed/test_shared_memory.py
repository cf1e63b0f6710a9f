"""The shared-memory gradient average, seen from one process: the sum, the wait, the file."""

from __future__ import annotations

import os

import pytest
import torch

from hapi.distributed.shared_memory import SharedMemoryAllReduce, reserve


@pytest.fixture
def rank_0_of_2():
    """Rank 0's state on a freshly reserved buffer; the test plays rank 1 by writing its row."""
    path = reserve(numel=4, world=2)
    assert path is not None and os.path.getsize(path) == 2 * 2 * 4 * 4 + 64 * 2
    state = SharedMemoryAllReduce(path, numel=4, rank=0, world=2, timeout_s=0.2)
    os.unlink(path)  # as hapi.distributed does once every process has mapped it
    return state


def test_the_average_is_over_every_rank_in_rank_order(rank_0_of_2):
    state = rank_0_of_2
    state.rows[1, 1] = torch.tensor([3.0, 5.0, 7.0, 9.0])  # rank 1's gradients for call 1 (half 1)
    state.published[1, 0] = 1
    gradients = torch.tensor([1.0, 1.0, 1.0, 1.0])
    assert state.average(gradients) is gradients  # averaged in place, as DDP's bucket expects
    assert gradients.tolist() == [2.0, 3.0, 4.0, 5.0]
    assert state.published[0, 0] == 1  # rank 0 published its call


def test_a_rank_that_never_arrives_is_named_after_the_timeout(rank_0_of_2):
    with pytest.raises(RuntimeError, match=r"gradients of rank\(s\) \[1\].*HAPI_DIST_TIMEOUT"):
        rank_0_of_2.average(torch.ones(4))


def test_no_room_for_the_buffer_leaves_no_file(monkeypatch, tmp_path):
    from hapi.distributed import shared_memory

    monkeypatch.setattr(shared_memory, "_shm_dir", lambda: str(tmp_path))
    monkeypatch.setattr(os, "posix_fallocate", lambda *args: (_ for _ in ()).throw(OSError(28, "full")))
    assert reserve(numel=4, world=2) is None
    assert list(tmp_path.iterdir()) == []
