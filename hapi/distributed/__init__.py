"""Everything torch-hapi knows about processes, ranks and devices.

A script needs only its public part (``__all__``): :func:`rank`,
:func:`world_size`, :func:`is_main` and :func:`local_rank`, which answer
from the launcher's environment even before a ``Model`` exists;
:func:`init`, :func:`barrier` and :func:`main_process_first` for what comes
before the Model (a ``DistributedSampler``, a download); the
:class:`DistributedSetupError` a bad launch raises; and the strategies
``DDP``/``FSDP`` (also ``hapi.DDP``/``hapi.FSDP``). The rest serves hapi's own
modules and may change.

The loop, the steps and the callbacks never test a rank: they call the
functions here, each of which is a no-op (or the identity) on a single
process. This is the only module of ``hapi`` (with the launcher) that imports
``torch.distributed``; everything is PyTorch's own engine: the default
process group (NCCL on CUDA, Gloo on CPU), ``DistributedDataParallel``,
``DistributedSampler``, and the collectives.

When does a run become distributed? When ``WORLD_SIZE`` > 1 in the
environment (``torchrun``, :func:`hapi.spawn`, or any launcher setting the
torch.distributed variables ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``; ``srun``, ``jsrun`` and ``mpirun`` are read
too, see :func:`hapi.distributed.env.launcher_variables`), or when the user already created the
default process group -- then it is reused, and left for the user to destroy.

How long a dead rank can stall the others: under ``torchrun`` or
:func:`hapi.spawn` the launcher kills the surviving workers as soon as one
exits with an error (within about a second). Without a launcher watching, a
killed peer is noticed in about two seconds (Gloo sees its connection close;
the shared-memory average checks its process), and a collective waits for a
peer that is alive but stuck at most ``HAPI_DIST_TIMEOUT`` seconds (default
300) before it raises.
"""

# ruff: noqa: F401  (imported for hapi's own modules; see __all__ below)

from hapi.distributed.collectives import (
    SyncFlag,
    all_reduce_sum,
    any_true,
    average_gradients,
    barrier,
    broadcast_bytes,
    broadcast_freshest,
    gather_in_order,
    gather_objects,
    is_collective_failure,
    main_process_first,
    on_main,
    shared_seed,
    sync_from_main,
    this_process_part,
)
from hapi.distributed.env import DistributedSetupError
from hapi.distributed.fsdp import full_state_dict, load_full_state_dict, sharded_parameters
from hapi.distributed.group import background_group, default_device, init, local_rank, note_failure

# What scripts (and hapi's modules outside this package) ask: the group's answers once it exists,
# the launcher's (torchrun, hapi.spawn, srun, jsrun, mpirun) before, so a script can act on its rank before
# building the Model. The collectives here ask the group alone (group.rank, group.world_size).
from hapi.distributed.group import launched_is_main as is_main
from hapi.distributed.group import launched_rank as rank
from hapi.distributed.group import launched_world_size as world_size
from hapi.distributed.strategies import DDP, FSDP, class_name, resolve_strategy

# What a user's script may call. Everything else imported above serves hapi's own modules: it
# stays importable (``hapi.distributed.barrier``) but is no promise and may change.
__all__ = [
    "DDP",
    "FSDP",
    "DistributedSetupError",
    "barrier",
    "init",
    "is_main",
    "local_rank",
    "main_process_first",
    "rank",
    "world_size",
]
