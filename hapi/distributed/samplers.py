"""Which samples each process reads: training shards, evaluation shards, resharded loaders.

No collective call here: every process computes its own share from the
same seed, rank and world size.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from hapi.distributed.env import DistributedSetupError
from hapi.distributed.group import rank, world_size


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` that can start its next epoch part-way through.

    A run resumed mid-epoch must read the rest of that epoch in the same
    order without loading the samples it already trained on (loading them
    could draw random numbers in transforms and shift every later draw).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._skip = 0
        # Given to the DataLoader: it draws its workers' base seed from this
        # generator instead of torch's global one, so iterating the data never
        # shifts the random numbers the model draws (dropout), and a resumed
        # epoch gets the same worker seeds.
        self.loader_generator = torch.Generator()
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.loader_generator.manual_seed(self.seed * 7919 + epoch)

    def skip_next(self, samples: int) -> None:
        """Leave out the first ``samples`` indices of the next iteration only."""
        self._skip = samples

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        skip, self._skip = self._skip, 0
        return iter(indices[skip:])


def train_sampler(dataset: Any, shuffle: bool, seed: int) -> ResumableSampler:
    """This process's share of the training data, reshuffled per epoch by ``set_epoch``.

    Every rank gets the same number of samples (the last few are repeated
    to even the shards, as ``DistributedSampler`` does), so all ranks run the
    same number of steps and DDP's collectives line up.
    """
    return ResumableSampler(dataset, num_replicas=world_size(), rank=rank(), shuffle=shuffle,
                            seed=seed, drop_last=False)


class ContiguousShardSampler(Sampler[int]):
    """Rank r's contiguous slice of ``range(n)``: every sample exactly once overall.

    Slices differ in size by at most one, and concatenating them in rank
    order gives back the data-set order, which is how predictions are gathered.
    """

    def __init__(self, length: int, num_replicas: int, rank: int) -> None:
        base, extra = divmod(length, num_replicas)
        self.start = rank * base + min(rank, extra)
        self.stop = self.start + base + (1 if rank < extra else 0)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.stop))

    def __len__(self) -> int:
        return self.stop - self.start


def eval_sampler(dataset: Any) -> Sampler | None:
    """Sampler for evaluation/prediction: no sample twice, none left out."""
    if world_size() == 1:
        return None
    return ContiguousShardSampler(len(dataset), world_size(), rank())


def reshard(loader: DataLoader, training: bool, seed: int) -> DataLoader:
    """A user's DataLoader, rebuilt so this process reads only its share.

    Kept as given on one process, for iterable data sets (they shard
    themselves), and when it already has a ``DistributedSampler`` (or a
    batch sampler that knows epochs, like Paddle's DistributedBatchSampler).
    Otherwise rebuilt with the same batch size, workers, collate function and
    memory pinning, a training sampler seeded for all ranks, or a
    contiguous evaluation shard.
    """
    if world_size() == 1 or isinstance(loader.dataset, torch.utils.data.IterableDataset):
        return loader
    # A DistributedSampler pads shards with repeated samples: fine for training,
    # wrong for evaluation, which is always re-split without duplicates.
    if training and (isinstance(_index_sampler(loader), DistributedSampler)
                     or hasattr(loader.batch_sampler, "set_epoch")):
        return loader
    batch_size = loader_batch_size(loader)
    if batch_size is None:
        raise DistributedSetupError(
            "This DataLoader has a custom batch_sampler without a batch_size, which torch-hapi "
            f"cannot split across {world_size()} processes. Give it a sampler that knows the rank "
            "(e.g. BatchSampler(DistributedSampler(dataset), batch_size, drop_last)), or pass the "
            "Dataset and batch_size to fit()."
        )
    drop_last = loader.drop_last if loader.batch_size is not None else bool(
        getattr(loader.batch_sampler, "drop_last", False))
    shuffle = training and not isinstance(_index_sampler(loader), torch.utils.data.SequentialSampler)
    sampler = train_sampler(loader.dataset, shuffle, seed) if training else eval_sampler(loader.dataset)
    return DataLoader(
        loader.dataset, batch_size=batch_size, sampler=sampler,
        generator=sampler.loader_generator if training else torch.Generator(),
        num_workers=loader.num_workers, collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory, drop_last=drop_last, timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        persistent_workers=loader.persistent_workers and not training,
        prefetch_factor=loader.prefetch_factor if loader.num_workers > 0 else None,
    )


def _index_sampler(loader: DataLoader) -> Any:
    """The sampler of sample indices: the loader's own, or the one inside its batch sampler."""
    if loader.batch_size is None and hasattr(loader.batch_sampler, "sampler"):
        return loader.batch_sampler.sampler
    return loader.sampler


def loader_batch_size(loader: Any) -> int | None:
    """Samples per batch of a DataLoader, also when it was given a ``batch_sampler``."""
    size = getattr(loader, "batch_size", None)
    if size is None:
        size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    return size if isinstance(size, int) else None


def set_seed(loader: Any, seed: int) -> None:
    """Make a sampler torch-hapi built shuffle with ``seed`` (a resumed run's)."""
    if isinstance(getattr(loader, "sampler", None), ResumableSampler):
        loader.sampler.seed = seed
        loader.sampler.set_epoch(loader.sampler.epoch)


def set_epoch(loader: Any, epoch: int) -> None:
    """Tell the sampler which epoch starts, so each epoch reshuffles (all ranks alike)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    samplers = {id(s): s for s in (getattr(loader, "sampler", None), batch_sampler,
                                   getattr(batch_sampler, "sampler", None))}
    for sampler in samplers.values():  # e.g. BatchSampler(DistributedSampler(...)): the inner one
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)


