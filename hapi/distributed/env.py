"""What the launcher told this process: environment variables, read with clear errors."""

from __future__ import annotations

import datetime
import os
import re
import warnings

DEFAULT_TIMEOUT_S = 300


class DistributedSetupError(RuntimeError):
    """The distributed environment is inconsistent or the process group cannot be joined.

    Raised when a ``Model`` is built under a launcher whose variables are
    missing, contradict each other or cannot be read (``WORLD_SIZE=2`` without
    ``MASTER_ADDR``, an ``srun`` step missing Slurm's variables, an unknown
    ``HAPI_BACKEND``), when the group cannot be joined (the message gives the
    likely cause: a port in use, an unreachable address), when a
    ``DataLoader`` cannot be split across the processes, or when an option
    cannot run here (``hapi.DDP(sync_batchnorm=True)`` on CPU, a ``train_step``
    of your own under FSDP). The message names the variable or option and what
    to change; retrying unchanged does not help.
    """


def env_int(name: str, default: int) -> int:
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


def timeout() -> datetime.timedelta:
    """How long a collective may wait for the others (``HAPI_DIST_TIMEOUT``, seconds)."""
    return datetime.timedelta(seconds=env_int("HAPI_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))


def from_slurm() -> bool:
    """Under ``srun``, set the torch.distributed variables from Slurm's; True when it did.

    ``srun python train.py`` starts ``SLURM_STEP_NUM_TASKS`` copies of the
    script and tells each its place only in Slurm's variables. Read as one
    process each, every copy would train alone as rank 0 and write the same
    files. So, when no launcher set ``WORLD_SIZE`` (torchrun under Slurm
    wins), the processes form one job: ``RANK`` from ``SLURM_PROCID``,
    ``LOCAL_RANK`` from ``SLURM_LOCALID``, ``WORLD_SIZE`` from the step's task
    count, ``LOCAL_WORLD_SIZE`` from this node's share of
    ``SLURM_STEP_TASKS_PER_NODE``, ``MASTER_ADDR`` the first host of the
    step's node list and ``MASTER_PORT`` derived from the job id (20000 +
    id mod 40000), unless those two are set.

    A script run directly in a batch script (no ``srun``) sees the
    allocation's ``SLURM_NTASKS`` but no step variables: it is one process,
    and a warning says how to start the others.
    """
    if os.environ.get("WORLD_SIZE"):
        return False
    step_tasks = env_int("SLURM_STEP_NUM_TASKS", 0)
    if step_tasks <= 1:
        if env_int("SLURM_NTASKS", 1) > 1 and "SLURM_STEP_NUM_TASKS" not in os.environ:
            warnings.warn(
                f"This Slurm allocation has SLURM_NTASKS={os.environ['SLURM_NTASKS']} tasks, but the "
                "script was not started by srun, so it trains as one process. Start it with "
                "`srun python train.py` to train on all of them.",
                stacklevel=3,
            )
        return False
    missing = [
        name for name in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_JOB_ID") if name not in os.environ
    ]
    nodes = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
    if missing or not nodes:
        raise DistributedSetupError(
            f"srun started {step_tasks} tasks, but {', '.join(missing) or 'SLURM_STEP_NODELIST'} "
            "is not set, so this process cannot tell its place. Run the script with srun itself "
            "(not through a wrapper that clears the environment), or set RANK, LOCAL_RANK, "
            "WORLD_SIZE, MASTER_ADDR and MASTER_PORT."
        )
    per_node = tasks_per_node(os.environ.get("SLURM_STEP_TASKS_PER_NODE", ""))
    node = env_int("SLURM_NODEID", 0)
    values = {
        "RANK": os.environ["SLURM_PROCID"],
        "LOCAL_RANK": os.environ["SLURM_LOCALID"],
        "WORLD_SIZE": str(step_tasks),
        "LOCAL_WORLD_SIZE": str(per_node[node] if node < len(per_node) else step_tasks),
        "MASTER_ADDR": os.environ.get("MASTER_ADDR") or first_host(nodes),
        "MASTER_PORT": os.environ.get("MASTER_PORT")
        or str(20000 + env_int("SLURM_JOB_ID", 0) % 40000),
    }
    os.environ.update(values)
    return True


def launcher_place() -> tuple[int, int]:
    """``(rank, world size)`` as the launcher set them, read without changing the environment.

    ``RANK``/``WORLD_SIZE`` (torchrun, :func:`hapi.spawn`, any torch.distributed
    launcher), else, under ``srun`` with several tasks, ``SLURM_PROCID`` and
    ``SLURM_STEP_NUM_TASKS`` (the values :func:`from_slurm` will set). ``(0, 1)``
    when no launcher said anything usable: a value that is not an integer, or
    a rank outside ``[0, world size)``, counts as none here, since this is
    asked before (and outside) the setup that reports such errors, and a
    question like "am I the main process?" must not fail.
    """
    slurm = not os.environ.get("WORLD_SIZE")
    try:
        world = env_int("SLURM_STEP_NUM_TASKS" if slurm else "WORLD_SIZE", 1)
        place = env_int("SLURM_PROCID" if slurm else "RANK", -1)
    except DistributedSetupError:
        return 0, 1
    return (place, world) if 0 <= place < world else (0, 1)


def tasks_per_node(text: str) -> list[int]:
    """Slurm's ``"2(x3),1"`` as ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in filter(None, text.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            return []
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def first_host(node_list: str) -> str:
    """The first host of a Slurm node list: ``"gpu[03-05,9],cpu1"`` -> ``"gpu03"``."""
    match = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?([^,]*)", node_list.strip())
    prefix, ranges, suffix = match.groups() if match else (node_list, None, "")
    if not ranges:
        return prefix + suffix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first + suffix
