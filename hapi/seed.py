"""``hapi.seed_everything``: one call that makes a run reproducible, with a stream per process.

Seeding every process alike (``torch.manual_seed(0)`` at the top of a
script run by torchrun) makes every process draw the same random numbers:
a GAN's ``train_step`` feeds the same noise to every copy of the generator,
dropout drops the same units on every rank, and the processes' batches are
less independent than they look. Seeding each process differently by hand
(``torch.manual_seed(seed + rank)``) fixes that but makes seeds of
neighbouring runs overlap (seed 1 on rank 0 is seed 0 on rank 1).

:func:`seed_everything` seeds Python's, NumPy's and torch's global
generators (CPU and every CUDA device) with a seed that depends only on
the run's seed and the process's rank, read from the launcher before any
Model exists. What stays agreed across processes does so without the
seed: every strategy that trains on several processes starts from rank 0's
weights (DDP broadcasts them; FSDP and a ``train_step`` of your own copy
them), and ``fit`` draws its shuffling seed on rank 0 and sends it to the
others. A DataLoader's workers need nothing more: ``fit`` loads each
training batch under a seed of (shuffling seed, epoch, batch, rank).
"""

from __future__ import annotations

import random

import numpy as np
import torch

from hapi import distributed
from hapi.rng import mix


def seed_everything(seed: int, per_process: bool = True) -> int:
    """Seed Python's ``random``, NumPy's and torch's global generators; returns this process's seed.

    Call it once at the top of the script, before building the network
    (every process runs it with the same ``seed``). A run started again with
    the same seed on as many processes draws the same numbers on each.

    Args:
        seed: the run's seed, an integer from 0 to 2**63 - 1.
        per_process: give every process its own stream (the default), so the
            noise a ``train_step`` of your own draws and the units dropout
            drops differ between processes. Rank 0's stream is ``seed``
            itself, so on one process this equals ``torch.manual_seed(seed)``,
            ``numpy.random.seed(seed)`` and ``random.seed(seed)``; rank r > 0
            gets an unrelated seed mixed from (seed, r). ``False`` seeds
            every process alike, as Lightning's ``seed_everything`` does.

    Returns:
        The seed this process's generators got (NumPy's: its low 32 bits).

    Raises:
        TypeError: ``seed`` is not an integer.
        ValueError: ``seed`` is negative or does not fit in 63 bits.
    """
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
    rank = distributed.rank() if per_process else 0
    own = seed if rank == 0 else mix(seed, rank)
    random.seed(own)
    np.random.seed(own & 0xFFFFFFFF)
    torch.manual_seed(own)  # every CUDA device's generator too
    return own
