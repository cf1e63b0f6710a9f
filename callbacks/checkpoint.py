"""The checkpoint callbacks, by their historical module name.

:class:`ModelCheckpoint` lives in :mod:`callbacks.model_checkpoint` and
:class:`BackupAndRestore` in :mod:`callbacks.backup`; ``from callbacks.checkpoint
import ModelCheckpoint`` keeps working for scripts and tests written before the split.
"""

from .backup import BackupAndRestore
from .model_checkpoint import ModelCheckpoint

__all__ = ["BackupAndRestore", "ModelCheckpoint"]
