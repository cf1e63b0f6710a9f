"""Which samples each process reads: training shards, evaluation shards, resharded loaders.

No collective call here: every process computes its own share from the
same seed, rank and world size (and, for a user's sampler, the same stream
drawn under the same seed).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from hapi.distributed.env import DistributedSetupError
from hapi.distributed.group import rank, world_size
from hapi.rng import mix, seeded_streams


def strided_share(rest: list, whole: list, num_replicas: int, rank: int) -> list:
    """Process ``rank``'s items of ``rest``: items rank, rank+N, ... once ``rest`` is padded
    with ``whole``'s first items to a multiple of N (so every process gets as many).

    Together the N processes' k-th batches of b are then ``rest``'s k-th N*b items,
    as one process at batch N*b reads them; and whatever N, the processes together
    read each item of ``rest`` once (plus the padding).
    """
    padding = -len(rest) % num_replicas
    if padding and whole:
        rest = rest + [whole[i % len(whole)] for i in range(padding)]
    return rest[rank::num_replicas]


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` that can start its next epoch part-way through the epoch's order.

    The position is counted in samples of the epoch's global order (the
    permutation every process draws alike), not in one process's batches:
    after k steps of N processes at batch b, the first k*N*b samples of that
    order are done, whatever N. A run resumed mid-epoch, on the same number
    of processes or another, reads the rest of that order -- each remaining
    sample once -- without loading the samples already trained on (loading
    them could draw random numbers in transforms). Unskipped, it yields what
    ``DistributedSampler(drop_last=False)`` yields.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._skip = 0
        self.resumed_at = (
            0  # items of this epoch's order done before this run (see hapi.train_data)
        )
        # Given to the DataLoader: it draws its workers' base seed from this
        # generator instead of torch's global one, so iterating the data never
        # shifts the random numbers the model draws (dropout), and a resumed
        # epoch gets the same worker seeds.
        self.loader_generator = torch.Generator()
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        if epoch != getattr(self, "epoch", None):  # a resumed epoch's skip ends with it
            self.resumed_at, self._skip = 0, 0
        super().set_epoch(epoch)
        self.loader_generator.manual_seed(self.seed * 7919 + epoch)

    def skip_next(self, items: int) -> None:
        """Leave out the first ``items`` samples of the epoch's global order, next iteration only."""
        self._skip = items

    def order(self) -> list[int]:
        """The epoch's global order of sample indices, the same on every process."""
        if not self.shuffle:
            return list(range(len(self.dataset)))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)  # DistributedSampler's own draw
        return torch.randperm(len(self.dataset), generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        order = self.order()
        skip, self._skip = self._skip, 0
        return iter(strided_share(order[skip:], order, self.num_replicas, self.rank))

    def __len__(self) -> int:
        return -(-max(len(self.dataset) - self._skip, 0) // self.num_replicas)


def train_sampler(dataset: Any, shuffle: bool, seed: int) -> ResumableSampler:
    """This process's share of the training data, reshuffled per epoch by ``set_epoch``.

    Every rank gets the same number of samples (the last few are repeated
    to even the shards, as ``DistributedSampler`` does), so all ranks run the
    same number of steps and DDP's collectives line up.
    """
    return ResumableSampler(
        dataset, num_replicas=world_size(), rank=rank(), shuffle=shuffle, seed=seed, drop_last=False
    )


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


def reshard(
    loader: DataLoader, training: bool, seed: int, force: bool = False
) -> dict[str, Any] | None:
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
      the processes (:class:`SamplerShard`);
    * a batch sampler of the user's own (not torch's ``BatchSampler``) is
      kept whole, and its batches are split (:class:`BatchSamplerShard`).

    ``force`` rebuilds the loader on one process too (a run resumed from
    several processes continues their order).

    Raises:
        DistributedSetupError: the sampler cannot be split (no length).
    """
    if (world_size() == 1 and not force) or isinstance(
        loader.dataset, torch.utils.data.IterableDataset
    ):
        return None
    batches = loader.batch_sampler  # None when the user turned automatic batching off
    inner = index_sampler(loader)
    rank_aware = isinstance(inner, DistributedSampler) or hasattr(batches, "set_epoch")
    if training and rank_aware:
        return None
    if (
        loader.batch_size is None
        and batches is not None
        and not isinstance(batches, BatchSampler)
        and not rank_aware
    ):
        return {"batch_sampler": BatchSamplerShard(batches, world_size(), rank(), seed, training)}
    batch_size = loader_batch_size(loader)
    if batches is None:
        raise DistributedSetupError(
            "This DataLoader was built with batch_size=None (no automatic batching), so its items "
            f"are whole batches that torch-hapi cannot split across {world_size()} processes. Give "
            "it a batch_size, or a batch_sampler (torch-hapi then deals its batches out whole)."
        )
    if batch_size is None:
        raise DistributedSetupError(
            "This DataLoader has a rank-aware batch_sampler without a batch_size, which torch-hapi "
            f"cannot split across {world_size()} processes. Give it a sampler that knows the rank "
            "(e.g. BatchSampler(DistributedSampler(dataset), batch_size, drop_last)), or pass the "
            "Dataset and batch_size to fit()."
        )
    drop_last = (
        loader.drop_last
        if loader.batch_size is not None
        else bool(getattr(batches, "drop_last", False))
    )
    if rank_aware or _plain_order(inner):
        shuffle = training and isinstance(inner, RandomSampler)
        sampler = (
            train_sampler(loader.dataset, shuffle, seed)
            if training
            else eval_sampler(loader.dataset)
        )
    else:
        sampler = SamplerShard(inner, world_size(), rank(), seed, training)
    return {"sampler": sampler, "batch_size": batch_size, "drop_last": drop_last}


def _plain_order(sampler: Any) -> bool:
    """torch's default orders, which a seeded shard of the whole data set reproduces."""
    if type(sampler) is SequentialSampler:
        return True
    return (
        type(sampler) is RandomSampler and not sampler.replacement and sampler._num_samples is None
    )


def _length(sampler: Any, what: str) -> int:
    try:
        return len(sampler)
    except TypeError:
        raise DistributedSetupError(
            f"The DataLoader's {what} {type(sampler).__name__} has no length, so torch-hapi cannot "
            f"split what it yields across {world_size()} processes (it may never end). Give it a "
            "__len__, or give the DataLoader a sampler that knows the rank (e.g. "
            "DistributedSampler) and keep the same number of batches on every process."
        ) from None


class _StreamShard:
    """This process's share of what a user's (batch) sampler yields each epoch.

    Every process draws the sampler's whole stream with the same random
    streams (seeded by the fit's seed and the epoch, see
    :func:`hapi.rng.seeded_streams`), so all draw the same stream and the
    shares never overlap. Training shares are strided (process r takes items
    r, r+N, ...: together the N processes' k-th batches are the stream's k-th
    N*b items, as one process at batch N*b reads them), padded by repeating
    the stream's first items so every process runs as many steps. Evaluation
    shares are contiguous and unpadded: no item twice, and predictions
    gathered in rank order come back in stream order.
    """

    def __init__(
        self, source: Any, num_replicas: int, rank: int, seed: int, training: bool, what: str
    ) -> None:
        self.source, self.what = source, what
        self.num_replicas, self.rank, self.seed, self.training = num_replicas, rank, seed, training
        self.epoch = -1
        self._skip = 0
        self.resumed_at = (
            0  # items of this epoch's stream done before this run (see hapi.train_data)
        )
        self._next_stream: list | None = None  # a stream already drawn for the next iteration
        _length(source, what)  # fails now, not at the first epoch
        self.loader_generator = torch.Generator()  # see ResumableSampler
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:  # a resumed epoch's skip and stream end with it
            self.resumed_at, self._skip, self._next_stream = 0, 0, None
        self.epoch = epoch
        self.loader_generator.manual_seed(mix(self.seed, epoch))
        if hasattr(self.source, "set_epoch"):
            self.source.set_epoch(epoch)

    def skip_next(self, items: int) -> None:
        """Leave out the first ``items`` of the epoch's whole stream, next iteration only
        (a resumed epoch; see :class:`ResumableSampler`)."""
        self._skip = items

    def _share(self, stream: list) -> list:
        if self.training:
            return strided_share(stream[self._skip :], stream, self.num_replicas, self.rank)
        shard = ContiguousShardSampler(len(stream), self.num_replicas, self.rank)
        return stream[shard.start : shard.stop]

    def stream(self) -> list:
        """This epoch's whole stream, as every process draws it."""
        with seeded_streams(mix(self.seed, self.epoch, 0x5A3)):
            stream = list(self.source)
        expected = _length(self.source, self.what)
        if len(stream) != expected:
            raise DistributedSetupError(
                f"The DataLoader's {self.what} {type(self.source).__name__} says it has {expected} "
                f"items (__len__) but yielded {len(stream)}; torch-hapi splits its items across "
                f"{self.num_replicas} processes by that length. Make __len__ match what __iter__ yields."
            )
        return stream

    def use_stream(self, stream: list) -> None:
        """Serve ``stream`` at the next iteration instead of drawing it (a resumed epoch's
        stream, drawn with the generators as they were when the epoch began)."""
        self._next_stream = stream

    def __iter__(self) -> Iterator[Any]:
        stream, self._next_stream = self._next_stream, None
        share = self._share(self.stream() if stream is None else stream)
        self._skip = 0
        return iter(share)

    def __len__(self) -> int:
        total = _length(self.source, self.what)
        if self.training:
            return -(-max(total - self._skip, 0) // self.num_replicas)
        return len(ContiguousShardSampler(total, self.num_replicas, self.rank))


class SamplerShard(_StreamShard, Sampler[int]):
    """This process's share of the indices a user's sampler yields (see :class:`_StreamShard`).

    A ``SubsetRandomSampler(train_idx)`` then trains only on ``train_idx``
    and a ``WeightedRandomSampler`` keeps its weights, on any number of
    processes.
    """

    def __init__(
        self, sampler: Sampler, num_replicas: int, rank: int, seed: int, training: bool
    ) -> None:
        super().__init__(sampler, num_replicas, rank, seed, training, "sampler")


class BatchSamplerShard(_StreamShard, Sampler[list]):
    """This process's share of the batches a user's batch sampler yields (see :class:`_StreamShard`)."""

    def __init__(
        self, batch_sampler: Any, num_replicas: int, rank: int, seed: int, training: bool
    ) -> None:
        super().__init__(batch_sampler, num_replicas, rank, seed, training, "batch_sampler")
        self.batch_size = getattr(batch_sampler, "batch_size", None)
        self.drop_last = getattr(batch_sampler, "drop_last", False)


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
