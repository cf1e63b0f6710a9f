"""Collectives: each is the identity (or a no-op) on a single process."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, TypeVar

import torch
import torch.distributed as dist

from hapi.distributed.group import init, local_rank, rank, world_size

Result = TypeVar("Result")


def shared_seed() -> int:
    """A seed for this fit's shuffling, drawn on rank 0 and the same on every rank.

    Drawn from torch's global generator, so ``torch.manual_seed`` in the
    script makes the data order reproducible.
    """
    seed = torch.randint(0, 2**31 - 1, (), dtype=torch.int64)
    return int((_broadcast(seed) if world_size() > 1 else seed).item())


def _on_collective_device(tensor: torch.Tensor) -> torch.Tensor:
    # NCCL reduces CUDA tensors only; Gloo takes CPU tensors.
    if dist.get_backend() == "nccl":
        return tensor.to(torch.device("cuda", torch.cuda.current_device()))
    return tensor.cpu()


def _broadcast(tensor: torch.Tensor, source: int = 0) -> torch.Tensor:
    """Rank ``source``'s ``tensor``, on the collective device (``tensor`` itself, if it is there)."""
    on_device = _on_collective_device(tensor)
    dist.broadcast(on_device, src=source)
    return on_device


def _through_one_tensor(
    tensors: list[torch.Tensor], collective: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """Each of ``tensors`` overwritten by its part of ``collective`` run once on them all, flat."""
    flat = collective(torch.cat([t.detach().reshape(-1) for t in tensors]))
    for tensor, part in zip(tensors, flat.split([t.numel() for t in tensors])):
        tensor.copy_(part.view_as(tensor))


_PIECE_BYTES = 64 * 2**20


def broadcast_bytes(payload: bytes | None, source: int = 0) -> bytes | None:
    """Rank ``source``'s ``payload`` on every process (``None`` everywhere when it gives none).

    Sent in 64 MiB pieces, so a big checkpoint never needs a second whole copy
    of itself on the collective device (GPU memory, under NCCL).
    """
    if world_size() == 1:
        return payload
    sending = rank() == source
    size = torch.tensor(len(payload) if sending and payload is not None else -1, dtype=torch.int64)
    total = int(_broadcast(size, source).item())
    if total < 0:
        return None
    received = bytearray(payload if sending else total)
    pieces = torch.frombuffer(received, dtype=torch.uint8).split(_PIECE_BYTES) if total else ()
    for piece in pieces:  # views of received
        on_device = _broadcast(piece, source)
        if not sending and on_device is not piece:
            piece.copy_(on_device)
    return bytes(received)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of ``tensor`` over processes (itself on one process)."""
    if world_size() == 1:
        return tensor
    reduced = _on_collective_device(tensor.clone())
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
    return reduced.to(tensor.device)


def any_true(flag: bool) -> bool:
    """True when ``flag`` is true on any process, so all ranks stop together."""
    if world_size() == 1:  # asked after every batch there: no tensor, no read back
        return bool(flag)
    return bool(all_reduce_sum(torch.tensor(int(bool(flag)))).item())


def barrier() -> None:
    """Wait until every process has reached this line.

    Joins the launcher's process group first if no Model has yet (see
    :func:`init`). Every process must call it, or the others wait for up to
    ``HAPI_DIST_TIMEOUT`` seconds, then raise. Does nothing on one process.

    Raises:
        DistributedSetupError: The process group cannot be joined.

    Example:
        .. code-block:: python

            if hapi.distributed.is_main():
                write_vocabulary(path)
            hapi.distributed.barrier()  # the file exists for everyone below
            vocabulary = read_vocabulary(path)
    """
    init()
    if world_size() > 1:
        dist.barrier()


@contextlib.contextmanager
def main_process_first() -> Iterator[None]:
    """Run the block on the main process first, then on the others once it has finished.

    For a step whose result the others can reuse: a download, a cache of
    preprocessed data. The main process fills the cache while the others
    wait; they then find it there. Every process must enter the block.
    Joins the launcher's process group first if no Model has yet (see
    :func:`init`); on one process the block simply runs.

    Yields:
        Nothing; the block runs when this process's turn comes.

    Raises:
        DistributedSetupError: The process group cannot be joined.
        RuntimeError: on the other processes, when the main process's block
            raised (the main process raises its own error): they stop at
            once instead of waiting for it until the timeout.

    Example:
        .. code-block:: python

            with hapi.distributed.main_process_first():
                train_set = torchvision.datasets.MNIST("data", download=True)
    """
    init()
    # One collective each: the others wait for the main process's verdict on its block.
    if rank() != 0 and any_true(False):
        raise RuntimeError(
            "The main process failed in its main_process_first() block (see its error), "
            "so this process did not run it."
        )
    failed = True
    try:
        yield
        failed = False
    finally:
        if rank() == 0:
            any_true(failed)


def gather_objects(value: Any) -> list[Any]:
    """``value`` from every process, indexed by rank (``[value]`` on one process)."""
    if world_size() == 1:
        return [value]
    gathered: list[Any] = [None] * world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def this_process_part(per_rank: list[Any]) -> Any:
    """This process's entry of a per-rank list, or None if another world size wrote it."""
    return per_rank[rank()] if len(per_rank) == world_size() else None


def gather_in_order(per_output: list[list[Any]]) -> list[list[Any]]:
    """Every process's prediction batches, per output, in rank (= data-set) order.

    One collective, called by every process, also those whose shard was empty.
    """
    ranks = [outputs for outputs in gather_objects(per_output) if outputs]
    return [[batch for part in parts for batch in part] for parts in zip(*ranks)]


def average_gradients(parameters: list[torch.Tensor]) -> None:
    """Every process's gradients of ``parameters`` replaced by their mean over the processes.

    For a ``train_step`` of the user's own, which runs the plain network (no
    DDP): without this, each process would step on its own batch's gradients
    and the copies of the model would drift apart. A gradient that is None on
    every process stays None (the optimizer skips it, as on one process); one
    that exists somewhere counts as zeros where it does not. Two collectives.
    """
    if world_size() == 1 or not parameters:
        return
    present = all_reduce_sum(torch.tensor([float(p.grad is not None) for p in parameters]))
    used = [p for p, count in zip(parameters, present.tolist()) if count > 0]
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in used]
    for parameter, grad in zip(used, grads):
        parameter.grad = grad
    if used:
        _through_one_tensor(grads, lambda flat: all_reduce_sum(flat.float()) / world_size())


class SyncFlag:
    """Tells torchmetrics when to gather states across ranks.

    Given to each metric as ``distributed_available_fn``: running figures
    read every ``log_freq`` steps stay local (ranks may have run different
    numbers of evaluation batches, so a collective there could hang), while
    the figures at the end of a pass are reduced over every process.
    """

    enabled = False  # set on each instance while the end of a pass is reduced

    def __call__(self) -> bool:
        return self.enabled and world_size() > 1

    def __reduce__(self):  # metrics may be deep-copied or pickled; a flag needs no state
        return (SyncFlag, ())


def sync_from_main(module: Any, parameters: bool = False) -> None:
    """Give every process rank 0's buffers (and, with ``parameters``, its weights).

    DDP broadcasts buffers (BatchNorm's running statistics) from rank 0 only
    at the start of each training forward, so after the last training step
    every process holds the statistics of its own last batch. Evaluating each
    shard with other statistics, or saving rank 0's while evaluating another's,
    would not be one model's figures; so before any evaluation, prediction or
    save every process takes rank 0's, as DDP would at its next forward. A
    model that never trained under DDP (evaluate/predict only) takes rank 0's
    weights too, which DDP would otherwise have broadcast when wrapping it.
    Tensors are sent one flat tensor per dtype and device.
    """
    if world_size() == 1:
        return
    groups: dict[tuple, list[torch.Tensor]] = {}
    for tensor in [*module.buffers(), *(module.parameters() if parameters else ())]:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    with torch.no_grad():
        for members in groups.values():
            _through_one_tensor(members, _broadcast)


def attempt(
    action: Callable[[], Result], here: bool = True
) -> tuple[Result | None, Exception | None]:
    """``(action(), None)``, or ``(None, error)`` when it raised; ``(None, None)`` unless ``here``.

    For work done on some processes that every process must learn the fate
    of: the error is handed on (to a collective), not raised, so this process
    still joins the collective the others wait in.
    """
    if not here:
        return None, None
    try:
        return action(), None
    except Exception as error:  # noqa: BLE001 -- every rank must learn of it
        return None, error


def on_main(
    action: Callable[[], Result], failed_elsewhere: Callable[[], Exception]
) -> Result | None:
    """``action()`` on rank 0 only (``None`` elsewhere); every process waits for it.

    A failure (a full disk, say) reaches every process: rank 0 raises its own
    error, the others ``failed_elsewhere()``, so none goes on believing the
    work was done.
    """
    result, failure = attempt(action, here=rank() == 0)
    if any_true(failure is not None):  # also the barrier: all wait for the action
        if failure is not None:
            raise failure
        raise failed_elsewhere()
    return result


def broadcast_freshest(
    read: Callable[[], tuple[tuple, bytes, Any] | None],
    failed_elsewhere: Callable[[int], Exception],
) -> tuple[bytes, Any] | None:
    """The freshest of the machines' copies of something, on every process.

    One process per machine (local rank 0) calls ``read()``, which returns
    ``(progress, payload, parsed)`` or ``None`` when its machine has no copy.
    The payload with the greatest ``progress`` (the lowest rank's on a tie) is
    sent to every process, which gets ``(payload, parsed)`` -- ``parsed``
    only on the sender, the others parse the payload themselves. ``None``
    everywhere when no machine has a copy. An error in ``read`` is raised
    on its machine and ``failed_elsewhere(rank)`` on the others.
    """
    found, failure = attempt(read, here=local_rank() == 0)
    per_rank = gather_objects((None if found is None else found[0], failure is not None))
    if failure is not None:
        raise failure
    failed = [source for source, (_, broken) in enumerate(per_rank) if broken]
    if failed:
        raise failed_elsewhere(failed[0])
    copies = [(copy, -source) for source, (copy, _) in enumerate(per_rank) if copy is not None]
    if not copies:
        return None
    source = -max(copies)[1]
    _, payload, parsed = found if rank() == source else (None, None, None)
    return broadcast_bytes(payload, source), parsed


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` is torch.distributed's own (a collective failed or timed out)."""
    return dist.is_available() and isinstance(error, dist.DistError)
