"""``hapi.seed_everything``: one call that makes a run reproducible, with a stream per process.

Seeding every process alike (``torch.manual_seed(0)`` at the top of a script run by
torchrun) makes every process draw the same random numbers during training: a GAN's
``train_step`` feeds the same noise to every copy of the generator, dropout drops the same
units on every rank, and the processes' batches are less independent than they look.
Seeding each process differently at the top (``torch.manual_seed(seed + rank)``) breaks
what must agree: synthetic data or a split made after seeding then differs per process, and
``fit`` would shard a different data set on each.

:func:`seed_everything` does both, each at its moment. At the call it seeds Python's, NumPy's
and torch's global generators (CPU and every CUDA device) alike on every process, so what
the script builds next -- data, splits, the network -- is the same everywhere. Then, with
``per_process=True``, each ``fit`` moves every process but the first to a stream of its own,
mixed from (seed, rank, the how-many-th fit since seeding), before it draws anything: the
noise and dropout of training differ between processes and are the same run after run. The
first process keeps the stream it had, so one process trains exactly as a hand loop seeded
with ``torch.manual_seed(seed)`` does. ``fit``'s shuffling stays agreed (it is drawn on the
first process and sent to the others); a DataLoader's workers need nothing more (``fit``
loads each batch under a seed of (shuffling seed, epoch, batch, rank)). A resume puts every
process's saved generator states back, so it continues each stream exactly.
"""

from __future__ import annotations

import numpy as np
import torch

from hapi import distributed
from hapi.rng import mix, seed_python_and_numpy

_per_process_seed: int | None = None  # the seed of the last seed_everything(per_process=True)
_fits_since_seeding = 0


def seed_everything(seed: int, per_process: bool = True) -> int:
    """Seed Python's ``random``, NumPy's and torch's global generators alike on every process.

    Call it once at the top of the script, before building data and network (every
    process runs it with the same ``seed``). A run started again with the same seed on as
    many processes draws the same numbers on each.

    Args:
        seed: the run's seed, an integer from 0 to 2**63 - 1.
        per_process: give every process its own stream for training (the default): each
            ``fit`` moves every process but the first to a stream mixed from (seed, rank,
            fit number), so the noise a ``train_step`` of your own draws and the units
            dropout drops differ between processes. ``False`` leaves every process on the
            same stream, as Lightning's ``seed_everything`` does.

    Returns:
        ``seed``: what every process's generators got (NumPy's: its low 32 bits).

    Raises:
        TypeError: ``seed`` is not an integer.
        ValueError: ``seed`` is negative or does not fit in 63 bits.
    """
    global _per_process_seed, _fits_since_seeding
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(
            f"seed_everything(seed) needs an integer seed; received {type(seed).__name__} "
            f"{seed!r}. Pass e.g. hapi.seed_everything(42)."
        )
    seed = int(seed)
    if not 0 <= seed < 2**63:
        raise ValueError(
            f"seed_everything(seed) takes a seed from 0 to 2**63 - 1; received {seed}. Pass a "
            "non-negative integer that fits in 63 bits."
        )
    _seed_generators(seed)
    _per_process_seed = seed if per_process else None
    _fits_since_seeding = 0
    return seed


def streams_for_training() -> None:
    """At the start of ``fit``: after ``seed_everything(per_process=True)``, every process but
    the first moves to a stream of its own for this fit (see the module's docstring)."""
    global _fits_since_seeding
    if _per_process_seed is None:
        return
    _fits_since_seeding += 1  # counted on every process alike: each fit has its own streams
    rank = distributed.rank()
    if rank != 0:
        _seed_generators(mix(_per_process_seed, rank, _fits_since_seeding))


def _seed_generators(seed: int) -> None:
    seed_python_and_numpy(seed)
    torch.manual_seed(seed)  # every CUDA device's generator too
