"""The one error of the checkpoint package, in a module of its own that imports nothing.

Every module of :mod:`hapi.checkpoint` raises it, and :mod:`hapi.resume` too;
users catch it as ``hapi.checkpoint.CheckpointError``.
"""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or loaded safely, or does not fit the model.

    Raised by ``Model.save``/``Model.load`` (and the callbacks that call them)
    instead of a bare unpickling or ``load_state_dict`` error, with a message
    that names the file, the cause and the fix: a truncated or corrupt file,
    a file that holds Python objects other than tensors and plain values
    (torch-hapi never runs code from a checkpoint), weights of another
    architecture (the keys and shapes that differ), an optimizer state that
    does not fit, a state that could not be read back safely, a failed
    background write, or a file not saved to resume a fit. A missing file is
    ``FileNotFoundError``. Under several processes it is raised on every
    process.
    """
