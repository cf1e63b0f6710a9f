"""DistributedDataParallel around the user's network, and the gradient average it uses."""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from hapi.distributed import shared_memory
from hapi.distributed.collectives import attempt, gather_objects
from hapi.distributed.env import env_int, timeout
from hapi.distributed.group import rank, release_at_teardown, world_size


def wrap(
    network: nn.Module, device: torch.device, options: dict[str, Any] | None = None
) -> nn.Module:
    """The module training runs: DDP around ``network`` on several processes.

    ``options`` are the user's DistributedDataParallel keywords
    (:class:`hapi.DDP`), a dict: a keyword of theirs that DDP lacks (``device=``)
    gets DDP's own error, not a clash with this function's parameters. DDP
    broadcasts rank 0's weights at construction, so every rank starts from the
    same model whatever its own initialisation.
    """
    if world_size() == 1 or not any(p.requires_grad for p in network.parameters()):
        return network
    device_ids = [device.index] if device.type == "cuda" else None
    wrapped = nn.parallel.DistributedDataParallel(network, device_ids=device_ids, **(options or {}))
    release_at_teardown(functools.partial(_release, weakref.ref(wrapped)))
    _average_through_shared_memory(wrapped, [p for p in network.parameters() if p.requires_grad])
    return wrapped


def _average_through_shared_memory(wrapped: nn.Module, trained: list[nn.Parameter]) -> str | None:
    """CPU processes on one machine: gradients averaged in shared memory, not over TCP.

    See :mod:`hapi.distributed.shared_memory`. Every step is a collective
    that every process calls, in the same order, whatever its own verdict, so
    all take the same decision and none is left waiting: every process's
    verdict, machine (hostname, boot id) and process id are gathered, with the
    buffer rank 0 reserved if it can take part (or found no room for); when
    all can, every process maps it and checks it is rank 0's, and then that it
    sees every other process's writes. The hook is installed only when all of this succeeded everywhere.
    An unexpected error on any rank is raised on every rank. One machine is
    proven (same hostname and boot id, then the shared writes), not assumed
    from ``LOCAL_WORLD_SIZE``; a launcher's ``LOCAL_WORLD_SIZE`` other than the
    world size still keeps Gloo (it says the processes are on several nodes).

    Returns ``None`` when the hook is installed, else why every process keeps
    Gloo's all-reduce.
    """
    if dist.get_backend() != "gloo":  # the same on every rank
        return f"the backend is {dist.get_backend()}, not gloo"
    facts = _everyone(lambda: _local_facts(wrapped.module, trained))
    reservation, mapped = facts[0]["reservation"], []
    peers = [(fact["pid"], fact["start"]) for fact in facts]

    def attach() -> str | None:
        try:
            limit = timeout().total_seconds()
            mapped.append(shared_memory.SharedMemoryAllReduce(reservation, rank(), peers, limit))
        except OSError as error:  # not rank 0's memory after all: another machine or namespace
            return f"could not map rank 0's buffer: {error}"
        return None

    try:
        reason = _why_not(facts)
        if reason is not None:
            return reason
        refusals = _everyone(attach)  # returns once every process has tried to map it
    finally:
        if reservation is not None and rank() == 0:
            shared_memory.release(reservation)
    if not any(refusals):  # then every process has written its id: does each see the others'?
        unseen = "does not see every process's writes in the buffer"
        refusals = _everyone(lambda: None if mapped[0].everyone_attached() else unseen)
    if any(refusals):
        for state in mapped:
            state.close()
        return "; ".join(f"rank {r} {why}" for r, why in enumerate(refusals) if why)
    wrapped.register_comm_hook(mapped[0], shared_memory.average_hook)
    return None


def _local_facts(network: nn.Module, trained: list[nn.Parameter]) -> dict[str, Any]:
    """What every process needs to know of this one to decide together; on rank 0, when it
    can take part, also the buffer it reserved (released by the caller), or why it could not."""
    reason = shared_memory.reason_not_to_use(network, trained)
    local_world = env_int("LOCAL_WORLD_SIZE", -1)  # set by launchers; -1 where they were not used
    if reason is None and local_world not in (-1, world_size()):
        reason = f"LOCAL_WORLD_SIZE={local_world} says the {world_size()} processes span machines"
    numel = sum(p.numel() for p in trained)
    reserving = rank() == 0 and reason is None
    reserved = shared_memory.reserve(numel, world_size()) if reserving else None
    if reserving and reserved is None:
        reason = f"found no memory for the {numel * 8 * world_size()} bytes of the buffer"
    return {"reason": reason, "numel": numel, "reservation": reserved, **shared_memory.identity()}


def _why_not(facts: list[dict[str, Any]]) -> str | None:
    """Why the processes that reported ``facts`` (one per rank) cannot share a buffer, or ``None``."""
    machines = sorted({(fact["host"], fact["boot_id"]) for fact in facts})
    counts = [fact["numel"] for fact in facts]
    reasons = [f"rank {r}: {fact['reason']}" for r, fact in enumerate(facts) if fact["reason"]]
    if len(machines) > 1 or not machines[0][1]:  # several, or one whose boot id is unknown
        reasons.append(f"the processes are not all on one machine (hostname, boot id: {machines})")
    if len(set(counts)) > 1:
        reasons.append(f"the processes train different numbers of elements: {counts}")
    return "; ".join(reasons) or None


def _everyone(compute: Callable[[], Any]) -> list[Any]:
    """Every rank's ``compute()`` (picklable), in rank order. An exception on any rank is
    raised on every rank, so no rank is left waiting for a collective the failed one skips."""
    mine, failure = attempt(compute)
    message = None if failure is None else f"{type(failure).__name__}: {failure}"
    gathered = gather_objects((mine, message))
    failed = [(r, text) for r, (_, text) in enumerate(gathered) if text is not None]
    if failed:
        raise RuntimeError(
            f"Setting up the shared-memory gradient average failed on rank {failed[0][0]}: "
            f"{failed[0][1]}. Every process stops; HAPI_SHM_ALLREDUCE=0 uses Gloo's all-reduce."
        ) from failure
    return [value for value, _ in gathered]


def _release(wrapped: weakref.ref) -> None:
    """At exit: drop the DDP wrapper's reducer (its buckets, pending work, comm hook) and its
    reference to the group, so they are freed now, in this thread, before the group goes."""
    ddp = wrapped()
    if ddp is not None:
        for name in ("reducer", "logger", "process_group"):
            ddp.__dict__.pop(name, None)


def unwrap(network: nn.Module) -> nn.Module:
    """The user's module inside whatever :func:`wrap` returned."""
    return network.module if isinstance(network, nn.parallel.DistributedDataParallel) else network
