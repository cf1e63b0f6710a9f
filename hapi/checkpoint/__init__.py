"""Checkpoints: one file (or one sharded directory) per save, written atomically, read safely.

The modules of this package, each with one job:

* :mod:`~hapi.checkpoint.files` -- every file written, renamed, linked or deleted, and
  every name read from a file joined to its directory (atomic writes, confinement, no
  link followed): the one module that touches files, for torch-hapi's callbacks too;
* :mod:`~hapi.checkpoint.state` -- the file format (``FORMAT``), which process writes
  and which reads, each file written and verified (tensors and plain values only) and
  read safely (:func:`save_state`, :func:`load_state`), a sharded checkpoint's
  directory and manifest (:func:`save_sharded`);
* :mod:`~hapi.checkpoint.background` -- saves running beside training, and the
  snapshot that makes each capture one moment;
* :mod:`~hapi.checkpoint.dcp_io` -- a sharded checkpoint's tensors through
  ``torch.distributed.checkpoint``, read without running code from the files;
* :mod:`~hapi.checkpoint.errors` -- :class:`CheckpointError`, and why a write failed.

Imports go one way: this package uses :mod:`hapi.distributed` (which process writes),
which never imports it back; the callbacks import its public names (``files``,
``atomic_write``, ``CheckpointError``), never a module of it. The names below are its
public part. :mod:`~hapi.checkpoint.dcp_io` is imported where a sharded checkpoint is
written or read, not here: torch.distributed.checkpoint's import costs about a second
(DTensor, sympy) on every process.
"""

# ruff: noqa: F401  (the package's public names, for torch-hapi's modules and callbacks)
from hapi.checkpoint import files
from hapi.checkpoint.background import release_staging, wait_for_writes
from hapi.checkpoint.errors import CheckpointError, cause_in_words
from hapi.checkpoint.files import MANIFEST, UnsafeNameError, atomic_write
from hapi.checkpoint.state import (
    FORMAT,
    VERSION,
    load_freshest_state,
    load_state,
    save_sharded,
    save_state,
    shards_directory,
    write_file,
)
