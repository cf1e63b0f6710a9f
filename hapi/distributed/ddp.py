"""DistributedDataParallel around the user's network, and the gradient average it uses."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from hapi.distributed import shared_memory
from hapi.distributed.env import env_int, timeout
from hapi.distributed.group import rank, world_size


def wrap(network: nn.Module, device: torch.device) -> nn.Module:
    """The module training runs: DDP around ``network`` on several processes.

    DDP broadcasts rank 0's weights at construction, so every rank starts
    from the same model whatever its own initialisation.
    """
    if world_size() == 1 or not any(p.requires_grad for p in network.parameters()):
        return network
    device_ids = [device.index] if device.type == "cuda" else None
    wrapped = nn.parallel.DistributedDataParallel(network, device_ids=device_ids)
    _average_through_shared_memory(wrapped, [p for p in network.parameters() if p.requires_grad])
    return wrapped


def _average_through_shared_memory(wrapped: nn.Module, trained: list[nn.Parameter]) -> None:
    """CPU processes on one machine: gradients averaged in shared memory, not over TCP.

    See :mod:`hapi.shared_memory`. All processes take the same decision: rank
    0 reserves the buffer (or finds no room), every process maps it (or
    cannot), and the hook is installed only when all succeeded.
    """
    on_one_machine = env_int("LOCAL_WORLD_SIZE", -1) == world_size()
    if not (dist.get_backend() == "gloo" and on_one_machine and shared_memory.usable_for(trained)):
        return
    numel = sum(p.numel() for p in trained)
    shared = [shared_memory.reserve(numel, world_size()) if rank() == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    if shared[0] is None:  # no room in /dev/shm: everyone keeps Gloo
        return
    try:
        state = shared_memory.SharedMemoryAllReduce(
            shared[0], numel, rank(), world_size(), timeout().total_seconds())
    except OSError:  # not rank 0's machine after all (a LOCAL_WORLD_SIZE set by hand)
        state = None
    failures = torch.tensor([int(state is None)])
    dist.all_reduce(failures)  # every process has tried to map it
    if rank() == 0:
        os.unlink(shared[0])  # mapped where it is needed: nothing is left behind, even after a crash
    if int(failures) == 0:
        wrapped.register_comm_hook(state, shared_memory.average_hook)


def unwrap(network: nn.Module) -> nn.Module:
    """The user's module inside whatever :func:`wrap` returned."""
    return network.module if isinstance(network, nn.parallel.DistributedDataParallel) else network


@contextlib.contextmanager
def no_sync(wrapped: nn.Module, skip_gradient_sync: bool) -> Iterator[None]:
    """Skip DDP's gradient all-reduce on accumulation steps (they sync on the update)."""
    if skip_gradient_sync and isinstance(wrapped, nn.parallel.DistributedDataParallel):
        with wrapped.no_sync():
            yield
    else:
        yield

