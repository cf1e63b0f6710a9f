"""Every process's share of the training data: the same count on each, every item covered.

A rank with one batch more than another waits forever in a collective the
others never join. With 2 processes the padding ``-len % N`` and its
off-by-sign ``len % N`` agree, so only 3 or more processes could show it, and
then as a hang under torchrun; here each rank's share is computed directly.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils.data import Sampler

from hapi.distributed.samplers import ResumableSampler, SamplerShard, strided_share

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


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("length", [0, *LENGTHS])
def test_strided_share_gives_every_rank_as_many_and_covers_every_item(world, length):
    whole = [f"item{i}" for i in range(length + 5)]
    for start in (0, 5):  # the whole order, and what is left of it after 5 items
        rest = whole[start : start + length]
        shares = [strided_share(rest, whole, world, r) for r in range(world)]
        _check_shares(shares, rest, whole, world)
        # rank r's k-th item is the k-th N-item group's r-th: one process's order, strided
        assert [s[k] for k in range(len(rest) // world) for s in shares] == rest[
            : len(rest) // world * world
        ]


class _Dataset(torch.utils.data.Dataset):
    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> int:
        return index


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("shuffle", [False, True])
def test_resumable_sampler_lengths_match_what_each_rank_reads(world, length, shuffle):
    data = _Dataset(length)
    samplers = [
        ResumableSampler(data, num_replicas=world, rank=r, shuffle=shuffle, seed=3)
        for r in range(world)
    ]
    for epoch in (0, 1):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        _check_shares([list(s) for s in samplers], list(range(length)), range(length), world)
        assert all(len(s) == -(-length // world) for s in samplers)
    for skip in range(length):  # a resumed epoch: the rest of the epoch's order
        for sampler in samplers:
            sampler.skip_next(skip)
        lengths = [len(s) for s in samplers]
        order = samplers[0].order()
        shares = [list(s) for s in samplers]
        assert lengths == [len(share) for share in shares]
        _check_shares(shares, order[skip:], order, world)


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
def test_sampler_shard_lengths_match_what_each_rank_reads(world, length):
    user = _Odd(length)
    train = [SamplerShard(user, world, r, seed=5, training=True) for r in range(world)]
    shares = [list(s) for s in train]
    assert [len(s) for s in train] == [len(share) for share in shares]
    _check_shares(shares, user.indices, user.indices, world)
    for skip in range(length):
        for shard in train:
            shard.skip_next(skip)
        lengths = [len(s) for s in train]
        shares = [list(s) for s in train]
        assert lengths == [len(share) for share in shares]
        _check_shares(shares, user.indices[skip:], user.indices, world)
    # evaluation: contiguous, unpadded, each index once
    evaluation = [SamplerShard(user, world, r, seed=5, training=False) for r in range(world)]
    read = [i for s in evaluation for i in s]
    assert read == user.indices
    assert [len(s) for s in evaluation] == [len(list(s)) for s in evaluation]
