"""From what the user passes to fit/evaluate/predict to batches on the device.

Accepted data: a map-style ``Dataset`` whose items are tuples (or dicts), any
other map-style object (``__len__`` and ``__getitem__(int)``, such as a Hugging
Face ``datasets.Dataset``), a list of samples (tuples or dicts), an
``IterableDataset``, a ``DataLoader`` (used as given on one process), or a
tuple/list of tensors or NumPy arrays ``(x, y)`` of equal length. Every
kind of map-style data is sharded alike, by :class:`EpochBatches`.

The whole data path lives here, in the order a batch takes it: the data
as a data set (:func:`as_dataset`), the loader of one pass
(:func:`make_loader`), which samples each process reads
(:class:`EpochBatches`, the one resumable batch sampler of every loader
torch-hapi builds, for training and evaluation; a user's loader resharded
by :func:`reshard`), and each epoch of a fit with the position a checkpoint
keeps of it (:class:`TrainData`). Each batch is then split into network
inputs and loss labels by :mod:`hapi.batches`.
"""

from __future__ import annotations

import contextlib
import itertools
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset

from hapi import distributed, rng
from hapi.distributed import DistributedSetupError, group
from hapi.messages import require_int, warn

ACCEPTED = (
    "a torch.utils.data.Dataset or any map-style data set (__len__ and __getitem__(int), e.g. a "
    "Hugging Face datasets.Dataset), a list of samples (tuples or dicts), an IterableDataset, a "
    "DataLoader, or a tuple of tensors/NumPy arrays (x, y) of equal length"
)
_ARRAYS = (torch.Tensor, np.ndarray)  # what holds one row per sample


def describe(values: Any) -> str:
    """Shapes and dtypes for error messages: ``(float32[4, 3], int64[4])``."""
    if isinstance(values, _ARRAYS):
        return f"{values.dtype}{list(values.shape)}".replace("torch.", "")
    if isinstance(values, Mapping):
        return "{" + ", ".join(f"{key}: {describe(value)}" for key, value in values.items()) + "}"
    if isinstance(values, (list, tuple)):
        if not values or any(isinstance(v, (*_ARRAYS, list, tuple)) for v in values):
            return "(" + ", ".join(describe(v) for v in values) + ")"
        kinds = "/".join(sorted({type(v).__name__ for v in values}))
        return f"{type(values).__name__} of {len(values)} {kinds}"
    return type(values).__name__


def _as_tensor(array: Any, position: int, role: str) -> torch.Tensor:
    """A tensor, or a NumPy array as one (:func:`as_dataset` passes nothing else)."""
    if torch.is_tensor(array):
        return array
    try:
        return torch.from_numpy(np.ascontiguousarray(array))
    except TypeError as error:
        raise TypeError(
            f"Element {position} of {role} is a NumPy array of dtype {array.dtype}, which a "
            f"tensor cannot hold: {error}. Convert it first, e.g. class names to int64 indices."
        ) from error


class Batch(Sequence):
    """A batch made in one indexing operation, that still reads as a list of samples.

    What ``__getitems__`` returns on the fast path. torch-hapi's collate takes
    ``tensors`` as they are (no per-sample work); a plain ``DataLoader`` with
    ``default_collate`` sees the list of samples torch's ``__getitems__``
    convention promises, so the data set keeps working outside torch-hapi.
    """

    def __init__(self, *tensors: torch.Tensor) -> None:
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return tuple(t[index] for t in self.tensors)


class TensorBatches(Batch, Dataset):
    """Tensors of equal length as a data set that serves whole batches.

    ``__getitems__`` indexes every tensor once per batch: no per-sample Python
    work and no collate (the fast path for in-memory data). Length and
    per-sample access are :class:`Batch`'s.
    """

    draws_random_numbers = False  # loading is indexing: no per-batch seeds needed

    def __getitems__(self, indices: list[int]) -> Batch:
        index = torch.as_tensor(indices, dtype=torch.long, device=self.tensors[0].device)
        return Batch(*(t[index] for t in self.tensors))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def to(self, device: torch.device) -> "TensorBatches":
        return TensorBatches(*(t.to(device) for t in self.tensors))


# Share of the GPU's free memory an in-memory data set may take to be copied
# there whole: the rest stays for the model, its activations and the optimizer.
DEVICE_DATA_SHARE = 0.25


def free_device_memory(device: torch.device) -> int:
    """Bytes free on ``device`` for data; 0 where data is not worth moving (the CPU)."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0


def device_resident(dataset: Any, device: torch.device) -> Any:
    """``dataset`` copied to ``device`` once, when it can be and fits; else ``dataset``.

    A data set can be when it serves whole batches (``__getitems__``) and says
    how big it is and how to move it (``nbytes``, ``to(device)``): tensors,
    ``TensorDataset`` and hapi's data sets do. Its batches are then gathered on
    the device, with no host-to-device copy per step. It fits when it takes at
    most ``DEVICE_DATA_SHARE`` of the memory left free on the device
    (:func:`free_device_memory`).
    """
    movable = all(hasattr(dataset, name) for name in ("__getitems__", "nbytes", "to"))
    if not movable or dataset.nbytes > DEVICE_DATA_SHARE * free_device_memory(device):
        return dataset
    return dataset.to(device)


class Samples(list, Dataset):
    """A list of samples (tuples or dicts) as a data set (a list, and a ``Dataset``).

    Indexing a list draws no random numbers, so its batches need no seeds
    (:class:`SeededDataset`).
    """

    draws_random_numbers = False


def is_map_style(data: Any) -> bool:
    """Whether ``data`` reads as a map-style data set: a length, and samples by int index.

    That is all torch's ``DataLoader`` needs of a data set, so any such object
    is data (a Hugging Face ``datasets.Dataset`` is no torch ``Dataset``).
    Tensors, arrays, strings and mappings have both methods too, but their
    items are not samples.
    """
    if isinstance(data, (str, bytes, Mapping, np.ndarray)) or torch.is_tensor(data):
        return False
    return hasattr(type(data), "__len__") and hasattr(type(data), "__getitem__")


def _refusal(data: Any, role: str) -> TypeError:
    """The error for data of no accepted kind, saying what was received and what would do."""
    received, hint = type(data).__name__, ""
    if isinstance(data, _ARRAYS):
        received = f"a single {type(data).__name__} {describe(data)}"
        hint = " Pass a tuple: (x, y) to train and evaluate, (x,) to predict."
    elif isinstance(data, Mapping):
        received = f"a {type(data).__name__} with keys {list(data)[:8]}"
        hint = (
            " A mapping is one sample or one batch, not a data set: pass a list of such "
            "samples, or a data set whose items they are."
        )
    elif isinstance(data, (tuple, list)):
        kinds = "/".join(sorted({type(item).__name__ for item in data})) or "nothing"
        received = f"a {type(data).__name__} of {len(data)} {kinds}"
        hint = (
            " A list is data when it holds samples (tuples or dicts, e.g. list(zip(x, y))); "
            "a tuple or list, when it holds tensors or arrays with one row per sample."
        )
    return TypeError(f"{role} must be {ACCEPTED}; received {received}.{hint}")


def as_dataset(data: Any, role: str) -> Any:
    """A data set for ``data``: map-style or iterable.

    Tensors and arrays become :class:`TensorBatches`, a list of samples
    :class:`Samples`; a ``Dataset`` or any other map-style object is used as
    it is.
    """
    if type(data) is torch.utils.data.TensorDataset:
        return TensorBatches(*data.tensors)
    if isinstance(data, Dataset) or (not isinstance(data, (tuple, list)) and is_map_style(data)):
        return data
    if isinstance(data, (tuple, list)) and data and all(isinstance(a, _ARRAYS) for a in data):
        tensors = [_as_tensor(a, i, role) for i, a in enumerate(data)]
        lengths = [len(t) for t in tensors]
        if len(set(lengths)) != 1:
            raise ValueError(
                f"The arrays passed as {role} have different lengths {lengths}; every array "
                "of the tuple must have one row per sample."
            )
        return TensorBatches(*tensors)
    if isinstance(data, list) and data and all(isinstance(s, (tuple, Mapping)) for s in data):
        return Samples(data)
    raise _refusal(data, role)


@dataclass
class ExplainingCollate:
    """``default_collate`` whose errors name the data argument and the samples.

    A data set whose ``__getitems__`` returns a :class:`Batch` has made the
    batch already: its tensors pass through untouched. Anything else (a list
    of samples, torch's convention for ``__getitems__``) is collated as usual.

    A class (not a closure) so that DataLoader workers can pickle it.
    """

    role: str

    def __call__(self, samples: Any) -> Any:
        if isinstance(samples, Batch):
            return samples.tensors  # the data set's __getitems__ made the batch itself
        try:
            return torch.utils.data.default_collate(samples)
        except (RuntimeError, TypeError, ValueError) as error:
            sizes = sorted({len(s) for s in samples if isinstance(s, (tuple, list))})
            counts = f" with {', '.join(map(str, sizes))} elements" if len(sizes) > 1 else ""
            shown = ", ".join(describe(s) for s in samples[:4])
            raise type(error)(
                f"Could not batch the samples of {self.role}{counts}: {error}. The first samples "
                f"are {shown}{' ...' if len(samples) > 4 else ''}. Make them tuples of one length "
                "and alike shapes, or pass a DataLoader with your own collate_fn."
            ) from error


@dataclass(eq=False)
class NonEmpty:
    """Wraps a loader of unknown length: iterating it to the end without a batch raises."""

    loader: Iterable
    role: str

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Any]:
        batch = end = object()
        for batch in self.loader:
            yield batch
        if batch is end:
            raise ValueError(
                f"{self.role} is empty: it yielded no batch. Check the data source (an "
                "IterableDataset that yields nothing, or a filter that drops everything)."
            )


def _checked(loader: Iterable, role: str, batch_size: int | None, drop_last: bool) -> Iterable:
    batches = num_batches(loader)
    if batches is None:
        return NonEmpty(loader, role)
    dataset = loader.dataset
    # A map-style data set smaller than the process count leaves this process's shard empty.
    map_style = is_map_style(dataset) and not isinstance(dataset, IterableDataset)
    samples = len(dataset) if map_style else None
    if batches == 0 and (drop_last or not samples):
        what, hint = "no batch", ""
        if samples == 0:
            what = "0 samples"
        elif drop_last:
            what = f"no batch at batch_size={batch_size}, drop_last=True"
            hint = " Lower batch_size or set drop_last=False."
        raise ValueError(f"{role} is empty ({what}), so there is nothing to iterate over.{hint}")
    return loader


def make_loader(
    data: Any,
    *,
    role: str,
    batch_size: int,
    shuffle: bool = False,
    drop_last: bool = False,
    num_workers: int = 0,
    seed: int = 0,
    device: torch.device = torch.device("cpu"),
) -> Iterable:
    """The iterable of batches one pass over ``data`` uses on this process.

    For a GPU ``device``: in-memory data that fits is copied there once and
    batched there (see :func:`device_resident`; not with worker processes,
    which cannot share GPU tensors); other data is loaded into pinned memory,
    from which the step copies it without blocking.

    Raises:
        ValueError: the data gives no batch at all.
    """
    if data is None:
        raise ValueError(f"{role} is None; pass {ACCEPTED}.")
    training = role == "train_data"
    if isinstance(data, DataLoader):
        sampler = reshard(data, training, seed)
        loader = data if sampler is None else rebuilt(data, sampler)
        return _checked(loader, role, data.batch_size, data.drop_last)
    method = {"train_data": "fit", "eval_data": "evaluate", "test_data": "predict"}.get(role, role)
    require_int(method, "batch_size", batch_size)
    require_int("DataLoader", "num_workers", num_workers, minimum=0)
    dataset = as_dataset(data, role)
    options = {"num_workers": num_workers, "collate_fn": ExplainingCollate(role)}
    if isinstance(dataset, IterableDataset):
        if distributed.world_size() > 1:
            warn(
                f"{role} is an IterableDataset: each of the {distributed.world_size()} processes "
                "reads all of it unless it shards itself by hapi.distributed.rank() and "
                "world_size(), each then yielding as many batches.",
            )
        # Not torch's global generator, which the model draws from.
        options["generator"] = torch.Generator()
        return NonEmpty(DataLoader(dataset, batch_size, drop_last=drop_last, **options), role)
    length = len(dataset)
    order = {"batch_size": batch_size, "drop_last": drop_last, "seed": seed, "training": training}
    sampler = EpochBatches(permutation(length, shuffle), length, **order)
    resident = dataset if num_workers else device_resident(dataset, device)
    pinned = device.type == "cuda" and resident is dataset  # pinned only for host data
    options.update(pin_memory=pinned, persistent_workers=num_workers > 0 and not training)
    return _checked(_loader(resident, sampler, **options), role, batch_size, drop_last)


def may_draw_random_numbers(dataset: Any) -> bool:
    """Whether loading ``dataset`` could draw random numbers (unknown data sets: yes).

    A data set says it never does with a false ``draws_random_numbers``
    attribute, as :class:`TensorBatches` and hapi's image data sets without a
    transform do.
    """
    return bool(getattr(dataset, "draws_random_numbers", True))


@dataclass(eq=False)
class SeededDataset(Dataset):
    """A map-style data set whose batches load under the seed their indices carry.

    Why: augmentation in ``__getitem__`` (random noise, crops, flips) draws
    random numbers while a batch loads. With a plain DataLoader those draws
    depend on everything drawn before them: in the main process on the
    model's own draws and on the loop fetching batch s+1 before the backup at
    step s is taken; in worker processes on which worker got which batch,
    which starts afresh when a resumed epoch starts mid-way. Here each
    training batch's loading draws from streams seeded by (fit seed, epoch,
    batch position, rank) alone (the seed :class:`EpochBatches` tags its
    indices with): torch's, Python's and NumPy's generators are seeded with
    it before the fetch, in the main process (handing torch's stream back to
    the model afterwards) or in a worker. The same batch then gets the same
    random numbers in a resumed run, whatever the number of workers.
    """

    dataset: Any

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: SeededIndices) -> Any:
        getitems = getattr(self.dataset, "__getitems__", None)
        # A worker draws only for loading; the main process gives the model its torch stream back.
        main_process = torch.utils.data.get_worker_info() is None
        with rng.seeded_streams(indices.seed, hand_back_torch=main_process):
            return getitems(indices) if getitems else [self.dataset[index] for index in indices]


def _loader(dataset: Any, sampler: EpochBatches, **options: Any) -> DataLoader:
    """The DataLoader reading ``dataset`` through ``sampler``.

    Every loader gets the sampler's generator: iterating data must not draw
    from torch's global one, which the model's dropout uses. Each training
    batch that may draw random numbers loads under its own seed
    (:class:`SeededDataset`), so a resumed run gets the same random transforms.
    """
    if sampler.training and may_draw_random_numbers(dataset):
        dataset = SeededDataset(dataset)
    return DataLoader(dataset, batch_sampler=sampler, generator=sampler.loader_generator, **options)


def rebuilt(loader: DataLoader, sampler: EpochBatches) -> DataLoader:
    """``loader`` read through ``sampler``, with the same data set, workers, collate function,
    memory pinning and timeouts. Training workers start afresh each epoch (not persistent)."""
    kept = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn")
    options = {name: getattr(loader, name) for name in (*kept, "prefetch_factor")}
    persistent = loader.persistent_workers and not sampler.training
    return _loader(loader.dataset, sampler, persistent_workers=persistent, **options)


# -- which samples each process reads -------------------------------------------------------
#
# No collective call here: every process computes its own share from the same seed, rank and
# world size (and, for a user's sampler, the same stream drawn under the same seed).


class SeededIndices(list):
    """One batch's sample indices, with the seed its loading draws from (:class:`SeededDataset`)."""

    seed: int


@dataclass(eq=False)
class EpochBatches(torch.utils.data.Sampler[list]):
    """The batch sampler of every loader torch-hapi builds: this process's batches.

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

    draw: Callable[[int, int], list]
    units: int  # the stream's length in a new epoch
    _: KW_ONLY
    batch_size: int | None
    drop_last: bool = False
    seed: int = 0
    training: bool = True
    num_replicas: int | None = None  # None: the job's
    rank: int | None = None

    def __post_init__(self) -> None:
        self.drop_last = bool(self.drop_last)  # fit takes any truth value, as Paddle does
        self.num_replicas = group.world_size() if self.num_replicas is None else self.num_replicas
        self.rank = group.rank() if self.rank is None else self.rank
        # The DataLoader draws its workers' base seed from this generator, not torch's global
        # one: iterating the data never shifts the numbers the model draws (dropout), and a
        # resumed epoch gets the same worker seeds.
        self.loader_generator = torch.Generator()
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        """A new epoch: its stream is drawn at the next pass."""
        self.epoch, self.first_position, self.length = epoch, 0, self.units
        # What is left of the stream, and the units that pad it (a resumed stream's head).
        self._stream = self._padding = None
        if self.training:  # evaluation's workers draw from a fresh generator, as torch's do
            self.loader_generator.manual_seed(rng.mix(self.seed, epoch))

    def resume(self, epoch: int, rest: list, padding: list, position: int) -> None:
        """Serve ``rest`` of epoch ``epoch``'s stream in the next pass, its first batch at
        ``position`` of the epoch, padded from ``padding`` (the stream's first units)."""
        self.set_epoch(epoch)
        self._stream, self._padding, self.first_position = list(rest), list(padding), position
        self.length = len(rest)

    def stream(self) -> Sequence:
        """This epoch's stream (what is left of it, in a resumed epoch)."""
        if self._stream is None or not self.training:
            stream = self.draw(self.seed, self.epoch)
            # Evaluation reads a range as it is: no list of every index, however large the data.
            self._stream = list(stream) if self.training else stream
            if len(self._stream) != self.length:
                raise DistributedSetupError(
                    f"The DataLoader's sampler has {self.length} items by __len__ but yielded "
                    f"{len(self._stream)}, to split across {self.num_replicas} processes by "
                    "__len__. Make __len__ match what __iter__ yields."
                )
        return self._stream

    def _contiguous(self, length: int) -> slice:
        """An evaluation share: sizes differ by at most one, and the shares in rank order
        give back the whole, in order."""
        base, extra = divmod(length, self.num_replicas)
        start = self.rank * base + min(self.rank, extra)
        return slice(start, start + base + (self.rank < extra))

    def _share(self, stream: list) -> list:
        if not self.training:
            return stream[self._contiguous(len(stream))]
        pool = (stream if self._padding is None else self._padding + stream) or [None]
        padded = stream + [pool[i % len(pool)] for i in range(-len(stream) % self.num_replicas)]
        return padded[self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[list]:
        share = self._share(self.stream())
        if self.batch_size is not None:  # else each unit is a batch
            share = BatchSampler(share, self.batch_size, self.drop_last)
        for position, batch in enumerate(share, start=self.first_position):
            tagged = SeededIndices(batch)
            tagged.seed = rng.mix(self.seed, self.epoch, position, self.rank)
            yield tagged

    def __len__(self) -> int:
        if self.training:
            share = -(-self.length // self.num_replicas)
        else:
            share = len(range(self.length)[self._contiguous(self.length)])
        if self.batch_size is None:
            return share
        return len(BatchSampler(range(share), self.batch_size, self.drop_last))

    def state(self, batches: int) -> dict[str, Any]:
        """What is left of the epoch's stream after its step ``batches`` (a resumed pass
        began at ``first_position``), and the units that pad it (what :meth:`resume` takes)."""
        stream = self.stream()
        done = (batches - self.first_position) * self.num_replicas * (self.batch_size or 1)
        padding = stream if self._padding is None else self._padding
        return {"rest": stream[done:], "padding": padding[: self.num_replicas]}


def permutation(length: int, shuffle: bool) -> Callable[[int, int], Sequence[int]]:
    """The stream of torch-hapi's own order: a permutation of ``range(length)`` seeded by
    (seed, epoch), as ``DistributedSampler`` draws it; ``range(length)`` without shuffling."""

    def draw(seed: int, epoch: int) -> Sequence[int]:
        if not shuffle:
            return range(length)
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
        with rng.seeded_streams(rng.mix(seed, epoch, 0x5A3)):
            return list(source)

    return draw


def _kept(source: Any, what: str, **options: Any) -> EpochBatches:
    """The batches of a user's (batch) sampler kept as it is, its stream split by its length."""
    try:
        length = len(source)
    except TypeError:
        raise DistributedSetupError(
            f"The DataLoader's {what} {type(source).__name__} has no length, so torch-hapi "
            f"cannot split it across {group.world_size()} processes. Give it a __len__, or give "
            "the DataLoader a sampler that knows the rank (e.g. DistributedSampler)."
        ) from None
    return EpochBatches(user_stream(source), length, **options)


def reshard(loader: DataLoader, training: bool, seed: int) -> EpochBatches | None:
    """The batch sampler of this process's share of a user's DataLoader.

    ``None`` keeps the loader as given: on one process, for iterable data
    sets (they shard themselves), and for training when it already knows
    the rank (a ``DistributedSampler``, or a batch sampler that knows epochs,
    like Paddle's DistributedBatchSampler). Otherwise the share keeps the
    meaning of the user's sampler:

    * torch's plain orders (``SequentialSampler``, ``RandomSampler`` without
      replacement) become a seeded shard of the whole data set, for
      evaluation a contiguous one (no sample twice, none left out);
    * any other sampler (``SubsetRandomSampler``, ``WeightedRandomSampler``,
      the user's own) is kept, and the indices it yields are split across
      the processes;
    * a batch sampler of the user's own (not torch's ``BatchSampler``) is
      kept whole, and its batches are split.

    Raises:
        DistributedSetupError: the sampler cannot be split (no length, or no
            batch size where its batches must be split).
    """
    if group.world_size() == 1 or isinstance(loader.dataset, IterableDataset):
        return None
    batches = loader.batch_sampler  # None when the user turned automatic batching off
    own_batches = not isinstance(batches, (BatchSampler, type(None)))  # batch_size's is torch's
    inner = getattr(batches, "sampler", loader.sampler)  # batch_size's BatchSampler: its own
    knows_epochs = hasattr(batches, "set_epoch")  # e.g. Paddle's DistributedBatchSampler
    rank_aware = knows_epochs or isinstance(inner, torch.utils.data.DistributedSampler)
    if training and rank_aware:
        return None
    options = {"seed": seed, "training": training}
    if own_batches and not rank_aware:
        return _kept(batches, "batch_sampler", batch_size=None, **options)
    batch_size = loader_batch_size(loader)
    if batch_size is None:  # batch_size=None, or a rank-aware batch_sampler without one
        raise DistributedSetupError(
            "This DataLoader's items are whole batches (batch_size=None, or a rank-aware "
            f"batch_sampler with no batch_size: {batches!r}), which torch-hapi cannot split "
            f"across {group.world_size()} processes. Give it a batch_size, or a batch_sampler "
            "that does not know the rank (its batches are then dealt out whole)."
        )
    options.update(batch_size=batch_size, drop_last=getattr(batches, "drop_last", False))
    if rank_aware or _plain_order(inner):
        shuffle = training and isinstance(inner, torch.utils.data.RandomSampler)
        length = len(loader.dataset)
        return EpochBatches(permutation(length, shuffle), length, **options)
    return _kept(inner, "sampler", **options)


def _plain_order(sampler: Any) -> bool:
    """torch's default orders, which a seeded shard of the whole data set reproduces."""
    return type(sampler) is torch.utils.data.SequentialSampler or (
        type(sampler) is torch.utils.data.RandomSampler
        and not sampler.replacement
        and sampler.num_samples == len(sampler.data_source)
    )


def loader_batch_size(loader: Any) -> int | None:
    """Samples per batch of a DataLoader, also when it was given a ``batch_sampler``."""
    batches = getattr(loader, "batch_sampler", None)
    size = getattr(loader, "batch_size", None) or getattr(batches, "batch_size", None)
    return size if isinstance(size, int) else None


def set_epoch(loader: Any, epoch: int) -> None:
    """Tell the samplers which epoch starts, so each epoch reshuffles (all ranks alike)."""
    batches = getattr(loader, "batch_sampler", None)
    samplers = (getattr(loader, "sampler", None), batches, getattr(batches, "sampler", None))
    for sampler in {id(s): s for s in samplers}.values():  # e.g. BatchSampler(DistributedSampler)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)


def epoch_batches(loader: Any) -> EpochBatches | None:
    """The :class:`EpochBatches` torch-hapi gave ``loader``, or ``None``."""
    sampler = getattr(loader, "batch_sampler", None)
    return sampler if isinstance(sampler, EpochBatches) else None


# -- the training data of one fit: each epoch's batches, and resuming an interrupted one --

KINDS = ("batches", "given", "iterable", "unknown")


class TrainData:
    """The batches of each epoch of one ``fit``, and the position a checkpoint records.

    What decides an epoch's order is kept with every resumable checkpoint:

    * a loader torch-hapi built -- over the user's data, or over a user's
      DataLoader split across processes -- reads the batches of
      :class:`hapi.data.EpochBatches`: the epoch's stream of sample
      indices (or of a user's batch sampler's batches) is drawn once when the
      epoch begins, and a checkpoint keeps what is left of it (``"batches"``).
      A resume serves that rest, split over the processes there are now: on as
      many, exactly the batches the uninterrupted run read, each under the same
      loading seed; on another number, each remaining sample once.
    * a user's DataLoader used as given (one process): torch's own iterator
      draws the order from the global generators and those the loader and its
      samplers keep, and a checkpoint keeps their states as they were when the
      epoch began (``"given"``). A resume on one process replays the epoch's
      start from them and skips the batches already trained (reading them), then
      puts back the states of the moment of the save; on several, the epoch's
      stream is drawn again from those states and its rest split.

    Where neither can be had (an ``IterableDataset``'s stream, a rank-aware
    sampler of the user's on another number of processes)
    :meth:`TrainData.inexact_reason` says why, before training.

    ``loader`` is what :func:`make_loader` built for this process;
    ``given`` the user's own DataLoader, when one was passed (its samplers and
    generators decide the order, also when ``loader`` reads a share of it).
    ``steps`` counts the batches of the epoch being read as its steps are
    (``None``: unknown): a resumed epoch's first step is the one it continues at.
    """

    def __init__(self, loader: Iterable, given: Any, seed: int) -> None:
        self.loader = loader
        self.given = given = given if isinstance(given, DataLoader) else None
        self.seed = seed
        # The generators a user's loader and its samplers keep (found once: the same objects all fit).
        self._generators = rng.generators_of(given)
        # Samples per batch of the user's loader; None where its items are whole batches of a
        # batch sampler of the user's own (torch's BatchSampler batches samples).
        batches = getattr(given, "batch_sampler", None)  # torch's also where batch_size is given
        self._given_size = batches.batch_size if isinstance(batches, BatchSampler) else None
        iterable = given is None or isinstance(given.dataset, IterableDataset)
        ours = epoch_batches(loader) is not None
        self.kind = "batches" if ours else "iterable" if iterable else "given"
        self._serve(loader, 0)
        self._epoch_start: dict[str, Any] | None = None  # random states when this epoch began
        self._resumed: tuple[int, Callable[[], Iterable]] | None = None  # an interrupted epoch

    @property
    def steps_per_epoch(self) -> int | None:
        return num_batches(self.loader)

    def epoch(self, epoch: int) -> Iterable:
        """Epoch ``epoch``'s batches: all of them, or the rest of a resumed epoch."""
        resumed, self._resumed = self._resumed, None
        if resumed is not None and resumed[0] == epoch:
            return resumed[1]()
        set_epoch(self.loader, epoch)
        if self.kind in ("given", "iterable"):  # what a resume replays the epoch from
            self._epoch_start = self._states()
        return self._serve(self.loader, 0)

    def _serve(self, loader: Iterable, first_step: int) -> Iterable:
        """Read ``loader`` as the epoch's batches from step ``first_step`` on."""
        self._serving = loader
        rest = exact_length(loader)
        self.steps = None if rest is None else first_step + rest
        return loader

    def _states(self) -> dict[str, Any]:
        return {"global": rng.global_state(), "generators": rng.generator_states(self._generators)}

    @contextlib.contextmanager
    def _states_at(self, start: dict[str, Any]) -> Iterator[None]:
        """Run the block with the global generators and the loader's at ``start``; then give
        each the state it had before."""
        now = self._states()
        try:
            rng.set_global_state(start["global"])
            rng.set_generator_states(self._generators, start["generators"])
            yield
        finally:
            rng.set_global_state(now["global"])
            rng.set_generator_states(self._generators, now["generators"])

    def inexact_reason(self) -> str | None:
        """Why a resumed epoch of this data cannot equal the uninterrupted one, or ``None``."""
        if self.kind == "iterable":
            return (
                "the training data is an IterableDataset: a resumed epoch reads its stream again "
                "and drops the batches trained, exact only if it yields the same items in order"
            )
        if self.kind == "given" and self.given.persistent_workers:  # torch: needs workers
            return (
                "the DataLoader keeps its workers across epochs (persistent_workers=True), whose "
                "random state cannot be replayed; pass persistent_workers=False"
            )
        return None

    def position(self, batches: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Where this epoch is after ``batches`` steps: what every process shares (rank 0's
        is kept), and this process's own random states (each keeps its own: rank 0's
        ``epoch_start`` is what a resume on another number of processes draws from)."""
        sampler = epoch_batches(self._serving)  # a resumed epoch's, maybe
        kind = "batches" if sampler is not None else self.kind
        shared: dict[str, Any] = {"kind": kind, "world": distributed.world_size()}
        if sampler is not None and batches:
            shared.update(sampler.state(batches))
        elif kind == "given":
            shared["done"] = batches * (self._given_size or 1)
        generators = rng.generator_states(self._generators)
        return shared, {"epoch_start": self._epoch_start, "generators": generators}

    def resume(
        self,
        shared: dict[str, Any],
        own: dict[str, Any] | None,
        first_rank: dict[str, Any],
        epoch: int,
        epoch_step: int,
    ) -> tuple[int, str, str | None]:
        """Continue ``epoch`` where a checkpoint left it (its ``position``).

        ``own`` is this process's part when the file was written by as many
        processes as there are now (else ``None``), ``first_rank`` rank 0's.
        Returns the step this run's epoch continues from, how (``"exact"``;
        ``"inexact"``: replayed, but see the reason; ``"split"``: the rest of
        the epoch split across another number of processes; ``"fresh"``: a
        new epoch on another number of processes; ``"restart"``: the epoch
        starts again), and the reason where it is not exact.
        """
        self._resumed = None  # a later file (a backup after resume_from's) wins whole
        self._check_position(shared, own, first_rank, epoch_step)
        sampler = epoch_batches(self.loader)
        if sampler is not None:
            sampler.seed = self.seed  # the interrupted run's: every later epoch is its epoch too
        part = first_rank if own is None else own  # this process's, or rank 0's
        rng.set_generator_states(self._generators, part["generators"])
        if epoch_step == 0:  # the next epoch starts afresh from the restored states
            return 0, "exact" if own is not None else "fresh", None
        kind = shared.get("kind", "unknown")
        if own is not None and kind == self.kind and kind in ("given", "iterable"):
            self._resumed = (epoch, lambda: self._replay(own, epoch, epoch_step))
            reason = self.inexact_reason()
            return epoch_step, "exact" if reason is None else "inexact", reason
        rest = self._rest_of(shared, first_rank.get("epoch_start"), epoch)
        whole_batches = (self._given_size if sampler is None else sampler.batch_size) is None
        if isinstance(rest, list) and rest and isinstance(rest[0], list) != whole_batches:
            rest = "the checkpoint's run split the epoch into other units (batches, samples)"
        if isinstance(rest, str):
            return 0, "restart", rest
        # As many processes, the same units: each batch as the uninterrupted run read it.
        exact = own is not None and kind == self.kind == "batches"
        # A file without 'padding' beside its 'rest' fails here (KeyError), refused by the caller.
        padding, step = (shared["padding"], epoch_step) if exact else ([], 0)
        loader = self.loader
        if sampler is None:  # the user's loader as given: read the rest through torch-hapi's
            drop_last = getattr(self.given.batch_sampler, "drop_last", False)  # None: no batching
            options = {"batch_size": self._given_size, "drop_last": drop_last, "seed": self.seed}
            sampler = EpochBatches(lambda seed, epoch: rest, len(rest), **options)
            loader = rebuilt(self.given, sampler)
        sampler.resume(epoch, rest, padding, step)
        self._resumed = (epoch, lambda: self._serve(loader, step))
        return step, "exact" if exact else "split", None

    def _check_position(self, shared: Any, own: Any, first_rank: Any, epoch_step: int) -> None:
        """Refuse a position no run writes before any of it is used (it is used batches later).

        Raises:
            ValueError: naming the entry and its value; each random state is set
                once and put back, so that one of another layout fails here.
        """
        kind = shared.get("kind", "unknown")
        if kind not in KINDS:
            raise ValueError(f"'kind' is {kind!r}, not one of {KINDS}")
        for name, least, what in (("world", 1, "processes"), ("done", 0, "samples or batches")):
            if not _is_count(shared.get(name, least), least):
                raise ValueError(f"{name!r} is {shared[name]!r}, not a count of {what}")
        try:
            length = len(getattr(self.given or self.loader, "dataset", None))
        except TypeError:  # an IterableDataset: any index
            length = None
        for name in ("rest", "padding"):  # sample indices, or batches of them
            units = shared.get(name, [])
            if not isinstance(units, list):
                raise ValueError(f"{name!r} is {units!r}, not a list of sample indices")
            if len({isinstance(unit, list) for unit in units}) > 1:
                raise ValueError(f"{name!r} mixes sample indices and batches of them")
            for index in itertools.chain(*(u if isinstance(u, list) else [u] for u in units)):
                if not _is_count(index, 0) or (length is not None and index >= length):
                    raise ValueError(f"{name!r} holds {index!r}, not an index of {length} samples")
        if "rest" in shared and "padding" not in shared:
            raise ValueError("'padding' is missing beside 'rest'")
        if own is not None and self.steps is not None and epoch_step > self.steps:
            raise ValueError(f"'epoch_step' is {epoch_step}, beyond the epoch's {self.steps} steps")
        now = rng.global_state()
        parts = [part for part in (own, first_rank) if part]
        starts = [part.get("epoch_start") for part in parts]
        for state in [*filter(None, starts), *({"global": now, **part} for part in parts)]:
            with self._states_at(state):  # set once and put back: another layout fails here
                pass

    def _replay(self, own: dict[str, Any], epoch: int, epoch_step: int) -> Iterable:
        """The same world, the user's loader as given: its epoch replayed from the random states
        it began with, the first ``epoch_step`` batches read and dropped, then the states of
        the save."""
        set_epoch(self.loader, epoch)
        self._serve(self.loader, 0)
        self._epoch_start = own["epoch_start"]
        with self._states_at(own["epoch_start"]):
            iterator = iter(self.loader)
            for _ in range(epoch_step):
                next(iterator)
        rng.set_generator_states(self._generators, own["generators"])
        return iterator

    def _rest_of(self, shared: dict[str, Any], start: dict[str, Any] | None, epoch: int) -> Any:
        """What is left of the interrupted epoch's stream, as the run that wrote ``shared``
        read it (from the random states ``start`` it began with): a list; or why it cannot be
        had: a str."""
        kind = shared.get("kind", "unknown")
        if kind == "batches":
            return shared.get("rest", "the checkpoint does not say how far its run read the epoch")
        if kind == "given" and self.given is None:
            return "the checkpoint's run read a DataLoader of the user's, and this one has none"
        if kind == "given" and shared.get("world", 1) > 1:
            return (
                "the DataLoader's sampler knew the rank itself, so its order cannot be split "
                "anew on another number of processes"
            )
        if kind == "given" and start is not None:
            with self._states_at(start):
                return self._given_stream(epoch)[shared.get("done", 0) :]
        return self.inexact_reason() or "its order cannot be split anew"

    def _given_stream(self, epoch: int) -> list:
        """The stream of the user's loader as torch's DataLoader iterator draws it: the
        workers' base seed, then the sampler's order; in samples when it batches them."""
        set_epoch(self.given, epoch)
        torch.empty((), dtype=torch.int64).random_(generator=self.given.generator)
        batches = self.given.batch_sampler
        batches = self.given.sampler if batches is None else batches  # no automatic batching
        if isinstance(batches, BatchSampler):
            return list(itertools.chain.from_iterable(batches))
        return list(batches)


def _is_count(value: Any, least: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Integral) and value >= least


def num_batches(loader: Iterable) -> int | None:
    """Batches per pass, or ``None`` when the data cannot tell (iterable data)."""
    try:
        return len(loader)  # type: ignore[arg-type]
    except TypeError:
        return None


def exact_length(loader: Iterable) -> int | None:
    """Batches per pass where the sampler fixes them; ``None`` for iterable data, whose
    ``__len__`` (if any) is only what the data set says of itself."""
    if isinstance(getattr(loader, "dataset", None), IterableDataset):
        return None
    return num_batches(loader)


def with_last(iterable: Iterable, length: int | None = None) -> Iterator[tuple[Any, bool]]:
    """Yield ``(item, is_last)``: at most ``length`` items when it is known, else looking
    one item ahead.

    The loop needs to know which batch is the last one (to log the final
    figures before an evaluation starts) even for data without a length.
    Where the length is known, no batch is fetched before its step: a hand
    loop fetches none either, so loading that draws random numbers in the
    main process draws them at the same moments, and a backup taken after a
    step holds the random state before the next batch's loading.
    """
    if length is not None:
        if length > 0:  # no iterator (no workers started) for an epoch with nothing left
            for index, item in zip(range(length), iterable):
                yield item, index + 1 == length
        return
    end = object()
    for item, upcoming in itertools.pairwise(itertools.chain(iterable, [end])):
        yield item, upcoming is end


# -- what fit decides about its data before any loader is built: batch sizes, the data seed --
#
# ``batch_size`` is an int, or Paddle's pair ``(train, eval)``
# (:func:`batch_sizes`). The data seed orders the shuffle of every epoch and
# seeds the loading of batches that may draw random numbers
# (:class:`hapi.data.SeededDataset`). It is the only number torch-hapi itself draws
# from the global generators in a fit, and it is drawn only when the run
# needs it (:func:`fit_seed`): one ``int64`` in ``[0, 2**31 - 1)`` from
# torch's global CPU generator, on rank 0 (broadcast to the others), when
# ``fit`` starts -- after its arguments are checked, before any callback runs
# or any batch loads. ``evaluate`` and ``predict`` draw nothing. A user's
# DataLoader used as given draws what it draws in a hand loop (its
# ``RandomSampler``'s seed, its workers' base seed, from its own generator or
# torch's), nothing more. A fit that draws nothing trains like a hand-written
# loop seeded alike, its dropout drawing the same numbers.
#
# Not a draw, but a change to global generators: a batch that loads under its
# own seed in the main process leaves Python's and NumPy's global generators
# reseeded by it (torch's is handed back; see :func:`hapi.rng.seeded_streams`).


def batch_sizes(batch_size: Any) -> tuple[int, int]:
    """``fit``'s ``batch_size``: an int for training and evaluation, or a pair ``(train, eval)``.

    Paddle's convention. Evaluation often affords a larger batch (no
    gradients), and a pair gives it one without a DataLoader of its own.

    Raises:
        ValueError: anything else: a non-positive or non-int size, a pair of
            other length, a bool.
    """

    pair = isinstance(batch_size, (tuple, list))
    sizes = batch_size if pair else (batch_size, batch_size)
    if len(sizes) == 2 and all(_is_count(size, 1) for size in sizes):
        return int(sizes[0]), int(sizes[1])
    if not pair:
        raise ValueError(
            f"fit: batch_size must be a positive int; received {batch_size!r} "
            f"({type(batch_size).__name__}). Pass e.g. batch_size=1, or a pair (train, eval) of "
            "positive ints, e.g. batch_size=(32, 64) to evaluate at 64."
        )
    raise ValueError(
        f"fit: batch_size must be a positive int or a pair (train, eval) of positive ints; "
        f"received {batch_size!r} ({type(batch_size).__name__} of {len(batch_size)}). Pass e.g. "
        "batch_size=(32, 64): training at 32, evaluation at 64."
    )


def as_source(data: Any, role: str) -> Any:
    """``data`` as a data set (:func:`hapi.data.as_dataset`), a DataLoader or ``None`` left
    as they are: what is refused is refused before anything is drawn."""
    if data is None or isinstance(data, DataLoader):
        return data
    return as_dataset(data, role)


def fit_seed(source: Any, shuffle: bool) -> int:
    """The fit's data seed over ``source`` (see :func:`as_source`): drawn (see the module)
    where the fit needs one, else 0, which then decides nothing (no order is shuffled and no
    loading draws).

    A fit needs one when torch-hapi shuffles the data (``shuffle=True``), when the
    data set may draw random numbers while loading (its batches then load
    under seeds made from it; a data set says it never draws with a false
    ``draws_random_numbers``, as tensors, lists of samples and hapi's data
    sets without a transform do), and when a user's DataLoader is split
    across several processes (its order is drawn under the seed on every
    process alike). It does not for a DataLoader used as given on one
    process (its own sampler and generator decide, as in a hand loop) or for
    an ``IterableDataset`` (read as it streams).
    """
    if isinstance(source, DataLoader):
        needed = distributed.world_size() > 1 and not isinstance(source.dataset, IterableDataset)
    else:
        needed = not isinstance(source, (type(None), IterableDataset)) and (
            shuffle or may_draw_random_numbers(source)
        )
    return distributed.shared_seed() if needed else 0
