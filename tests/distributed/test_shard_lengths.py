"""Every process's share of the training data: the same count on each, every item covered.

A rank with one batch more than another waits forever in a collective the
others never join. With 2 processes the padding ``-len % N`` and its
off-by-sign ``len % N`` agree, so only 3 or more processes could show it, and
then as a hang under torchrun; here each rank's share is computed directly.
"""

from __future__ import annotations

from collections import Counter

import pytest
from torch.utils.data import Sampler

from hapi.data import EpochBatches, permutation, user_stream

WORLDS = [2, 3, 4]
LENGTHS = [1, 2, 3, 4, 5, 6, 7, 10, 11, 13]


def _check_shares(shares: list[list], expected_items: list, whole: list, world: int) -> None:
    """Equal counts, ceil(len/N) each; every expected item read; the padding from ``whole``."""
    count = -(-len(expected_items) // world)
    assert [len(share) for share in shares] == [count] * world
    read = Counter(item for share in shares for item in share)
    padding = read - Counter(expected_items)
    assert read - padding == Counter(expected_items)  # each item once, beside the padding
    assert padding.total() == count * world - len(expected_items)  # at most N-1 repeats
    assert set(padding) <= set(whole)


def _samplers(draw, length: int, world: int, training: bool = True) -> list[EpochBatches]:
    return [
        EpochBatches(
            draw, length, batch_size=1, seed=3, training=training, num_replicas=world, rank=r
        )
        for r in range(world)
    ]


def _read(sampler: EpochBatches) -> list:
    return [index for batch in sampler for index in batch]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("shuffle", [False, True])
def test_shares_and_lengths_match_what_each_rank_reads_also_for_a_resumed_rest(
    world, length, shuffle
):
    samplers = _samplers(permutation(length, shuffle), length, world)
    for epoch in (0, 1):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        order = samplers[0].stream()
        shares = [_read(s) for s in samplers]
        _check_shares(shares, order, order, world)
        assert [len(s) for s in samplers] == [len(share) for share in shares]
        # rank r's k-th item is the k-th N-item group's r-th: one process's order, strided
        assert [s[k] for k in range(length // world) for s in shares] == order[
            : length // world * world
        ]
    for done in range(length):  # a resumed epoch: the rest of the epoch's order
        for sampler in samplers:
            sampler.resume(1, order[done:], order[:world], done)
        shares = [_read(s) for s in samplers]
        assert [len(s) for s in samplers] == [len(share) for share in shares]
        _check_shares(shares, order[done:], order, world)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("batches", [1, 2, 3])
def test_a_rest_resumed_on_as_many_processes_reads_what_the_uninterrupted_run_read(world, batches):
    length, size = 23, 2
    draw = permutation(length, True)
    whole = [
        EpochBatches(draw, length, batch_size=size, seed=9, num_replicas=world, rank=r)
        for r in range(world)
    ]
    uninterrupted = [[list(b) for b in s] for s in whole]
    state = whole[0].state(batches)
    resumed = [
        EpochBatches(draw, length, batch_size=size, seed=9, num_replicas=world, rank=r)
        for r in range(world)
    ]
    for r, sampler in enumerate(resumed):
        sampler.resume(0, state["rest"], state["padding"], batches)
        assert [list(b) for b in sampler] == uninterrupted[r][batches:]
        # each batch loads under the seed of its position in the epoch
        assert [b.seed for b in sampler] == [b.seed for b in whole[r]][batches:]


class _Odd(Sampler[int]):
    """A user's sampler with its own order (odd indices, reversed)."""

    def __init__(self, length: int) -> None:
        self.indices = list(range(2 * length))[1::2][::-1]

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("length", LENGTHS)
def test_a_users_sampler_is_split_in_training_and_read_once_in_evaluation(world, length):
    user = _Odd(length)
    train = _samplers(user_stream(user), length, world)
    shares = [_read(s) for s in train]
    assert [len(s) for s in train] == [len(share) for share in shares]
    _check_shares(shares, user.indices, user.indices, world)
    for done in range(length):
        for shard in train:
            shard.resume(0, user.indices[done:], user.indices[:world], done)
        shares = [_read(s) for s in train]
        assert [len(s) for s in train] == [len(share) for share in shares]
        _check_shares(shares, user.indices[done:], user.indices, world)
    # evaluation: contiguous, unpadded, each index once
    evaluation = _samplers(user_stream(user), length, world, training=False)
    assert [i for s in evaluation for i in _read(s)] == user.indices
    assert [len(s) for s in evaluation] == [len(_read(s)) for s in evaluation]


def test_evaluating_with_a_rank_aware_batch_sampler_without_drop_last(monkeypatch):
    """A batch sampler that knows epochs (Paddle's DistributedBatchSampler style) but has no
    drop_last is read for evaluation in samples, none dropped."""
    import torch

    from hapi.data import reshard
    from hapi.distributed import group

    class EpochAwareBatches:
        batch_size = 2

        def set_epoch(self, epoch):
            pass

        def __iter__(self):
            return iter([[0, 1], [2, 3]])

        def __len__(self):
            return 2

    monkeypatch.setattr(group, "world_size", lambda: 2)
    monkeypatch.setattr(group, "rank", lambda: 1)
    dataset = torch.utils.data.TensorDataset(torch.arange(5))
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=EpochAwareBatches())
    share = reshard(loader, training=False, seed=0)
    assert share.batch_size == 2 and share.drop_last is False
    assert list(share) == [[3, 4]]
