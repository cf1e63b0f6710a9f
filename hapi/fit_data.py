"""What ``fit`` decides about its data before any loader is built: batch sizes and the data seed.

``batch_size`` is an int, or Paddle's pair ``(train, eval)``
(:func:`batch_sizes`). The data seed orders the shuffle of every epoch and
seeds the loading of batches that may draw random numbers
(:class:`hapi.data.SeededDataset`). It is the only number torch-hapi itself draws
from the global generators in a fit, and it is drawn only when the run
needs it (:func:`needs_seed`): one ``int64`` in ``[0, 2**31 - 1)`` from
torch's global CPU generator, on rank 0 (broadcast to the others), when
``fit`` starts -- after its arguments are checked, before any callback runs
or any batch loads. ``evaluate`` and ``predict`` draw nothing. A user's
DataLoader used as given draws what it draws in a hand loop (its
``RandomSampler``'s seed, its workers' base seed, from its own generator or
torch's), nothing more. A fit that draws nothing trains like a hand-written
loop seeded alike, its dropout drawing the same numbers.

Not a draw, but a change to global generators: a batch that loads under its
own seed in the main process leaves Python's and NumPy's global generators
reseeded by it (torch's is handed back; see :func:`hapi.rng.seeded_streams`).
"""

from __future__ import annotations

import numbers
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from hapi import distributed
from hapi.data import as_dataset, may_draw_random_numbers


def batch_sizes(batch_size: Any) -> tuple[int, int]:
    """``fit``'s ``batch_size``: an int for training and evaluation, or a pair ``(train, eval)``.

    Paddle's convention. Evaluation often affords a larger batch (no
    gradients), and a pair gives it one without a DataLoader of its own.

    Raises:
        ValueError: anything else: a non-positive or non-int size, a pair of
            other length, a bool.
    """

    def positive(value: Any) -> bool:
        return not isinstance(value, bool) and isinstance(value, numbers.Integral) and value > 0

    if positive(batch_size):
        return int(batch_size), int(batch_size)
    if not isinstance(batch_size, (tuple, list)):
        raise ValueError(
            f"fit: batch_size must be a positive int; received {batch_size!r} "
            f"({type(batch_size).__name__}). Pass e.g. batch_size=1, or a pair (train, eval) of "
            "positive ints, e.g. batch_size=(32, 64) to evaluate at 64."
        )
    if len(batch_size) == 2 and all(positive(size) for size in batch_size):
        return int(batch_size[0]), int(batch_size[1])
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


def needs_seed(source: Any, shuffle: bool) -> bool:
    """Whether a fit over ``source`` (see :func:`as_source`) needs a data seed drawn.

    It does when torch-hapi shuffles the data (``shuffle=True``), when the
    data set may draw random numbers while loading (its batches then load
    under seeds made from it; a data set says it never draws with a false
    ``draws_random_numbers``, as tensors, lists of samples and hapi's data
    sets without a transform do), and when a user's DataLoader is split
    across several processes (its order is drawn under the seed on every
    process alike). It does not for a DataLoader used as given on one
    process (its own sampler and generator decide, as in a hand loop) or for
    an ``IterableDataset`` (read as it streams).
    """
    if source is None:
        return False
    if isinstance(source, DataLoader):
        return distributed.world_size() > 1 and not isinstance(source.dataset, IterableDataset)
    if isinstance(source, IterableDataset):
        return False
    return shuffle or may_draw_random_numbers(source)


def fit_seed(source: Any, shuffle: bool) -> int:
    """The fit's data seed: drawn (see the module) when :func:`needs_seed`, else 0, which
    then decides nothing: no order is shuffled and no loading draws."""
    return distributed.shared_seed() if needs_seed(source, shuffle) else 0
