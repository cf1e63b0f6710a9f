"""Checkpoints: one file (or one sharded directory) per save, written atomically, read safely.

The modules of this package, each with one job:

* :mod:`~hapi.checkpoint.files` -- every file written, renamed, linked or deleted, and
  every name read from a file joined to its directory (atomic writes, confinement, no
  link followed): the one module that touches files, for torch-hapi's callbacks too;
* :mod:`~hapi.checkpoint.state` -- the file format (``FORMAT``), :func:`save_state`
  and :func:`load_state` (which process writes, which reads, what is safe to read);
* :mod:`~hapi.checkpoint.write` -- one file written and verified (tensors and plain
  values only);
* :mod:`~hapi.checkpoint.background` -- saves running beside training, and the
  snapshot that makes each capture one moment;
* :mod:`~hapi.checkpoint.sharded` -- a sharded checkpoint's directory and manifest;
  :mod:`~hapi.checkpoint.dcp_io` its tensors through ``torch.distributed.checkpoint``,
  read through :mod:`~hapi.checkpoint.dcp_reader`, which runs no code from the files;
* :mod:`~hapi.checkpoint.matching` -- a saved state against this model and optimizer.

Imports go one way: this package uses :mod:`hapi.distributed` (which process writes),
which never imports it back; the callbacks import its public names (``files``,
``atomic_write``, ``CheckpointError``), never a module of it.
"""

from typing import Any

from hapi.checkpoint import files
from hapi.checkpoint.background import release_staging, wait_for_writes
from hapi.checkpoint.errors import CheckpointError, cause_in_words
from hapi.checkpoint.files import UnsafeNameError, atomic_write
from hapi.checkpoint.sharded import MANIFEST, save_sharded, shards_directory
from hapi.checkpoint.state import (
    FORMAT,
    SUFFIX,
    VERSION,
    load_freshest_state,
    load_state,
    resolve_path,
    save_state,
)
from hapi.checkpoint.write import write_file

__all__ = [
    "CheckpointError",
    "FORMAT",
    "MANIFEST",
    "SUFFIX",
    "VERSION",
    "UnsafeNameError",
    "atomic_write",
    "cause_in_words",
    "files",
    "load_freshest_state",
    "load_optimizer_shards",
    "load_shards",
    "load_state",
    "release_staging",
    "resolve_path",
    "save_sharded",
    "save_shards",
    "save_state",
    "saved_shapes",
    "shards_directory",
    "wait_for_writes",
    "write_file",
]

# A sharded checkpoint's tensors go through torch.distributed.checkpoint, whose import costs
# about a second (DTensor, sympy) on every process: dcp_io is imported on first use.
_SHARD_IO = {"load_shards", "load_optimizer_shards", "save_shards", "saved_shapes"}


def __getattr__(name: str) -> Any:
    if name in _SHARD_IO:
        from hapi.checkpoint import dcp_io

        return getattr(dcp_io, name)
    raise AttributeError(f"module 'hapi.checkpoint' has no attribute {name!r}")
