"""The training data of one fit: each epoch's batches, and continuing an epoch a checkpoint interrupted.

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
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from hapi import distributed
from hapi.data import (
    EpochBatches,
    epoch_batches,
    exact_length,
    loader_batch_size,
    num_batches,
    rebuilt,
    set_epoch,
)
from hapi.rng import (
    generator_states,
    generators_of,
    global_state,
    set_generator_states,
    set_global_state,
)

KINDS = ("batches", "given", "iterable", "unknown")


class TrainData:
    """The batches of each epoch of one ``fit``, and the position a checkpoint records.

    ``loader`` is what :func:`hapi.data.make_loader` built for this process;
    ``given`` the user's own DataLoader, when one was passed (its samplers and
    generators decide the order, also when ``loader`` reads a share of it).
    ``steps`` counts the batches of the epoch being read as its steps are
    (``None``: unknown): a resumed epoch's first step is the one it continues at.
    """

    def __init__(self, loader: Iterable, given: Any, seed: int) -> None:
        self.loader = loader
        self.given = given if isinstance(given, DataLoader) else None
        self.seed = seed
        # The generators a user's loader and its samplers keep (found once: the same objects all fit).
        self._generators = generators_of(self.given)
        if epoch_batches(loader) is not None:
            self.kind = "batches"
        elif self.given is None or isinstance(self.given.dataset, IterableDataset):
            self.kind = "iterable"
        else:
            self.kind = "given"
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
        self._serving, self._first_step = loader, first_step
        rest = exact_length(loader)
        self.steps = None if rest is None else first_step + rest
        return loader

    def _states(self) -> dict[str, Any]:
        return {"global": global_state(), "generators": generator_states(self._generators)}

    @contextlib.contextmanager
    def _states_at(self, start: dict[str, Any]) -> Iterator[None]:
        """Run the block with the global generators and the loader's at ``start``; then give
        each the state it had before."""
        now = self._states()
        try:
            set_global_state(start["global"])
            set_generator_states(self._generators, start["generators"])
            yield
        finally:
            set_global_state(now["global"])
            set_generator_states(self._generators, now["generators"])

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
        is kept), and this process's own random states (each keeps its own: rank 0's
        ``epoch_start`` is what a resume on another number of processes draws from)."""
        sampler = epoch_batches(self._serving)  # a resumed epoch's, maybe
        kind = "batches" if sampler is not None else self.kind
        shared: dict[str, Any] = {"kind": kind, "world": distributed.world_size()}
        if sampler is not None and batches:
            shared.update(sampler.state(batches - self._first_step))
        elif kind == "given":
            shared["done"] = batches * (self._given_batch_size() or 1)
        own = {"epoch_start": self._epoch_start, "generators": generator_states(self._generators)}
        return shared, own

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
        set_generator_states(self._generators, (first_rank if own is None else own)["generators"])
        if epoch_step == 0:  # the next epoch starts afresh from the restored states
            return 0, "exact" if own is not None else "fresh", None
        kind = shared.get("kind", "unknown")
        same_units = "rest" in shared and self._in_units(shared["rest"])[0] is not None
        if own is not None and kind == self.kind == "batches" and same_units:
            self._continue(
                self.loader, sampler, epoch, shared["rest"], shared["padding"], epoch_step
            )
            return epoch_step, "exact", None
        if own is not None and kind == self.kind and kind in ("given", "iterable"):
            self._resumed = (epoch, lambda: self._replay(own, epoch, epoch_step))
            reason = self.inexact_reason()
            return epoch_step, "exact" if reason is None else "inexact", reason
        rest, reason = self._rest_of(shared, first_rank.get("epoch_start"), epoch)
        if rest is None:
            return 0, "restart", reason
        loader = self.loader
        if sampler is None:  # the user's loader as given: read the rest through torch-hapi's
            drop_last = getattr(self.given.batch_sampler, "drop_last", self.given.drop_last)
            sampler = EpochBatches(
                lambda seed, epoch: [],
                0,
                batch_size=self._given_batch_size(),
                drop_last=bool(drop_last),
                seed=self.seed,
            )
            loader = rebuilt(self.given, sampler)
        self._continue(loader, sampler, epoch, rest, [], 0)
        return 0, "split", None

    def _continue(
        self,
        loader: Iterable,
        sampler: EpochBatches,
        epoch: int,
        rest: list,
        padding: list,
        step: int,
    ) -> None:
        """Serve ``rest`` of epoch ``epoch``'s stream as the epoch's batches from ``step`` on."""
        sampler.resume(epoch, rest, padding, step)
        self._resumed = (epoch, lambda: self._serve(loader, step))

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
            value = shared.get(name, least)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name!r} is {value!r}, not a count of {what}")
        try:
            length = len(getattr(self.given or self.loader, "dataset", None))
        except TypeError:  # an IterableDataset: no index to check
            length = None
        for name in ("rest", "padding"):
            if name in shared:
                _check_units(name, shared[name], length)
        if "rest" in shared and "padding" not in shared:
            raise ValueError("'padding' is missing beside 'rest'")
        if own is not None and self.steps is not None and epoch_step > self.steps:
            raise ValueError(
                f"'epoch_step' is {epoch_step}, beyond the epoch's {self.steps} batches"
            )
        now = global_state()
        for part in (own, first_rank):
            if part:
                for state in (part.get("epoch_start"), {"global": now, **part}):
                    if state is not None:
                        with self._states_at(state):
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
        set_generator_states(self._generators, own["generators"])
        return iterator

    def _rest_of(
        self, shared: dict[str, Any], start: dict[str, Any] | None, epoch: int
    ) -> tuple[list | None, str | None]:
        """What is left of the interrupted epoch's stream, as the run that wrote ``shared``
        read it (from the random states ``start`` it began with), or why it cannot be had."""
        kind = shared.get("kind", "unknown")
        if kind == "batches":
            if "rest" not in shared:
                return None, "the checkpoint does not say how far its run read the epoch"
            return self._in_units(shared["rest"])
        if kind == "given" and self.given is None:
            return (
                None,
                "the checkpoint's run read a DataLoader of the user's, and this one has none",
            )
        if kind == "given" and shared.get("world", 1) > 1:
            return None, (
                "the DataLoader's sampler knew the rank itself, so its order cannot be split "
                "anew on another number of processes"
            )
        if kind == "given" and start is not None:
            with self._states_at(start):
                stream = self._given_stream(epoch)
            return self._in_units(stream[shared.get("done", 0) :])
        return None, self.inexact_reason() or "its order cannot be split anew"

    def _in_units(self, rest: list) -> tuple[list | None, str | None]:
        """``rest`` if this run reads its units (samples, or a batch sampler's batches)."""
        sampler = epoch_batches(self.loader)
        whole_batches = (
            self._given_batch_size() if sampler is None else sampler.batch_size
        ) is None
        if rest and isinstance(rest[0], list) != whole_batches:
            return None, "the checkpoint's run split the epoch into other units (batches, samples)"
        return rest, None

    def _given_batch_size(self) -> int | None:
        """Samples per batch of the user's loader; ``None`` where its items are whole batches
        of a batch sampler of the user's own (torch's ``BatchSampler`` batches samples)."""
        given = self.given
        if given.batch_size is None and not isinstance(given.batch_sampler, BatchSampler):
            return None
        return loader_batch_size(given)

    def _given_stream(self, epoch: int) -> list:
        """The stream of the user's loader as torch's DataLoader iterator draws it: the
        workers' base seed, then the sampler's order; in samples when it batches them."""
        given = self.given
        set_epoch(given, epoch)
        torch.empty((), dtype=torch.int64).random_(generator=given.generator)
        batches = given.batch_sampler if given.batch_sampler is not None else given.sampler
        stream = list(batches)
        if isinstance(batches, BatchSampler):
            return list(itertools.chain.from_iterable(stream))
        return stream


def _check_units(name: str, units: Any, length: int | None) -> None:
    """A stream's units as a run writes them: sample indices, or batches of them."""
    if not isinstance(units, list):
        raise ValueError(f"{name!r} is {type(units).__name__}, not a list of sample indices")
    if len({isinstance(unit, list) for unit in units}) > 1:
        raise ValueError(f"{name!r} mixes sample indices and batches of them")
    for unit in units:
        for index in unit if isinstance(unit, list) else [unit]:
            if (
                isinstance(index, bool)
                or not isinstance(index, int)
                or index < 0
                or (length is not None and index >= length)
            ):
                raise ValueError(
                    f"{name!r} holds {index!r}, not a sample index below the data's {length}"
                )
