"""Everything torch-hapi knows about processes, ranks and devices.

The loop, the steps and the callbacks never test a rank: they call the
functions here, each of which is a no-op (or the identity) on a single
process. This module is the only one in ``hapi`` that may import
``torch.distributed``.

Today every function implements the world-size-1 case; multi-process support
fills in these same functions without touching the loop.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import torch
from torch import nn


def rank() -> int:
    """Global rank of this process (0 on a single process)."""
    return 0


def local_rank() -> int:
    """Rank of this process on its machine; picks the CUDA device."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def world_size() -> int:
    """Number of processes training together."""
    return 1


def is_main() -> bool:
    """True on the one process that prints and writes files."""
    return rank() == 0


def setup() -> None:
    """Join the process group when launched with several processes."""


def default_device(requested: str | torch.device | None = None) -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is available, else CPU, unless requested."""
    if requested is not None:
        return torch.device(requested)
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def wrap(network: nn.Module, device: torch.device) -> nn.Module:
    """The module the steps run: ``network`` itself on a single process."""
    return network


def unwrap(network: nn.Module) -> nn.Module:
    """The user's module inside whatever :func:`wrap` returned."""
    return getattr(network, "module", network) if network is not None else network


@contextlib.contextmanager
def no_sync(wrapped: nn.Module, skip_gradient_sync: bool) -> Iterator[None]:
    """Skip the gradient all-reduce for accumulation steps (no-op here)."""
    yield


def train_sampler(dataset: Any, shuffle: bool, seed: int) -> Any:
    """The sampler that gives this process its share of the training data.

    ``None`` lets the DataLoader use its own ``shuffle``.
    """
    return None


def eval_sampler(dataset: Any) -> Any:
    """Sampler for evaluation/prediction: every sample exactly once overall."""
    return None


def set_epoch(loader: Any, epoch: int) -> None:
    """Tell a distributed sampler which epoch starts, so each epoch reshuffles."""
    sampler = getattr(loader, "sampler", None)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    batch_sampler = getattr(loader, "batch_sampler", None)
    if hasattr(batch_sampler, "set_epoch"):
        batch_sampler.set_epoch(epoch)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of ``tensor`` over processes (itself on one process)."""
    return tensor


def any_true(flag: bool) -> bool:
    """True when ``flag`` is true on any process, so all ranks stop together."""
    return bool(flag)


def barrier() -> None:
    """Wait for every process (no-op on one process)."""


def gather_in_order(chunks: list[Any]) -> list[Any]:
    """Every process's prediction batches, in data-set order."""
    return chunks
