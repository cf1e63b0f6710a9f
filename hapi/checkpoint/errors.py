"""The one error of the checkpoint package, and the words for why a file could not be written.

A module of its own that imports nothing of torch-hapi: every module of
:mod:`hapi.checkpoint` raises the error, and :mod:`hapi.state` and :mod:`hapi.amp` too (:func:`refuse`); users
catch it as ``hapi.checkpoint.CheckpointError``. The words for a full disk, a
read-only one or a permission (:func:`cause_in_words`) are said here only, for
every file torch-hapi writes (the CSV log too).
"""

from __future__ import annotations

import errno
from typing import Any

import torch


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or loaded safely, or does not fit the model.

    Raised by ``Model.save``/``Model.load`` (and the callbacks that call them)
    instead of a bare unpickling, ``OSError`` or ``load_state_dict`` error,
    with a message that names the file, the cause and the fix: a full disk
    or a directory it may not write to (:class:`CheckpointWriteError`, an
    ``OSError`` too, with its ``errno``), a truncated or corrupt file, a file
    that holds Python objects other than tensors and plain values
    (torch-hapi never runs code from a checkpoint), weights of another
    architecture (the keys and shapes that differ), an optimizer state that
    does not fit, a state that could not be read back safely, a failed
    background write, or a file not saved to resume a fit. A missing file is
    ``FileNotFoundError``. Under several processes it is raised on every
    process.
    """


# errno -> (the cause in words, what to do).
_FREE = "free space there or save to another disk"
_DENIED = ("permission denied", "save to a directory you may write to")
_CAUSES = {
    errno.ENOSPC: ("the disk is full", _FREE),
    getattr(errno, "EDQUOT", errno.ENOSPC): ("the disk quota is used up", _FREE),
    errno.EACCES: _DENIED,
    errno.EPERM: _DENIED,
    errno.EROFS: ("the file system is read-only", "save to a writable disk"),
}


class CheckpointWriteError(OSError, CheckpointError):
    """A checkpoint could not be written: a :class:`CheckpointError` and the ``OSError`` it was.

    ``errno`` (``errno.ENOSPC`` for a full disk) and ``filename`` are those of
    the failed write, so ``except OSError`` still catches it; the message says
    the cause in words.
    """

    def __str__(self) -> str:
        return str(self.strerror)


def write_failed(target: str, error: BaseException) -> CheckpointError:
    """The error for a checkpoint ``target`` that could not be written: the cause in words.

    A :class:`CheckpointWriteError` (an ``OSError``) when the disk refused the write; an
    error of torch's that no ``OSError`` is behind (a CUDA error, say) is a plain
    :class:`CheckpointError`: retrying the write would not help.
    """
    found, cause = _cause(error)
    message = f"Could not write the checkpoint {target!r}: {cause}."
    if found is None and not isinstance(error, OSError):
        return CheckpointError(message)
    return CheckpointWriteError(
        found.errno if found else None, f"{message} The previous file there is unchanged.", target
    )


def cause_in_words(error: BaseException) -> str:
    """Why writing a file failed and what to do, in words (see :func:`_cause`).

    ``"the disk is full (No space left on device); free space there or save to
    another disk"`` for a full disk; the error's type and message when its
    cause is none of a full disk, a read-only one or a permission.
    """
    return _cause(error)[1]


def _cause(error: BaseException) -> tuple[OSError | None, str]:
    """The ``OSError`` behind ``error``, and why the write failed and what to do, in words.

    torch reports a full disk as ``RuntimeError: [enforce fail at
    inline_container.cc:672] . unexpected pos ...``, the ``OSError`` it met
    only as that error's context, and torch's distributed checkpoint wraps
    each process's error in a ``CheckpointException`` (its ``failures``):
    the chain is searched for an ``OSError`` with a known ``errno``.
    """
    seen, pending = set(), [error]
    while pending:
        cause = pending.pop(0)
        if cause is None or id(cause) in seen:
            continue
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in _CAUSES:
            words, advice = _CAUSES[cause.errno]
            return cause, f"{words} ({cause.strerror}); {advice}"
        failures = getattr(cause, "failures", None)  # torch's CheckpointException: rank -> error
        if isinstance(failures, dict):
            pending += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        pending += [cause.__cause__, cause.__context__]
    return None, f"{type(error).__name__}: {error}"


CRAFTED = "it is damaged or was crafted. Resume from another checkpoint, or start afresh."


def _short(value: Any) -> str:
    text = f"a tensor of shape {tuple(value.shape)}" if torch.is_tensor(value) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def refuse(file: str, where: str, value: Any, expected: str) -> None:
    """A field read from ``file`` that no run writes: a CheckpointError naming it and its value."""
    raise CheckpointError(f"{file!r} holds {where} = {_short(value)}, not {expected}: {CRAFTED}")
