"""Which samples each process reads: training and evaluation shards, resharded loaders.

No collective call here: every process computes its own share from the
same seed, rank and world size (and, for a user's sampler, the same stream
drawn under the same seed).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from hapi.distributed import group
from hapi.distributed.env import DistributedSetupError
from hapi.rng import mix, seeded_streams


class SeededIndices(list):
    """One batch's sample indices, with the seed its loading draws from (see
    :class:`hapi.data.SeededDataset`)."""

    seed: int


class EpochBatches(Sampler[list]):
    """The batch sampler of every training loader torch-hapi builds: this process's batches.

    Each epoch's *stream* -- the order of its units, sample indices or whole
    batches of a user's batch sampler -- is drawn once, alike on every
    process, by ``draw(seed, epoch)``. Process r of N reads units r, r+N, ...
    of the stream (padded with its first units to a multiple of N, so every
    process runs as many steps, as ``DistributedSampler`` does), in batches of
    ``batch_size`` units (``None``: each unit is a batch). Together the N
    processes' k-th batches are then the stream's k-th N*b units, as one
    process at batch N*b reads them; after k steps the stream's first k*N*b
    units are done, whatever N. A checkpoint keeps the rest of the stream
    (:meth:`state`); :meth:`resume` serves it in the next pass, split over
    the processes there are then, and each remaining unit is read once.

    Each batch carries the seed its loading draws from, made from (seed,
    epoch, position of the batch in the epoch, rank), so a resumed run loads
    its batches with the random numbers the uninterrupted run drew.

    Evaluation shares (``training=False``) are contiguous and unpadded: no
    unit twice, and predictions gathered in rank order come back in stream
    order. Their stream is drawn at every pass.

    ``num_replicas`` and ``rank`` default to the job's.
    """

    def __init__(
        self,
        draw: Callable[[int, int], list],
        length: int,
        *,
        batch_size: int | None,
        drop_last: bool = False,
        seed: int = 0,
        training: bool = True,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        self.draw, self.units = draw, length  # units: the stream's length in a new epoch
        self.batch_size, self.drop_last, self.seed, self.training = (
            batch_size,
            drop_last,
            seed,
            training,
        )
        self.num_replicas = group.world_size() if num_replicas is None else num_replicas
        self.rank = group.rank() if rank is None else rank
        # The DataLoader draws its workers' base seed from this generator, not torch's global
        # one: iterating the data never shifts the numbers the model draws (dropout), and a
        # resumed epoch gets the same worker seeds.
        self.loader_generator = torch.Generator()
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        """A new epoch: its stream is drawn at the next pass."""
        self.epoch, self.first_position, self.length = epoch, 0, self.units
        self._stream: list | None = None
        self._padding: list | None = None  # units that pad the stream (a resumed one's head)
        self.loader_generator.manual_seed(mix(self.seed, epoch))

    def resume(self, epoch: int, rest: list, padding: list, position: int) -> None:
        """Serve ``rest`` of epoch ``epoch``'s stream in the next pass, its first batch at
        ``position`` of the epoch, padded from ``padding`` (the stream's first units)."""
        self.set_epoch(epoch)
        self._stream, self._padding, self.first_position = list(rest), list(padding), position
        self.length = len(rest)

    def stream(self) -> list:
        """This epoch's stream (what is left of it, in a resumed epoch)."""
        if self._stream is None or not self.training:
            self._stream = self.draw(self.seed, self.epoch)
            if len(self._stream) != self.length:
                raise DistributedSetupError(
                    f"The DataLoader's sampler says it has {self.length} items (__len__) but "
                    f"yielded {len(self._stream)}; torch-hapi splits its items across "
                    f"{self.num_replicas} processes by that length. Make __len__ match what "
                    "__iter__ yields."
                )
        return self._stream

    def _share(self, stream: list) -> list:
        if not self.training:
            start, stop = contiguous_range(len(stream), self.num_replicas, self.rank)
            return stream[start:stop]
        pool = (stream if self._padding is None else self._padding + stream) or [None]
        padded = stream + [pool[i % len(pool)] for i in range(-len(stream) % self.num_replicas)]
        return padded[self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[list]:
        share = self._share(self.stream())
        size = self.batch_size
        batches = (
            share if size is None else [share[i : i + size] for i in range(0, len(share), size)]
        )
        if size is not None and self.drop_last and batches and len(batches[-1]) < size:
            batches.pop()
        for position, batch in enumerate(batches, start=self.first_position):
            tagged = SeededIndices(batch)
            tagged.seed = mix(self.seed, self.epoch, position, self.rank)
            yield tagged

    def __len__(self) -> int:
        if self.training:
            share = -(-self.length // self.num_replicas)
        else:
            start, stop = contiguous_range(self.length, self.num_replicas, self.rank)
            share = stop - start
        if self.batch_size is None:
            return share
        return share // self.batch_size if self.drop_last else -(-share // self.batch_size)

    def state(self, batches: int) -> dict[str, Any]:
        """What is left of the epoch's stream after ``batches`` steps of this pass, and the
        units that pad it (what :meth:`resume` takes)."""
        stream = self.stream()
        done = batches * self.num_replicas * (self.batch_size or 1)
        padding = stream if self._padding is None else self._padding
        return {"rest": stream[done:], "padding": padding[: self.num_replicas]}


def contiguous_range(length: int, num_replicas: int, rank: int) -> tuple[int, int]:
    """Rank r's contiguous slice of ``range(length)``: sizes differ by at most one, and the
    slices in rank order give back the whole, in order."""
    base, extra = divmod(length, num_replicas)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


class ContiguousShardSampler(Sampler[int]):
    """Rank r's contiguous slice of ``range(n)``: every sample exactly once overall, and
    concatenating the slices in rank order gives back the data-set order, which is how
    predictions are gathered."""

    def __init__(self, length: int, num_replicas: int, rank: int) -> None:
        self.start, self.stop = contiguous_range(length, num_replicas, rank)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.stop))

    def __len__(self) -> int:
        return self.stop - self.start


def permutation(length: int, shuffle: bool) -> Callable[[int, int], list]:
    """The stream of torch-hapi's own shuffle: a permutation of ``range(length)`` seeded by
    (seed, epoch), as ``DistributedSampler`` draws it; ``range(length)`` without shuffling."""

    def draw(seed: int, epoch: int) -> list:
        if not shuffle:
            return list(range(length))
        return torch.randperm(
            length, generator=torch.Generator().manual_seed(seed + epoch)
        ).tolist()

    return draw


def user_stream(source: Any) -> Callable[[int, int], list]:
    """The stream of a user's (batch) sampler: drawn under random streams seeded by (seed,
    epoch), so that every process draws the same one."""

    def draw(seed: int, epoch: int) -> list:
        if hasattr(source, "set_epoch"):
            source.set_epoch(epoch)
        with seeded_streams(mix(seed, epoch, 0x5A3)):
            return list(source)

    return draw


def train_sampler(
    dataset: Any, shuffle: bool, seed: int, batch_size: int, drop_last: bool
) -> EpochBatches:
    """This process's batches of the training data, reshuffled per epoch by ``set_epoch``."""
    return EpochBatches(
        permutation(len(dataset), shuffle),
        len(dataset),
        batch_size=batch_size,
        drop_last=drop_last,
        seed=seed,
    )


def eval_sampler(dataset: Any) -> Sampler | None:
    """Sampler for evaluation/prediction: no sample twice, none left out."""
    if group.world_size() == 1:
        return None
    return ContiguousShardSampler(len(dataset), group.world_size(), group.rank())


def _length(sampler: Any, what: str) -> int:
    try:
        return len(sampler)
    except TypeError:
        raise DistributedSetupError(
            f"The DataLoader's {what} {type(sampler).__name__} has no length, so torch-hapi cannot "
            f"split what it yields across {group.world_size()} processes (it may never end). Give it a "
            "__len__, or give the DataLoader a sampler that knows the rank (e.g. "
            "DistributedSampler) and keep the same number of batches on every process."
        ) from None


def reshard(loader: DataLoader, training: bool, seed: int) -> dict | None:
    """How to rebuild a user's DataLoader so this process reads only its share.

    ``None`` keeps the loader as given: on one process, for iterable data
    sets (they shard themselves), and for training when it already knows
    the rank (a ``DistributedSampler``, or a batch sampler that knows epochs,
    like Paddle's DistributedBatchSampler). Otherwise the DataLoader keyword
    arguments that pick this process's share, which keeps the meaning of the
    user's sampler:

    * torch's plain orders (``SequentialSampler``, ``RandomSampler`` without
      replacement) become a seeded shard of the whole data set, for
      evaluation a contiguous one (no sample twice, none left out);
    * any other sampler (``SubsetRandomSampler``, ``WeightedRandomSampler``,
      the user's own) is kept, and the indices it yields are split across
      the processes (:class:`EpochBatches` over its stream);
    * a batch sampler of the user's own (not torch's ``BatchSampler``) is
      kept whole, and its batches are split.

    Raises:
        DistributedSetupError: the sampler cannot be split (no length).
    """
    if group.world_size() == 1 or isinstance(loader.dataset, IterableDataset):
        return None
    batches = loader.batch_sampler  # None when the user turned automatic batching off
    inner = index_sampler(loader)
    rank_aware = isinstance(inner, DistributedSampler) or hasattr(batches, "set_epoch")
    if training and rank_aware:
        return None
    if loader.batch_size is None and batches is not None and not isinstance(batches, BatchSampler):
        if not rank_aware:
            return {
                "batch_sampler": EpochBatches(
                    user_stream(batches),
                    _length(batches, "batch_sampler"),
                    batch_size=None,
                    seed=seed,
                    training=training,
                )
            }
    batch_size = loader_batch_size(loader)
    if batches is None:
        raise DistributedSetupError(
            "This DataLoader was built with batch_size=None (no automatic batching), so its items "
            f"are whole batches that torch-hapi cannot split across {group.world_size()} processes. Give "
            "it a batch_size, or a batch_sampler (torch-hapi then deals its batches out whole)."
        )
    if batch_size is None:
        raise DistributedSetupError(
            "This DataLoader has a rank-aware batch_sampler without a batch_size, which torch-hapi "
            f"cannot split across {group.world_size()} processes. Give it a sampler that knows the rank "
            "(e.g. BatchSampler(DistributedSampler(dataset), batch_size, drop_last)), or pass the "
            "Dataset and batch_size to fit()."
        )
    drop_last = (
        loader.drop_last
        if loader.batch_size is not None
        else bool(getattr(batches, "drop_last", False))
    )
    if rank_aware or _plain_order(inner):
        if not training:
            sampler = eval_sampler(loader.dataset)
            return {"sampler": sampler, "batch_size": batch_size, "drop_last": drop_last}
        shuffle = isinstance(inner, RandomSampler)
        return {
            "batch_sampler": train_sampler(loader.dataset, shuffle, seed, batch_size, drop_last)
        }
    sampler = EpochBatches(
        user_stream(inner),
        _length(inner, "sampler"),
        batch_size=batch_size,
        drop_last=drop_last,
        seed=seed,
        training=training,
    )
    return {"batch_sampler": sampler}


def _plain_order(sampler: Any) -> bool:
    """torch's default orders, which a seeded shard of the whole data set reproduces."""
    if type(sampler) is SequentialSampler:
        return True
    return (
        type(sampler) is RandomSampler
        and not sampler.replacement
        and sampler.num_samples == len(sampler.data_source)
    )


def index_sampler(loader: DataLoader) -> Any:
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


def set_epoch(loader: Any, epoch: int) -> None:
    """Tell the samplers which epoch starts, so each epoch reshuffles (all ranks alike)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    samplers = {
        id(s): s
        for s in (
            getattr(loader, "sampler", None),
            batch_sampler,
            getattr(batch_sampler, "sampler", None),
        )
    }
    for sampler in samplers.values():  # e.g. BatchSampler(DistributedSampler(...)): the inner one
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)


def epoch_batches(loader: Any) -> EpochBatches | None:
    """The :class:`EpochBatches` torch-hapi gave ``loader``, or ``None``."""
    sampler = getattr(loader, "batch_sampler", None)
    return sampler if isinstance(sampler, EpochBatches) else None
