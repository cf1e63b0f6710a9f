"""Random streams that depend only on what they are named after.

Data loading may draw random numbers (augmentation in ``__getitem__``, a
user's sampler shuffling). For a resumed run to equal an uninterrupted one,
and for every process to agree on a sampler's order, those draws must
depend only on (seed, epoch, batch position, rank) -- not on how many draws
came before them, which a restart, a look-ahead fetch or another worker
assignment changes. :func:`seeded_streams` gives a block of code fresh
streams seeded that way and hands torch's previous one back afterwards, so
the model's own draws (dropout) are never shifted by loading.

A leaf module: it imports nothing from torch-hapi.
"""

from __future__ import annotations

import contextlib
import random
from typing import Iterator

import numpy as np
import torch

_MASK64 = 2**64 - 1


def mix(*numbers: int) -> int:
    """A 63-bit seed from ``numbers`` (SplitMix64 steps): nearby inputs give unrelated seeds."""
    state = 0x9E3779B97F4A7C15
    for number in numbers:
        state = (state ^ (int(number) & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        state = (state ^ (state >> 27)) * 0x94D049BB133111EB & _MASK64
        state ^= state >> 31
    return state >> 1


@contextlib.contextmanager
def seeded_streams(seed: int, hand_back_torch: bool = True) -> Iterator[None]:
    """Run the block with torch's CPU generator, Python's and NumPy's global ones seeded by ``seed``.

    With ``hand_back_torch`` (the main process), torch's generator gets its
    previous state back afterwards, so the model's draws (dropout) never
    shift. Python's and NumPy's stay reseeded: saving and restoring their
    states costs 40-130 us a batch here against 2 us for torch's, and what
    the model draws from them is then a function of the batch's seed too,
    which keeps a resumed run exact. A DataLoader worker draws only for
    loading and hands nothing back. CUDA generators are left alone: loading
    runs on the CPU.
    """
    generator = torch.default_generator
    saved = generator.get_state() if hand_back_torch else None
    generator.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)
    try:
        yield
    finally:
        if saved is not None:
            generator.set_state(saved)
