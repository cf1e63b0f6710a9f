"""The one error of the checkpoint package, in a module of its own that imports nothing.

Every module of :mod:`hapi.checkpoint` raises it, and :mod:`hapi.resume` too;
users catch it as ``hapi.checkpoint.CheckpointError``.
"""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, damaged, unsafe or does not fit the model."""
