"""Where a loader is in its epoch: how far a run went, and starting the next pass further on.

What ``BackupAndRestore`` and a resume need from the samplers of
:mod:`hapi.distributed.samplers`: the position counted in samples of the
epoch's whole stream (so a resume on another number of processes continues
it), skipping into an epoch, and the epoch and seed of a pass. No collective.
"""

from __future__ import annotations

from typing import Any

from hapi.distributed.group import world_size
from hapi.distributed.samplers import (  # noqa: F401 -- loader_batch_size is re-exported
    BatchSamplerShard,
    ResumableSampler,
    _StreamShard,
    loader_batch_size,
)


def resumable(loader: Any) -> Any:
    """The sampler torch-hapi built for ``loader`` that can skip into an epoch, or ``None``."""
    for sampler in (getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)):
        if isinstance(sampler, (ResumableSampler, _StreamShard)):
            return sampler
    return None


def _items_per_batch(loader: Any, sampler: Any) -> int | None:
    """Items of the epoch's whole stream that one step of every process reads."""
    if isinstance(sampler, BatchSamplerShard):
        return world_size()  # whole batches are the stream's items
    batch_size = getattr(loader, "batch_size", None)
    return batch_size * world_size() if batch_size else None


def consumed_items(loader: Any, batches: int) -> int | None:
    """How far into the epoch's whole stream this run is after ``batches`` steps of every
    process (``None`` when torch-hapi did not build the sampler)."""
    sampler = resumable(loader)
    per_batch = None if sampler is None else _items_per_batch(loader, sampler)
    return None if per_batch is None else sampler.resumed_at + batches * per_batch


def skip_items(loader: Any, items: int) -> bool:
    """Make the next iteration of ``loader`` start ``items`` into the epoch's whole stream.

    The rest of the epoch is then split across the current processes, whatever
    their number; skipped samples are not even loaded. False when torch-hapi did
    not build the sampler.
    """
    sampler = resumable(loader)
    if sampler is None or _items_per_batch(loader, sampler) is None:
        return False
    sampler.skip_next(items)
    return True


def set_seed(loader: Any, seed: int) -> None:
    """Make the sampler torch-hapi built use ``seed`` (a resumed run's); a SeededLoader's
    batch seeds follow it."""
    sampler = resumable(loader)
    if sampler is not None:
        sampler.seed = seed
        sampler.set_epoch(sampler.epoch)


def set_epoch(loader: Any, epoch: int) -> None:
    """Tell the sampler which epoch starts, so each epoch reshuffles (all ranks alike)."""
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
