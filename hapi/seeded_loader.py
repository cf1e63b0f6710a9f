"""A training DataLoader whose every batch loads under its own seed.

Why: augmentation in ``__getitem__`` (random noise, crops, flips) draws
random numbers while a batch loads. With a plain DataLoader those draws
depend on everything drawn before them: in the main process on the model's
own draws and on the loop fetching batch s+1 before the backup at step s is
taken; in worker processes on which worker got which batch, which starts
afresh when a resumed epoch starts mid-way. A run resumed from a backup then
sees other augmentations than the run it replaces.

Here each batch's loading draws from streams seeded by (fit seed, epoch,
batch position, rank) alone (:func:`hapi.rng.seeded_streams`): the batch
sampler tags each batch's indices with its seed, and the data set wrapper
seeds torch's, Python's and NumPy's generators with it before the fetch, in
the main process (handing torch's stream back to the model afterwards) or in
a worker. The same batch therefore gets the same random numbers in a resumed
run, whatever the number of workers.

Used only for training loaders torch-hapi builds over data sets that may
draw random numbers (:func:`may_draw_random_numbers`); in-memory tensors and
hapi's data sets without a transform skip the cost.
"""

from __future__ import annotations

from typing import Any, Iterator

from torch.utils.data import DataLoader, Dataset, get_worker_info

from hapi import distributed
from hapi.rng import mix, seeded_streams


def may_draw_random_numbers(dataset: Any) -> bool:
    """Whether loading ``dataset`` could draw random numbers (unknown data sets: yes).

    A data set says it never does with a false ``draws_random_numbers``
    attribute, as :class:`hapi.data.TensorBatches` and hapi's image data sets
    without a transform do.
    """
    return bool(getattr(dataset, "draws_random_numbers", True))


class SeededIndices(list):
    """One batch's sample indices, with the seed its loading draws from."""

    seed: int


class SeededBatches:
    """A batch sampler's batches, tagged with the seeds of their positions in the epoch."""

    def __init__(self, batches: Any, seed: int, epoch: int, rank: int, first_position: int) -> None:
        self.batches, self.seed, self.epoch, self.rank = batches, seed, epoch, rank
        self.first_position = first_position

    def __iter__(self) -> Iterator[SeededIndices]:
        for position, indices in enumerate(self.batches, start=self.first_position):
            tagged = SeededIndices(indices)
            tagged.seed = mix(self.seed, self.epoch, position, self.rank)
            yield tagged

    def __len__(self) -> int:
        return len(self.batches)


class SeededDataset(Dataset):
    """A map-style data set whose batches load under the seed their indices carry."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: list) -> Any:
        seed = getattr(indices, "seed", None)
        if seed is None:
            return self._fetch(indices)
        # A worker draws only for loading; the main process gives the model its torch stream back.
        with seeded_streams(seed, hand_back_torch=get_worker_info() is None):
            return self._fetch(indices)

    def _fetch(self, indices: list) -> Any:
        getitems = getattr(self.dataset, "__getitems__", None)
        return getitems(indices) if getitems else [self.dataset[index] for index in indices]


class SeededLoader(DataLoader):
    """``DataLoader`` over ``dataset`` (wrapped in :class:`SeededDataset`) whose batches carry seeds.

    The seed, epoch and rank come from the sampler torch-hapi built for it
    (:func:`hapi.distributed.resumable`), which the loop already tells the
    epoch and a resumed run's seed; the loader itself only learns where a
    resumed epoch starts (``start_at``), since its sampler skips the samples
    before that and so cannot number the batches.
    """

    def __init__(self, dataset: Any, **kwargs: Any) -> None:
        super().__init__(SeededDataset(dataset), **kwargs)
        if distributed.resumable(self) is None:
            raise TypeError(
                "SeededLoader needs a sampler torch-hapi built (ResumableSampler or a "
                "shard of the user's), which knows the seed and the epoch."
            )
        self._start = (0, 0)  # (epoch, position of its first batch) of a resumed epoch

    def start_at(self, position: int) -> None:
        """The next iteration of this epoch starts at the epoch's batch ``position``."""
        self._start = (distributed.resumable(self).epoch, position)

    @property
    def _index_sampler(self) -> Any:  # what DataLoader's iterators draw batches of indices from
        batches = super()._index_sampler
        if not self._auto_collation:
            return batches
        sampler = distributed.resumable(self)
        first = self._start[1] if self._start[0] == sampler.epoch else 0
        return SeededBatches(batches, sampler.seed, sampler.epoch, sampler.rank, first)
