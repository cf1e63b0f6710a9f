"""hapi/data.py's TrainData: the position a checkpoint keeps of an epoch, and resuming from it.

Driven directly (no fit, no files): an epoch read part-way, its position taken as a
checkpoint takes it, and a new ``TrainData`` of the same data resumed from it, as the
resume of another run of the script would be.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from hapi.data import TrainData, make_loader


class Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.arange(20).unsqueeze(1).float())


def _train_data(data, seed=5):
    loader = make_loader(data, role="train_data", batch_size=4, seed=seed)
    return TrainData(loader, data, seed)


def _values(batches) -> list[list[int]]:
    return [
        [int(v) for v in (b[0] if isinstance(b, (list, tuple)) else b).flatten()] for b in batches
    ]


def _read(train, epoch: int, batches: int | None = None) -> list[list[int]]:
    iterator = iter(train.epoch(epoch))
    read = []
    for batch in iterator:
        read.append(batch)
        if batches is not None and len(read) == batches:
            break
    return _values(read)


def test_an_iterable_dataset_resumed_mid_epoch_reads_the_rest_once_not_the_whole():
    whole = _read(_train_data(Stream()), 0)
    first = _train_data(Stream())
    assert _read(first, 0, 3) == whole[:3]
    shared, own = first.position(3)
    again = _train_data(Stream())
    step, outcome, reason = again.resume(shared, own, own, 0, 3)
    assert (step, outcome) == (3, "inexact") and "IterableDataset" in reason
    assert _read(again, 0) == whole[3:]  # the batches already trained are not trained again


def test_a_batch_sampler_of_torch_reads_in_samples_when_the_world_changes():
    """A rest written in samples (a 2-process run) continues a DataLoader given torch's
    BatchSampler on one process, as it continues the same loader written with batch_size."""
    data = (torch.arange(24).unsqueeze(1).float(), torch.zeros(24, dtype=torch.long))
    dataset = torch.utils.data.TensorDataset(*data)
    rest = list(range(10, 24))
    shared = {"kind": "batches", "world": 2, "rest": rest, "padding": [0, 1]}
    for loader in (
        DataLoader(dataset, batch_size=4, shuffle=True),
        DataLoader(dataset, batch_sampler=BatchSampler(RandomSampler(dataset), 4, False)),
    ):
        train = TrainData(make_loader(loader, role="train_data", batch_size=4, seed=5), loader, 5)
        step, outcome, _ = train.resume(shared, None, {"generators": {}}, 1, 3)
        assert (step, outcome) == (0, "split")
        assert sorted(i for batch in _read(train, 1) for i in batch) == rest


def test_a_later_file_at_an_epochs_start_wins_over_an_earlier_one_mid_epoch():
    data = (torch.arange(20).unsqueeze(1).float(), torch.zeros(20, dtype=torch.long))
    first = _train_data(data)
    _read(first, 2, 3)
    shared, own = first.position(3)
    train = _train_data(data)
    assert train.resume(shared, own, own, 2, 3)[:2] == (3, "exact")  # resume_from's file
    boundary, _ = first.position(0)
    assert train.resume(boundary, own, own, 2, 0)[:2] == (0, "exact")  # then the backup's
    assert len(_read(train, 2)) == 5 == train.steps  # epoch 2 whole, its last batch marked


@pytest.mark.parametrize("seed", [5, 6])
def test_a_resumed_epoch_on_as_many_processes_reads_what_the_uninterrupted_one_read(seed):
    data = (torch.arange(20).unsqueeze(1).float(), torch.zeros(20, dtype=torch.long))
    whole = _read(_train_data(data, seed), 1)
    first = _train_data(data, seed)
    _read(first, 1, 2)
    shared, own = first.position(2)
    again = _train_data(data, seed)
    assert again.resume(shared, own, own, 1, 2)[:2] == (2, "exact")
    assert _read(again, 1) == whole[2:] and again.steps == len(whole)


def test_a_rest_in_other_units_restarts_the_epoch_and_a_mixed_one_is_refused():
    """Whole batches where this run reads samples (a changed DataLoader, or a crafted file)
    restart the epoch instead of failing batches later; a mix of the two is no run's."""
    data = (torch.arange(20).unsqueeze(1).float(), torch.zeros(20, dtype=torch.long))
    first = _train_data(data)
    _read(first, 0, 2)
    shared, own = first.position(2)
    batches = _train_data(data)
    step, outcome, reason = batches.resume(dict(shared, rest=[[1, 2], [3]]), own, own, 0, 2)
    assert (step, outcome) == (0, "restart") and "other units" in reason
    assert len(_read(batches, 0)) == 5
    with pytest.raises(ValueError, match="'rest' mixes sample indices and batches"):
        _train_data(data).resume(dict(shared, rest=[1, [2, 3]]), own, own, 0, 2)


@pytest.mark.parametrize("given", [False, True], ids=["own loader", "users DataLoader"])
def test_a_rest_without_its_padding_is_refused_before_anything_is_read(given):
    """No run writes 'rest' without 'padding' (the samples that even out the processes'
    shares): such a position is refused by name, whichever loader would read it."""
    data = (torch.arange(20).unsqueeze(1).float(), torch.zeros(20, dtype=torch.long))
    if given:
        data = DataLoader(torch.utils.data.TensorDataset(*data), batch_size=4, shuffle=True)
    first = _train_data(data)
    _read(first, 0, 2)
    shared, own = first.position(2)
    crafted = dict(shared, world=2, rest=shared.get("rest", [3, 4]))
    crafted.pop("padding", None)
    with pytest.raises(ValueError, match="'padding' is missing beside 'rest'"):
        _train_data(data).resume(crafted, own, own, 0, 2)
