"""The default process group: joining it, leaving it, and this process's place in it; and the
group of background saves."""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
import types
from typing import Any, Callable

import torch
import torch.distributed as dist

from hapi.distributed import env
from hapi.distributed.store import leave_attempt_store, restart_safe_store

# This process's part in the group: whether hapi created it (and so destroys it), whether the
# process is dying of an exception (see note_failure), the group of background saves, and what
# to release before the group goes (see release_at_teardown).
_state = types.SimpleNamespace(created=False, dying=False, background=None, releases=[])


def _active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """Global rank of this process in the process group (0 before it exists or on one process).

    The group's view, which torch-hapi's own collectives and samplers use.
    Scripts ask :func:`launched_rank` (``hapi.distributed.rank``), which also
    answers before the Model has joined the group.
    """
    return dist.get_rank() if _active() else 0


def launched_rank() -> int:
    """This process's global rank, also before a Model exists (``hapi.distributed.rank()``).

    The process group's once joined (or one the user created); before that,
    what the launcher set: ``RANK`` (torchrun, :func:`hapi.spawn`) or its own
    variables under ``srun``, ``jsrun`` or ``mpirun``; 0 on a single process. So a script can
    pick its main process before building the Model, e.g. to download data
    once.

    Returns:
        The global rank, from 0 to ``world_size() - 1``.

    Example:
        .. code-block:: python

            if hapi.distributed.rank() == 0:
                print("world size", hapi.distributed.world_size())
    """
    return dist.get_rank() if _active() else env.launcher_place()[0]


def launched_world_size() -> int:
    """How many processes train together, also before a Model exists (``hapi.distributed.world_size()``).

    The process group's size once joined; before that ``WORLD_SIZE`` (or
    its own variables under ``srun``, ``jsrun`` or ``mpirun``); 1 on a single process.
    Use it to scale what depends on the global batch (a learning rate, the
    number of steps per epoch).

    Returns:
        The number of processes, 1 when nothing was launched.
    """
    return dist.get_world_size() if _active() else env.launcher_place()[1]


def launched_is_main() -> bool:
    """True on the one process that prints and writes files (``hapi.distributed.is_main()``).

    Answers from the launcher's environment before a Model exists, so
    ``if hapi.distributed.is_main(): download()`` runs on one process only.
    Never put a collective call (``model.save``, ``model.evaluate``) under it:
    the other processes would wait for it forever.

    Returns:
        ``True`` on rank 0 (and on a single process), ``False`` elsewhere.
    """
    return launched_rank() == 0


def local_rank() -> int:
    """Rank of this process on its machine (``LOCAL_RANK``), which picks its CUDA device.

    Under ``srun``, ``jsrun`` or ``mpirun`` it holds once the process group is
    joined (:func:`init`, or a Model built).

    Useful for per-machine work: one process per machine unpacking data to
    its local disk, or choosing ``cuda:<local_rank>`` by hand.

    Returns:
        The local rank, 0 on a single process.
    """
    return env.env_int("LOCAL_RANK", 0)


def world_size() -> int:
    """Number of processes in the process group (1 before it exists): the group's view, see :func:`rank`."""
    return dist.get_world_size() if _active() else 1


def backend_name(device: str | torch.device | None = None) -> str:
    """``HAPI_BACKEND`` if set, else NCCL for CUDA and Gloo for anything else.

    ``device`` is the one the user asked the Model for (``None``: the default,
    CUDA where there is one): a CPU model on a GPU machine needs Gloo, since
    NCCL reduces CUDA tensors only.
    """
    on_cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    requested = os.environ.get("HAPI_BACKEND", "").strip().lower()
    if requested not in ("", "nccl", "gloo"):
        raise env.DistributedSetupError(
            f"HAPI_BACKEND={requested!r} is not a backend torch-hapi uses; choose 'nccl' "
            "(CUDA GPUs) or 'gloo' (CPU), or unset it to choose automatically."
        )
    if requested == "nccl" and not (on_cuda and torch.cuda.is_available()):
        why = "needs CUDA GPUs, but torch.cuda.is_available() is False on this machine"
        if torch.cuda.is_available():
            why = f"reduces CUDA tensors only, but the Model was given device={str(device)!r}"
        raise env.DistributedSetupError(
            f"HAPI_BACKEND=nccl asks for NCCL, which {why}. Unset HAPI_BACKEND (Gloo is chosen "
            "for CPU models) or train on CUDA GPUs."
        )
    return requested or ("nccl" if on_cuda else "gloo")


def init(device: str | torch.device | None = None) -> None:
    """Join the process group the launcher set up, before any Model exists.

    A ``Model`` joins it by itself when it is built; call this first when
    something before the Model needs the group: a ``DistributedSampler`` (it
    asks the group for the rank), :func:`barrier`, :func:`main_process_first`.
    It reads torchrun's, :func:`hapi.spawn`'s, Kubeflow's, Slurm's (``srun``),
    LSF's (``jsrun``) or MPI's (``mpirun``) variables and sets the
    torch.distributed ones from them. A group that already exists (Ray
    Train's, or one the script made) is used as it is, and so is it by a
    Model built later. It does nothing on a single process and when called
    again. A group made here is left at interpreter exit.

    Args:
        device: The device the Model will train on; it picks the backend
            (NCCL for CUDA, Gloo otherwise). ``None``: CUDA where there is one.

    Raises:
        DistributedSetupError: The launcher's variables are missing or
            contradict each other, or the group cannot be joined (the
            message names the likely cause).

    Example:
        .. code-block:: python

            hapi.distributed.init()
            sampler = DistributedSampler(train_set)
            loader = DataLoader(train_set, batch_size=32, sampler=sampler)
            model = hapi.Model(Net())
    """
    if _active():
        if backend_name(device) == "gloo" and dist.get_backend() == "nccl":
            raise env.DistributedSetupError(
                f"This process group uses NCCL, which reduces CUDA tensors only, but the Model "
                f'trains on {device!r}. Call hapi.distributed.init("cpu") before anything '
                "forms the group (with no device, it picks NCCL on a GPU machine)."
            )
        return
    # srun, jsrun, mpirun: torch.distributed's variables from theirs
    os.environ.update(env.launcher_variables())
    if env.env_int("WORLD_SIZE", 1) <= 1:
        return
    missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise env.DistributedSetupError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']} says this is one of several processes, but "
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set. Launch with "
            "torchrun (e.g. torchrun --nproc_per_node=2 train.py) or hapi.spawn, or set all of "
            "RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT."
        )
    backend = backend_name(device)
    if backend == "nccl":
        torch.cuda.set_device(local_rank() % torch.cuda.device_count())
    limit = env.timeout()
    try:
        dist.init_process_group(backend=backend, timeout=limit, **restart_safe_store(limit))
    except Exception as error:  # torch raises several (DistNetworkError, RuntimeError, ...)
        hint = "the processes must agree on MASTER_ADDR, MASTER_PORT, WORLD_SIZE and reach rank 0"
        if "address already in use" in str(error).lower():  # libuv's and the other's message
            hint = "another program already listens on that port: pick a free one "
            hint += "(torchrun --master-port / --rdzv-endpoint, or MASTER_PORT)"
        raise env.DistributedSetupError(
            f"Could not join the {backend} process group at {os.environ['MASTER_ADDR']}:"
            f"{os.environ['MASTER_PORT']} as rank {os.environ['RANK']} of "
            f"{os.environ['WORLD_SIZE']}: {error}. Likely cause: {hint}."
        ) from error
    _state.created = True
    excepthook = sys.excepthook

    def note_then_report(*args: Any) -> None:  # the process dies of an uncaught exception
        note_failure()
        excepthook(*args)

    sys.excepthook = note_then_report
    atexit.register(teardown)


def teardown() -> None:
    """Leave the process group hapi created, together (a user's group is left alone).

    Destroying a Gloo group while another process still talks to it races
    with Gloo's own threads: a run that trained to the end could die at exit
    with "terminate called without an active exception" (SIGABRT), and
    torchrun then reports the job FAILED. So the processes first agree that
    all are leaving (a barrier bounded by ``HAPI_DIST_TIMEOUT``), then
    destroy; under torchrun, rank 0, which hosts the attempt's store, then
    keeps it until the others have destroyed their group too
    (:func:`hapi.distributed.store.leave_attempt_store`). A process dying of
    an uncaught exception skips both waits: the
    others may be blocked in a collective it will never join, and the
    launcher must learn of the failure at once (see :func:`note_failure`).
    """
    if _state.created and _active():
        if not _state.dying:
            # A peer that died or never came: destroy anyway.
            with contextlib.suppress(Exception):
                if dist.get_backend() == "gloo":
                    dist.monitored_barrier(timeout=env.timeout())
                else:
                    dist.barrier()
        for release in _state.releases:
            release()
        gc.collect()  # what held the group's work goes now, while the interpreter can free it
        dist.destroy_process_group()
        if not _state.dying:
            leave_attempt_store(env.timeout())
    _state.created = False


def release_at_teardown(release: Callable[[], None]) -> None:
    """Run ``release`` when hapi leaves its group, before destroying it.

    C++ objects that hold the group's pending work and Python tensors (DDP's
    reducer) would otherwise be freed during interpreter shutdown, possibly
    from one of Gloo's threads, which then cannot take the GIL: the process
    aborts ("terminate called without an active exception") after a run that
    finished.
    """
    _state.releases.append(release)


def note_failure() -> None:
    """This process is failing: at exit, leave the group without waiting for the others.

    Called for an exception that escapes ``fit``/``evaluate``/``predict`` or a
    :func:`hapi.spawn` child, and for any uncaught exception (``sys.excepthook``):
    the other processes may be blocked in a collective this one will never join.
    """
    _state.dying = True


def background_group() -> dist.ProcessGroup | None:
    """A Gloo group of its own for saves running in the background; ``None`` on one process.

    torch runs a group's collectives in the order each process issues them. A
    background thread (a checkpoint written beside training) issues its own at
    any time, so on the default group they would interleave with training's
    and pair up wrongly across processes; on a group of their own they never
    meet training's. Created by every process at its first background save,
    which they make together (creating a group is itself a collective).
    """
    if world_size() == 1:
        return None
    if _state.background is None:
        _state.background = dist.new_group(backend="gloo", timeout=env.timeout())
    return _state.background


def default_device(requested: str | torch.device | None = None) -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is available, else CPU, unless requested."""
    if requested is not None:
        return torch.device(requested)
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank() % torch.cuda.device_count())
    return torch.device("cpu")
