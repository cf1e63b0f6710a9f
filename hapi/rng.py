"""Random streams that depend only on what they are named after.

Data loading may draw random numbers (augmentation in ``__getitem__``, a
user's sampler shuffling). For a resumed run to equal an uninterrupted one,
and for every process to agree on a sampler's order, those draws must
depend only on (seed, epoch, batch position, rank) -- not on how many draws
came before them, which a restart, a look-ahead fetch or another worker
assignment changes. :func:`seeded_streams` gives a block of code fresh
streams seeded that way and hands the previous ones back afterwards, so the
model's own draws (dropout) are never shifted by loading.

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
def seeded_streams(seed: int, restore: bool = True) -> Iterator[None]:
    """Run the block with torch's CPU generator, Python's and NumPy's global ones seeded by ``seed``.

    With ``restore`` (the main process), the generators' previous states
    come back afterwards. A DataLoader worker draws only for loading, so it
    need not restore. CUDA generators are left alone: loading runs on the CPU.
    """
    generator = torch.default_generator
    saved = (generator.get_state(), random.getstate(), np.random.get_state()) if restore else None
    generator.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)
    try:
        yield
    finally:
        if saved is not None:
            generator.set_state(saved[0])
            random.setstate(saved[1])
            np.random.set_state(saved[2])
