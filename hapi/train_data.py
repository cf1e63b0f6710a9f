"""The training data of one fit: each epoch's batches, and continuing an epoch a checkpoint interrupted.

What decides an epoch's order is kept with every resumable checkpoint, so
that a resumed run reads the rest of that epoch in the original order:

* data torch-hapi batches itself (tensors, a Dataset, a user's DataLoader
  over a plain order on several processes): the order is a function of the
  fit's seed and the epoch (``"indexed"``);
* a user's sampler or batch sampler split across processes: its stream is
  drawn under seeded global generators, and with the generators the sampler
  keeps itself (``SubsetRandomSampler(generator=g)``) as they were when the
  epoch began (``"stream"``);
* a user's DataLoader used as given (one process): torch's own iterator
  draws the order from the global generators and those the loader and its
  samplers keep, as they were when the epoch began (``"given"``).

On the same number of processes a resume replays the epoch's start with
those states and skips the batches already trained (without loading them
where the sampler allows), then puts back the random states of the moment
of the save: the resumed run equals the uninterrupted one. On another number
of processes the epoch's whole stream is computed as the saving run saw it,
and its rest is split across the processes there are now, each remaining
sample trained once. Where neither can be had (an ``IterableDataset``'s
stream, a rank-aware sampler of the user's) :meth:`TrainData.inexact_reason`
says why, before training.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from hapi import distributed
from hapi.data import exact_length, num_batches, rebuilt
from hapi.rng import (
    generator_states,
    generators_of,
    global_state,
    set_generator_states,
    set_global_state,
)
from hapi.seeded_loader import SeededDataset, SeededLoader


@dataclass
class _ResumedEpoch:
    """The epoch a resume continues, and what reads its remaining batches."""

    epoch: int
    start: Callable[[], Iterable]


class TrainData:
    """The batches of each epoch of one ``fit``, and the position a checkpoint records.

    ``loader`` is what :func:`hapi.data.make_loader` built for this process;
    ``given`` the user's own DataLoader, when one was passed (its samplers and
    generators decide the order, also when ``loader`` reads a share of it).
    """

    def __init__(self, loader: Iterable, given: Any, seed: int) -> None:
        self.loader = loader
        self.given = given if isinstance(given, DataLoader) else None
        self.seed = seed
        # The generators a user's loader and its samplers keep (found once: the same objects all fit).
        self._generators = generators_of(self.given) if self.given is not None else {}
        self._serving: Iterable = loader  # this epoch's loader (a resumed epoch may read another)
        self._epoch_start: dict[str, Any] | None = None  # random states when this epoch began
        self._inherited: dict[str, Any] | None = None  # a resumed epoch's order, from its file
        self._resumed: _ResumedEpoch | None = None
        self._steps: int | None = exact_length(loader)

    # -- what the loop reads --------------------------------------------------
    @property
    def steps(self) -> int | None:
        """Batches of the epoch being read, counted as its steps are (``None``: unknown): a
        resumed epoch's first step is the one it continues at."""
        return self._steps

    @property
    def steps_per_epoch(self) -> int | None:
        return num_batches(self.loader)

    def epoch(self, epoch: int) -> Iterable:
        """Epoch ``epoch``'s batches: all of them, or the rest of a resumed epoch."""
        distributed.set_epoch(self.loader, epoch)
        resumed, self._resumed = self._resumed, None
        if resumed is not None and resumed.epoch == epoch:
            return resumed.start()
        self._serving, self._inherited = self.loader, None
        self._steps = exact_length(self.loader)
        self._epoch_start = {
            "global": global_state(),
            "generators": generator_states(self._generators),
        }
        return self.loader

    # -- what a checkpoint records ------------------------------------------------
    @property
    def kind(self) -> str:
        sampler = distributed.resumable(self.loader)
        if isinstance(sampler, distributed.ResumableSampler):
            return "indexed"
        if sampler is not None:
            return "stream"
        if self.given is None or isinstance(self.given.dataset, IterableDataset):
            return "iterable"
        return "given"

    def inexact_reason(self) -> str | None:
        """Why a resumed epoch of this data cannot equal the uninterrupted one, or ``None``."""
        if self.kind == "iterable":
            return (
                "the training data is an IterableDataset: a resumed epoch reads its stream again "
                "from the start and drops the batches already trained, which is exact only if the "
                "stream yields the same items in the same order again"
            )
        if self.kind == "given" and self.given.persistent_workers and self.given.num_workers > 0:
            return (
                "the DataLoader keeps its workers across epochs (persistent_workers=True), so "
                "the random state of its workers cannot be replayed; pass "
                "persistent_workers=False"
            )
        return None

    def position(self, batches: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Where this epoch is after ``batches`` steps: what every process shares (rank 0's
        is kept), and this process's own random states (each keeps its own)."""
        shared = {
            "order": self._inherited or self._order(),
            "inherited": self._inherited is not None,
            "items": self._items(batches),
        }
        own = {
            "epoch_start": self._epoch_start,
            "generators": generator_states(self._generators),
        }
        return shared, own

    def _order(self) -> dict[str, Any]:
        """What the epoch's order follows from, for a run on another number of processes."""
        order: dict[str, Any] = {
            "kind": self.kind,
            "epoch_start": self._epoch_start,
            "world": distributed.world_size(),
        }
        sampler = distributed.resumable(self.loader)
        if order["kind"] == "indexed":
            order.update(shuffle=sampler.shuffle, length=len(sampler.dataset))
        elif order["kind"] == "stream":
            order["unit"] = (
                "batches" if isinstance(sampler, distributed.BatchSamplerShard) else "items"
            )
        elif order["kind"] == "given":
            order["unit"] = "items" if self.given.batch_size is not None else "batches"
        return order

    def _items(self, batches: int) -> int | None:
        """How far into the epoch's whole stream (samples, or batches of a batch sampler)."""
        if distributed.resumable(self._serving) is not None:
            return distributed.consumed_items(self._serving, batches)
        if self.kind == "given" and distributed.world_size() == 1:
            return batches * (self.given.batch_size or 1)
        return None

    # -- resuming -------------------------------------------------------------------
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
        self._check_position(shared, own, first_rank, epoch_step)
        distributed.set_seed(self.loader, self.seed)
        set_generator_states(self._generators, (first_rank if own is None else own)["generators"])
        if epoch_step == 0:  # the next epoch starts afresh from the restored states
            return 0, "exact" if own is not None else "fresh", None
        if own is not None and not shared["inherited"] and shared["order"]["kind"] == self.kind:
            start = {"indexed": self._skip, "stream": self._skip}.get(self.kind, self._replay)
            self._resumed = _ResumedEpoch(epoch, lambda: start(shared["items"], own, epoch_step))
            reason = self.inexact_reason()
            return epoch_step, "exact" if reason is None else "inexact", reason
        items = shared["items"]
        stream, reason = (
            (None, "the checkpoint does not say how far its run read the epoch")
            if items is None
            else self._stream_of(shared["order"], epoch)
        )
        if stream is None:
            return 0, "restart", reason
        self._resumed = _ResumedEpoch(
            epoch, lambda: self._serve_rest(stream, items, shared["order"], epoch)
        )
        return 0, "split", None

    def _check_position(self, shared: Any, own: Any, first_rank: Any, epoch_step: int) -> None:
        """Refuse a position no run writes before any of it is used (it is used batches later).

        Raises:
            ValueError: naming the entry and its value; each random state is set
                once and put back, so that one of another layout fails here.
        """
        order, items = shared.get("order"), shared.get("items")
        kinds = ("indexed", "stream", "given", "iterable", "unknown")
        if not isinstance(order, dict) or order.get("kind") not in kinds:
            raise ValueError(f"'order' is {order!r}, not a dict whose 'kind' is one of {kinds}")
        if items is not None and (
            isinstance(items, bool) or not isinstance(items, int) or items < 0
        ):
            raise ValueError(f"'items' is {items!r}, not a count of samples or batches")
        if items is None and epoch_step and order["kind"] in ("indexed", "stream"):
            raise ValueError("'items' is None: the position in the epoch's order is unknown")
        if not isinstance(shared.get("inherited", False), bool):
            raise ValueError(f"'inherited' is {shared['inherited']!r}, not True or False")
        if own is not None and self.steps is not None and epoch_step > self.steps:
            raise ValueError(
                f"'epoch_step' is {epoch_step}, beyond the epoch's {self.steps} batches"
            )
        starts = [order.get("epoch_start")] + [
            part.get("epoch_start") for part in (own, first_rank) if part
        ]
        states = [s["global"] for s in starts if s is not None]
        generators = [s["generators"] for s in (*starts, own, first_rank) if s is not None]
        now, generators_now = global_state(), generator_states(self._generators)
        try:
            for state in states:
                set_global_state(state)
            for state in generators:
                set_generator_states(self._generators, state)
        finally:
            set_global_state(now)
            set_generator_states(self._generators, generators_now)

    def _skip(self, items: int, own: dict[str, Any], epoch_step: int) -> Iterable:
        """The same world, a loader torch-hapi built: skip the samples done (never loaded)."""
        self._serving, self._inherited = self.loader, None
        self._epoch_start = own["epoch_start"]
        sampler = distributed.resumable(self.loader)
        sampler.resumed_at = 0
        if self.kind == "stream":  # drawn with the sampler's generators as the epoch began
            set_generator_states(self._generators, own["epoch_start"]["generators"])
            sampler.use_stream(sampler.stream())
            set_generator_states(self._generators, own["generators"])
        distributed.skip_items(self.loader, items)
        sampler.resumed_at = items - distributed.consumed_items(self.loader, epoch_step)
        rest = exact_length(self.loader)  # the sampler's length is now the epoch's rest
        self._steps = None if rest is None else epoch_step + rest
        if isinstance(self.loader, SeededLoader):
            self.loader.start_at(epoch_step)  # the batches keep the seeds of their positions
        return self.loader

    def _replay(self, items: int, own: dict[str, Any], epoch_step: int) -> Iterable:
        """The same world, the user's loader as given: its epoch replayed from the random states
        it began with, the first ``epoch_step`` batches skipped, then the states of the save."""
        self._serving, self._inherited = self.loader, None
        self._epoch_start = own["epoch_start"]
        self._steps = exact_length(self.loader)
        now = global_state()
        set_global_state(own["epoch_start"]["global"])
        set_generator_states(self._generators, own["epoch_start"]["generators"])
        iterator = iter(self.loader)
        # A map-style data set without workers: skip indices, not batches (nothing is
        # loaded). Workers get their batches in turn, so there the batches are read, to
        # keep each batch on its worker; an IterableDataset's stream is read too.
        indexed = self.kind == "given" and self.given.num_workers == 0
        skip = getattr(iterator, "_next_index", None) if indexed else None
        for _ in range(epoch_step):
            skip() if skip is not None else next(iterator)
        set_global_state(now)
        set_generator_states(self._generators, own["generators"])
        return iterator

    def _stream_of(self, order: dict[str, Any], epoch: int) -> tuple[list | None, str | None]:
        """The epoch's whole stream as the run that wrote ``order`` read it, or why not."""
        kind = order["kind"]
        if kind == "indexed":
            dataset = self._dataset()
            if dataset is None or len(dataset) != order["length"]:
                return None, "the training data set is not the one the checkpoint's run read"
            sampler = distributed.ResumableSampler(
                dataset, num_replicas=1, rank=0, shuffle=order["shuffle"], seed=self.seed
            )
            sampler.set_epoch(epoch)
            return sampler.order(), None
        if kind in ("stream", "given") and self.given is None:
            return (
                None,
                "the checkpoint's run read a DataLoader of the user's, and this one has none",
            )
        if kind == "given" and order.get("world", 1) > 1:
            return None, (
                "the DataLoader's sampler knew the rank itself, so its order cannot be split "
                "anew on another number of processes"
            )
        if kind in ("stream", "given"):
            return self._with_states(order["epoch_start"], lambda: self._user_stream(order, epoch))
        return None, self.inexact_reason() or "its order cannot be split anew"

    def _with_states(self, states: dict[str, Any], draw: Callable[[], list]) -> tuple[list, None]:
        """``draw()`` with the random states of an epoch's start; the present ones afterwards."""
        now, generators_now = global_state(), generator_states(self._generators)
        set_global_state(states["global"])
        set_generator_states(self._generators, states["generators"])
        try:
            return draw(), None
        finally:
            set_global_state(now)
            set_generator_states(self._generators, generators_now)

    def _user_stream(self, order: dict[str, Any], epoch: int) -> list:
        given = self.given
        if order["kind"] == "stream":
            source = (
                given.batch_sampler
                if order["unit"] == "batches"
                else distributed.index_sampler(given)
            )
            shard_type = (
                distributed.BatchSamplerShard
                if order["unit"] == "batches"
                else distributed.SamplerShard
            )
            shard = shard_type(source, 1, 0, self.seed, True)
            shard.set_epoch(epoch)
            return shard.stream()
        # As torch's DataLoader iterator draws: the sampler's iterator, the workers' base seed,
        # then the sampler's order.
        sampler = given.batch_sampler if given.batch_sampler is not None else given.sampler
        indices = iter(sampler)
        if not (given.persistent_workers and given.num_workers > 0 and epoch > 0):
            torch.empty((), dtype=torch.int64).random_(generator=given.generator)
        batches = list(indices)
        if order["unit"] == "items" and isinstance(sampler, BatchSampler):
            return list(itertools.chain.from_iterable(batches))
        return batches

    def _serve_rest(self, stream: list, items: int, order: dict[str, Any], epoch: int) -> Iterable:
        """Another world: the stream's rest, split across the processes there are now."""
        rest = stream[items:]
        base = self.loader if self.given is None else self.given
        if order.get("unit") == "batches":
            share = {
                "batch_sampler": distributed.BatchSamplerShard(
                    rest, distributed.world_size(), distributed.rank(), self.seed, True
                )
            }
        else:
            share = {
                "sampler": distributed.SamplerShard(
                    rest, distributed.world_size(), distributed.rank(), self.seed, True
                ),
                "batch_size": distributed.loader_batch_size(base),
                "drop_last": bool(getattr(base, "drop_last", False)),
            }
        loader = rebuilt(base, share, training=True, seed=self.seed)
        distributed.set_epoch(loader, epoch)
        distributed.resumable(loader).resumed_at = items
        self._serving, self._inherited = loader, order
        self._steps = exact_length(loader)
        return loader

    def _dataset(self) -> Any:
        dataset = getattr(self.loader if self.given is None else self.given, "dataset", None)
        return dataset.dataset if isinstance(dataset, SeededDataset) else dataset
