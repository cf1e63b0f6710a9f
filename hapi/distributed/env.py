"""What the launcher told this process: environment variables, read with clear errors."""

from __future__ import annotations

import datetime
import os
import pathlib
import re
import zlib

from hapi.messages import warn


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
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise DistributedSetupError(
            f"The environment variable {name}={value!r} is not an integer. Launch with "
            "torchrun or hapi.spawn, which set it, or fix the value."
        ) from None


def timeout() -> datetime.timedelta:
    """How long a collective may wait for the others (``HAPI_DIST_TIMEOUT``, seconds; 300 unset)."""
    return datetime.timedelta(seconds=env_int("HAPI_DIST_TIMEOUT", 300))


# Each launcher's own variables for a process's rank and the number of processes. Open MPI
# and MPICH (or Intel MPI) are two entries of mpirun's.
_PLACES = {
    "torch": ("RANK", "WORLD_SIZE"),
    "slurm": ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS"),
    "lsf": ("JSM_NAMESPACE_RANK", "JSM_NAMESPACE_SIZE"),
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    "mpich": ("PMI_RANK", "PMI_SIZE"),
}


def _launcher() -> str | None:
    """Which launcher placed this process (a key of ``_PLACES``), ``None`` for one process.

    ``torchrun``, :func:`hapi.spawn` and Kubeflow's PyTorchJob set
    ``WORLD_SIZE`` themselves, and win. Otherwise Slurm's ``srun`` when its
    step has several tasks, unless LSF's ``jsrun`` or ``mpirun`` count
    another number of processes in their per-process variables: ``mpirun``
    inside an allocation, whose processes may inherit the step of Open MPI's
    daemons (one task per node). LSF comes before MPI, since ``jsrun`` also
    sets Open MPI's variables but only LSF's name the first host.
    """
    if os.environ.get("WORLD_SIZE"):
        return "torch"
    mpi = "openmpi" if "OMPI_COMM_WORLD_RANK" in os.environ else "mpich"
    per_process = None
    if env_int("JSM_NAMESPACE_SIZE", 0) > 1 and "LSB_JOBID" in os.environ:
        per_process = "lsf"
    elif env_int(_PLACES[mpi][1], 0) > 1 and _PLACES[mpi][0] in os.environ:
        per_process = mpi
    step_tasks = env_int("SLURM_STEP_NUM_TASKS", 0)
    if per_process and step_tasks != env_int(_PLACES[per_process][1], 0):
        return per_process
    return "slurm" if step_tasks > 1 else per_process


def launcher_variables() -> dict[str, str]:
    """The torch.distributed variables this process's launcher implies, read without changing them.

    The launcher is :func:`_launcher`'s. Kubeflow sets no ``LOCAL_RANK``:
    one process per pod, or ``RANK`` mod ``LOCAL_WORLD_SIZE`` where that is
    set. ``srun`` (:func:`_from_slurm`), ``jsrun`` (:func:`_from_lsf`) and
    ``mpirun`` (:func:`_from_mpi`) each start N copies of the script and
    tell each its place only in their own variables: read as one process
    each, every copy would train alone as rank 0 and write the same files.
    Each gives ``(local rank, processes on this machine, first host, job)``
    for a world of the launcher's count; ``MASTER_PORT`` is derived from
    the job, which every process shares (20000 + the job id mod 40000, or a
    hash of a job name). ``MASTER_ADDR``/``MASTER_PORT`` set by the user are
    kept. A script run directly in a Slurm batch script (no ``srun``) sees
    the allocation's ``SLURM_NTASKS`` but no step variables: it is one
    process, and a warning says how to start the others.
    """
    launcher = _launcher()
    if launcher == "torch":
        if os.environ.get("LOCAL_RANK"):
            return {}
        return {"LOCAL_RANK": str(env_int("RANK", 0) % max(env_int("LOCAL_WORLD_SIZE", 1), 1))}
    if launcher is None:
        if env_int("SLURM_NTASKS", 1) > 1 and "SLURM_STEP_NUM_TASKS" not in os.environ:
            warn(
                f"This Slurm allocation has SLURM_NTASKS={os.environ['SLURM_NTASKS']} tasks, but the "
                "script was not started by srun: it trains alone. Use `srun python train.py`.",
            )
        return {}
    rank_name, world_name = _PLACES[launcher]
    world = env_int(world_name, 0)
    reader = {"slurm": _from_slurm, "lsf": _from_lsf}.get(launcher, _from_mpi)
    local, local_world, host, job = reader(world)
    number = int(job) if job.isdigit() else zlib.crc32(job.encode())
    return {
        "RANK": str(env_int(rank_name, 0)),  # an integer, or a DistributedSetupError naming it
        "LOCAL_RANK": local,
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(local_world),
        "MASTER_ADDR": os.environ.get("MASTER_ADDR") or host,
        "MASTER_PORT": os.environ.get("MASTER_PORT") or str(20000 + number % 40000),
    }


def _unplaced(launched: str, wrong: str, launcher: str) -> DistributedSetupError:
    return DistributedSetupError(
        f"{launched}, but {wrong}, so this process cannot tell its place. Start the script with "
        f"{launcher} itself (not through a wrapper that clears the environment), or set RANK, "
        "LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT."
    )


def _from_slurm(world: int) -> tuple[str, int, str, str]:
    """Under ``srun`` with several tasks: ``LOCAL_RANK`` from ``SLURM_LOCALID``,
    ``LOCAL_WORLD_SIZE`` from this node's share of ``SLURM_STEP_TASKS_PER_NODE``,
    ``MASTER_ADDR`` the first host of the step's node list, the job ``SLURM_JOB_ID``."""
    missing = [n for n in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_JOB_ID") if n not in os.environ]
    nodes = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
    if missing or not nodes:
        wrong = f"{', '.join(missing) or 'SLURM_STEP_NODELIST'} is not set"
        raise _unplaced(f"srun started {world} tasks", wrong, "srun")
    # Tasks per node, "2(x3),1" for [2, 2, 2, 1]; in another form no count is known.
    counts = os.environ.get("SLURM_STEP_TASKS_PER_NODE", "").split(",")
    parts = [re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", p.strip()) for p in counts if p]
    per_node = [int(m[1]) for m in parts for _ in range(int(m[2] or 1))] if all(parts) else []
    local_world = (per_node[env_int("SLURM_NODEID", 0) :] or [world])[0]  # unknown: all of them
    # The first host of the node list, "gpu03" of "gpu[03-05,9],cpu1" (the pattern matches any
    # text: every part of it is optional).
    prefix, ranges, suffix = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?([^,]*)", nodes.strip()).groups()
    host = prefix + (ranges or "").split(",")[0].split("-")[0] + suffix
    return os.environ["SLURM_LOCALID"], local_world, host, os.environ["SLURM_JOB_ID"]


def _from_lsf(world: int) -> tuple[str, int, str, str]:
    """Under LSF's ``jsrun`` with several tasks: ``LOCAL_RANK`` from
    ``JSM_NAMESPACE_LOCAL_RANK``; ``MASTER_ADDR`` the first compute host of
    ``LSB_DJOB_RANKFILE`` (else of ``LSB_HOSTS``), after the job's launch node,
    which comes first; the job ``LSB_JOBID``."""
    launched = f"LSF started {world} tasks (JSM_NAMESPACE_SIZE)"
    rank_file = os.environ.get("LSB_DJOB_RANKFILE")
    try:
        listed = pathlib.Path(rank_file).read_text() if rank_file else os.environ.get("LSB_HOSTS")
    except OSError as error:
        wrong = f"LSB_DJOB_RANKFILE={rank_file!r} cannot be read ({error.strerror})"
        raise _unplaced(launched, wrong, "jsrun") from None
    hosts = (listed or "").split()[1:] or [""]  # the first is the job's launch node
    missing = sorted({"JSM_NAMESPACE_RANK", "JSM_NAMESPACE_LOCAL_RANK"} - set(os.environ))
    if not (hosts[0] or os.environ.get("MASTER_ADDR")):
        missing.append("a compute host in LSB_DJOB_RANKFILE or LSB_HOSTS")
    if missing:
        raise _unplaced(launched, f"{', '.join(missing)} is not set", "jsrun")
    local_world = world // len(set(hosts))
    return os.environ["JSM_NAMESPACE_LOCAL_RANK"], local_world, hosts[0], os.environ["LSB_JOBID"]


def _from_mpi(world: int) -> tuple[str, int, str, str]:
    """Under ``mpirun`` with several processes: Open MPI's ``OMPI_COMM_WORLD_LOCAL_RANK``
    and ``_LOCAL_SIZE``, or MPICH's and Intel MPI's ``MPI_LOCALRANKID`` and
    ``MPI_LOCALNRANKS`` (the rank and world are ``_PLACES``').

    On one machine ``MASTER_ADDR`` is 127.0.0.1 and ``MASTER_PORT`` is
    derived from what all the processes share with no communication: the
    job's PMIx namespace where there is one (Open MPI), else the parent
    process, ``mpirun``'s (or MPICH's per-machine proxy). Set ``MASTER_PORT``
    if that port is taken. On several machines the two must be passed to
    every process (``mpirun -x MASTER_ADDR -x MASTER_PORT``).
    """
    ompi = "OMPI_COMM_WORLD_RANK" in os.environ
    local_world = env_int("OMPI_COMM_WORLD_LOCAL_SIZE" if ompi else "MPI_LOCALNRANKS", world)
    addressed = os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")
    if local_world < world and not addressed:
        raise DistributedSetupError(
            f"mpirun started {world} processes on several machines ({local_world} here), but "
            "MASTER_ADDR and MASTER_PORT are not both set. Set them to the first machine's "
            "address and a free port, passed to every process: mpirun -x MASTER_ADDR -x MASTER_PORT"
        )
    rank = os.environ["OMPI_COMM_WORLD_RANK" if ompi else "PMI_RANK"]
    local = os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK" if ompi else "MPI_LOCALRANKID", rank)
    return local, local_world, "127.0.0.1", os.environ.get("PMIX_NAMESPACE") or str(os.getppid())


def launcher_place() -> tuple[int, int]:
    """``(rank, world size)`` as the launcher set them, read without changing the environment.

    The launcher's own variables (``RANK``/``WORLD_SIZE``, or Slurm's, LSF's
    or MPI's, which :func:`launcher_variables` turns into those). ``(0, 1)``
    when no launcher said anything usable: a value that is not an integer,
    or a rank outside ``[0, world size)``, counts as none here, since this is
    asked before (and outside) the setup that reports such errors, and a
    question like "am I the main process?" must not fail. Variables the
    setup will refuse as incomplete do not matter here: the launcher's own
    rank and count still answer.
    """
    try:
        rank_name, world_name = _PLACES.get(_launcher(), _PLACES["torch"])
        place, world = int(os.environ.get(rank_name) or -1), int(os.environ.get(world_name) or 1)
    except (DistributedSetupError, ValueError):
        return 0, 1
    return (place, world) if 0 <= place < world else (0, 1)
