"""Everything torch-hapi knows about processes, ranks and devices.

The loop, the steps and the callbacks never test a rank: they call the
functions here, each of which is a no-op (or the identity) on a single
process. This is the only module of ``hapi`` (with the launcher) that imports
``torch.distributed``; everything is PyTorch's own engine: the default
process group (NCCL on CUDA, Gloo on CPU), ``DistributedDataParallel``,
``DistributedSampler``, and the collectives.

When does a run become distributed? When ``WORLD_SIZE`` > 1 in the
environment (``torchrun``, :func:`hapi.spawn`, or any launcher setting the
torch.distributed variables ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``), or when the user already created the
default process group -- then it is reused, and left for the user to destroy.

How long a dead rank can stall the others: under ``torchrun`` or
:func:`hapi.spawn` the launcher kills the surviving workers as soon as one
exits with an error (within about a second). Without a launcher watching, a
collective waits for at most ``HAPI_DIST_TIMEOUT`` seconds (default 300)
before it raises.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import socket
import time
import uuid
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from hapi import shared_memory

_created_group = False  # True when hapi created the default group (and so destroys it)
_DEFAULT_TIMEOUT_S = 300


class DistributedSetupError(RuntimeError):
    """The distributed environment is inconsistent or cannot be joined."""


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise DistributedSetupError(
            f"The environment variable {name}={value!r} is not an integer. Launch with "
            "torchrun or hapi.spawn, which set it, or fix the value."
        ) from None


def _active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """Global rank of this process (0 on a single process)."""
    return dist.get_rank() if _active() else 0


def local_rank() -> int:
    """Rank of this process on its machine; picks the CUDA device."""
    return _env_int("LOCAL_RANK", 0)


def world_size() -> int:
    """Number of processes training together."""
    return dist.get_world_size() if _active() else 1


def is_main() -> bool:
    """True on the one process that prints and writes files."""
    return rank() == 0


def backend_name(device: str | torch.device | None = None) -> str:
    """``HAPI_BACKEND`` if set, else NCCL for CUDA and Gloo for anything else.

    ``device`` is the one the user asked the Model for (``None``: the default,
    CUDA where there is one): a CPU model on a GPU machine needs Gloo, since
    NCCL reduces CUDA tensors only.
    """
    on_cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    requested = os.environ.get("HAPI_BACKEND", "").strip().lower()
    if requested:
        if requested not in ("nccl", "gloo"):
            raise DistributedSetupError(
                f"HAPI_BACKEND={requested!r} is not a backend torch-hapi uses; choose 'nccl' "
                "(CUDA GPUs) or 'gloo' (CPU), or unset it to choose automatically."
            )
        if requested == "nccl" and not torch.cuda.is_available():
            raise DistributedSetupError(
                "HAPI_BACKEND=nccl asks for NCCL, which needs CUDA GPUs, but "
                "torch.cuda.is_available() is False on this machine. Unset HAPI_BACKEND (Gloo "
                "is chosen on CPU) or run on machines with GPUs."
            )
        if requested == "nccl" and not on_cuda:
            raise DistributedSetupError(
                f"HAPI_BACKEND=nccl asks for NCCL, which reduces CUDA tensors only, but the Model "
                f"was given device={str(device)!r}. Unset HAPI_BACKEND (Gloo is chosen for CPU "
                "models) or give the Model a CUDA device."
            )
        return requested
    return "nccl" if on_cuda else "gloo"


def setup(device: str | torch.device | None = None) -> None:
    """Join the default process group once, when launched with several processes.

    ``device`` is the Model's requested device (see :func:`backend_name`).
    Reuses a group the user created. A group created here is destroyed at
    interpreter exit.
    """
    global _created_group
    if _active() or _env_int("WORLD_SIZE", 1) <= 1:
        return
    missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise DistributedSetupError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']} says this is one of several processes, but "
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set. Launch with "
            "torchrun (e.g. torchrun --nproc_per_node=2 train.py) or hapi.spawn, or set all of "
            "RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT."
        )
    backend = backend_name(device)
    if backend == "nccl":
        torch.cuda.set_device(local_rank() % torch.cuda.device_count())
    timeout = datetime.timedelta(seconds=_env_int("HAPI_DIST_TIMEOUT", _DEFAULT_TIMEOUT_S))
    try:
        dist.init_process_group(backend=backend, timeout=timeout, **_restart_safe_store(timeout))
    except Exception as error:  # torch raises several types (DistNetworkError, RuntimeError, ValueError)
        address = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        hint = ("another program already listens on that port: pick a free one "
                "(torchrun --master-port / --rdzv-endpoint, or MASTER_PORT)"
                if "address already in use" in str(error).lower() or "EADDRINUSE" in str(error)
                else "check that every process uses the same MASTER_ADDR/MASTER_PORT and WORLD_SIZE, "
                     "and that rank 0 is reachable")
        raise DistributedSetupError(
            f"Could not join the {backend} process group at {address} as rank "
            f"{os.environ.get('RANK')} of {os.environ.get('WORLD_SIZE')}: {error}. Likely cause: {hint}."
        ) from error
    _created_group = True
    atexit.register(teardown)


def _restart_safe_store(timeout: datetime.timedelta) -> dict[str, Any]:
    """A store no earlier torchrun attempt has written to, when workers share the agent's.

    Under ``torchrun`` (c10d rendezvous) the workers' ``MASTER_PORT`` is a
    store the agents keep for the whole job, so after ``--max-restarts``
    restarts the workers it still holds the failed attempt's keys, each dead
    rank's Gloo address among them: a new rank could read one and fail with
    "Connection refused". ``TORCHELASTIC_RESTART_COUNT`` cannot name the
    attempt, because each agent counts its own restarts -- on several
    machines, a node restarted only because another node failed keeps its
    count (pytorch/pytorch#135712), and its workers would wait in another
    namespace until the timeout. So rank 0 hosts a fresh store for this
    attempt and publishes its address with a random token; the others
    connect only to a live store holding that token, which a stale
    publication (a dead rank 0, or its port reused) never does.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    agent_host, agent_port = os.environ["MASTER_ADDR"], _env_int("MASTER_PORT", 0)
    this_rank, processes = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)  # the group is not made yet
    agent_store = dist.TCPStore(agent_host, agent_port, world_size=processes, is_master=False,
                                timeout=timeout)
    if this_rank == 0:
        store = _publish_new_store(agent_store, _address_seen_from(agent_host, agent_port), processes, timeout)
    else:
        store = _join_published_store(agent_store, processes, timeout)
    return {"store": store, "rank": this_rank, "world_size": processes}


_PUBLISHED_KEY = "hapi/process_group_store"
_TOKEN_KEY = "hapi/token"


def _publish_new_store(agent_store: dist.Store, host: str, processes: int,
                       timeout: datetime.timedelta) -> dist.Store:
    """Rank 0: a store on a free port, its address and token published in ``agent_store``."""
    store = dist.TCPStore(host, 0, world_size=processes, is_master=True, timeout=timeout,
                          wait_for_workers=False)
    token = uuid.uuid4().hex
    store.set(_TOKEN_KEY, token)
    agent_store.set(_PUBLISHED_KEY, f"{host} {store.port} {token}")
    return store


def _address_seen_from(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (what the other machines can reach).

    A UDP ``connect`` picks the route and sends nothing.
    """
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return probe.getsockname()[0]


def _join_published_store(agent_store: dist.Store, processes: int,
                          timeout: datetime.timedelta) -> dist.Store:
    """Rank 0's store for this attempt, once its publication is this attempt's."""
    deadline = time.monotonic() + timeout.total_seconds()
    probe_timeout = datetime.timedelta(seconds=2)
    while True:
        host, port, token = agent_store.get(_PUBLISHED_KEY).decode().split()
        try:
            store = dist.TCPStore(host, int(port), world_size=processes, is_master=False,
                                  timeout=probe_timeout)
            if store.get(_TOKEN_KEY).decode() == token:
                store.set_timeout(timeout)
                return store
        except (RuntimeError, ValueError):  # torch's store errors (DistNetworkError, ...) are RuntimeErrors
            pass  # an earlier attempt's publication: its rank 0 is gone
        if time.monotonic() > deadline:
            raise DistributedSetupError(
                f"Rank 0 did not publish a reachable store within {timeout.total_seconds():.0f} s "
                f"(last published: {host}:{port}). Check that this machine can reach rank 0's "
                "machine on any port, or raise HAPI_DIST_TIMEOUT.")
        time.sleep(0.2)


def teardown() -> None:
    """Destroy the process group hapi created (a user's group is left alone)."""
    global _created_group
    if _created_group and _active():
        dist.destroy_process_group()
    _created_group = False


def default_device(requested: str | torch.device | None = None) -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is available, else CPU, unless requested."""
    if requested is not None:
        return torch.device(requested)
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


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
    on_one_machine = _env_int("LOCAL_WORLD_SIZE", -1) == world_size()
    if not (dist.get_backend() == "gloo" and on_one_machine and shared_memory.usable_for(trained)):
        return
    numel = sum(p.numel() for p in trained)
    shared = [shared_memory.reserve(numel, world_size()) if rank() == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    if shared[0] is None:  # no room in /dev/shm: everyone keeps Gloo
        return
    try:
        state = shared_memory.SharedMemoryAllReduce(
            shared[0], numel, rank(), world_size(), _env_int("HAPI_DIST_TIMEOUT", _DEFAULT_TIMEOUT_S))
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


def shared_seed() -> int:
    """A seed for this fit's shuffling, drawn on rank 0 and the same on every rank.

    Drawn from torch's global generator, so ``torch.manual_seed`` in the
    script makes the data order reproducible.
    """
    seed = torch.randint(0, 2**31 - 1, (), dtype=torch.int64)
    if world_size() > 1:
        seed = _on_collective_device(seed)
        dist.broadcast(seed, src=0)
    return int(seed.item())


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` that can start its next epoch part-way through.

    A run resumed mid-epoch must read the rest of that epoch in the same
    order without loading the samples it already trained on (loading them
    could draw random numbers in transforms and shift every later draw).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._skip = 0
        # Given to the DataLoader: it draws its workers' base seed from this
        # generator instead of torch's global one, so iterating the data never
        # shifts the random numbers the model draws (dropout), and a resumed
        # epoch gets the same worker seeds.
        self.loader_generator = torch.Generator()
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.loader_generator.manual_seed(self.seed * 7919 + epoch)

    def skip_next(self, samples: int) -> None:
        """Leave out the first ``samples`` indices of the next iteration only."""
        self._skip = samples

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        skip, self._skip = self._skip, 0
        return iter(indices[skip:])


def train_sampler(dataset: Any, shuffle: bool, seed: int) -> ResumableSampler:
    """This process's share of the training data, reshuffled per epoch by ``set_epoch``.

    Every rank gets the same number of samples (the last few are repeated
    to even the shards, as ``DistributedSampler`` does), so all ranks run the
    same number of steps and DDP's collectives line up.
    """
    return ResumableSampler(dataset, num_replicas=world_size(), rank=rank(), shuffle=shuffle,
                            seed=seed, drop_last=False)


class ContiguousShardSampler(Sampler[int]):
    """Rank r's contiguous slice of ``range(n)``: every sample exactly once overall.

    Slices differ in size by at most one, and concatenating them in rank
    order gives back the data-set order, which is how predictions are gathered.
    """

    def __init__(self, length: int, num_replicas: int, rank: int) -> None:
        base, extra = divmod(length, num_replicas)
        self.start = rank * base + min(rank, extra)
        self.stop = self.start + base + (1 if rank < extra else 0)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.stop))

    def __len__(self) -> int:
        return self.stop - self.start


def eval_sampler(dataset: Any) -> Sampler | None:
    """Sampler for evaluation/prediction: no sample twice, none left out."""
    if world_size() == 1:
        return None
    return ContiguousShardSampler(len(dataset), world_size(), rank())


def reshard(loader: DataLoader, training: bool, seed: int) -> DataLoader:
    """A user's DataLoader, rebuilt so this process reads only its share.

    Kept as given on one process, for iterable data sets (they shard
    themselves), and when it already has a ``DistributedSampler`` (or a
    batch sampler that knows epochs, like Paddle's DistributedBatchSampler).
    Otherwise rebuilt with the same batch size, workers, collate function and
    memory pinning, a training sampler seeded for all ranks, or a
    contiguous evaluation shard.
    """
    if world_size() == 1 or isinstance(loader.dataset, torch.utils.data.IterableDataset):
        return loader
    # A DistributedSampler pads shards with repeated samples: fine for training,
    # wrong for evaluation, which is always re-split without duplicates.
    if training and (isinstance(_index_sampler(loader), DistributedSampler)
                     or hasattr(loader.batch_sampler, "set_epoch")):
        return loader
    batch_size = loader_batch_size(loader)
    if batch_size is None:
        raise DistributedSetupError(
            "This DataLoader has a custom batch_sampler without a batch_size, which torch-hapi "
            f"cannot split across {world_size()} processes. Give it a sampler that knows the rank "
            "(e.g. BatchSampler(DistributedSampler(dataset), batch_size, drop_last)), or pass the "
            "Dataset and batch_size to fit()."
        )
    drop_last = loader.drop_last if loader.batch_size is not None else bool(
        getattr(loader.batch_sampler, "drop_last", False))
    shuffle = training and not isinstance(_index_sampler(loader), torch.utils.data.SequentialSampler)
    sampler = train_sampler(loader.dataset, shuffle, seed) if training else eval_sampler(loader.dataset)
    return DataLoader(
        loader.dataset, batch_size=batch_size, sampler=sampler,
        generator=sampler.loader_generator if training else torch.Generator(),
        num_workers=loader.num_workers, collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory, drop_last=drop_last, timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        persistent_workers=loader.persistent_workers and not training,
        prefetch_factor=loader.prefetch_factor if loader.num_workers > 0 else None,
    )


def _index_sampler(loader: DataLoader) -> Any:
    """The sampler of sample indices: the loader's own, or the one inside its batch sampler."""
    if loader.batch_size is None and hasattr(loader.batch_sampler, "sampler"):
        return loader.batch_sampler.sampler
    return loader.sampler


def loader_batch_size(loader: Any) -> int | None:
    """Samples per batch of a DataLoader, also when it was given a ``batch_sampler``."""
    size = getattr(loader, "batch_size", None)
    if size is None:
        size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    return size if isinstance(size, int) else None


def set_seed(loader: Any, seed: int) -> None:
    """Make a sampler torch-hapi built shuffle with ``seed`` (a resumed run's)."""
    if isinstance(getattr(loader, "sampler", None), ResumableSampler):
        loader.sampler.seed = seed
        loader.sampler.set_epoch(loader.sampler.epoch)


def set_epoch(loader: Any, epoch: int) -> None:
    """Tell the sampler which epoch starts, so each epoch reshuffles (all ranks alike)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    samplers = {id(s): s for s in (getattr(loader, "sampler", None), batch_sampler,
                                   getattr(batch_sampler, "sampler", None))}
    for sampler in samplers.values():  # e.g. BatchSampler(DistributedSampler(...)): the inner one
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)


def _on_collective_device(tensor: torch.Tensor) -> torch.Tensor:
    # NCCL reduces CUDA tensors only; Gloo takes CPU tensors.
    if dist.get_backend() == "nccl":
        return tensor.to(torch.device("cuda", torch.cuda.current_device()))
    return tensor.cpu()


_BROADCAST_PIECE_BYTES = 64 * 2**20


def broadcast_bytes(payload: bytes | None, source: int = 0) -> bytes | None:
    """Rank ``source``'s ``payload`` on every process (``None`` everywhere when it gives none).

    Sent in 64 MiB pieces, so a big checkpoint never needs a second whole copy
    of itself on the collective device (GPU memory, under NCCL).
    """
    if world_size() == 1:
        return payload
    sending = rank() == source
    size = torch.tensor(len(payload) if sending and payload is not None else -1, dtype=torch.int64)
    size = _on_collective_device(size)
    dist.broadcast(size, src=source)
    total = int(size.item())
    if total < 0:
        return None
    received = bytearray(payload if sending else total)
    for start in range(0, total, _BROADCAST_PIECE_BYTES):
        piece = torch.frombuffer(received, dtype=torch.uint8, offset=start,
                                 count=min(_BROADCAST_PIECE_BYTES, total - start))
        on_device = _on_collective_device(piece)
        dist.broadcast(on_device, src=source)
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
    if world_size() == 1:
        return bool(flag)
    return bool(all_reduce_sum(torch.tensor(int(bool(flag)))).item())


def barrier() -> None:
    """Wait for every process (no-op on one process)."""
    if world_size() > 1:
        dist.barrier()


def gather_objects(value: Any) -> list[Any]:
    """``value`` from every process, indexed by rank (``[value]`` on one process)."""
    if world_size() == 1:
        return [value]
    gathered: list[Any] = [None] * world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def own(per_rank: list[Any]) -> Any:
    """This process's entry of a per-rank list, or None if another world size wrote it."""
    return per_rank[rank()] if len(per_rank) == world_size() else None


def gather_in_order(per_output: list[list[Any]]) -> list[list[Any]]:
    """Every process's prediction batches, per output, in rank (= data-set) order.

    One collective, called by every process, also those whose shard was empty.
    """
    if world_size() == 1:
        return per_output
    ranks = [outputs for outputs in gather_objects(per_output) if outputs]
    if not ranks:
        return []
    return [[batch for outputs in ranks for batch in outputs[index]] for index in range(len(ranks[0]))]


class SyncFlag:
    """Tells torchmetrics when to gather states across ranks.

    Given to each metric as ``distributed_available_fn``: running figures
    read every ``log_freq`` steps stay local (ranks may have run different
    numbers of evaluation batches, so a collective there could hang), while
    the figures at the end of a pass are reduced over every process.
    """

    def __init__(self) -> None:
        self.enabled = False

    def __call__(self) -> bool:
        return self.enabled and world_size() > 1

    def __reduce__(self):  # metrics may be deep-copied or pickled; a flag needs no state
        return (SyncFlag, ())

