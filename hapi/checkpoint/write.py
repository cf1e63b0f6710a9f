"""Writing one checkpoint file: only tensors and plain values, atomically, verified.

:func:`write_file` writes a state straight to its file (through
``hapi.checkpoint.files.atomic_write``) and verifies it with the safe loader before
the file replaces the previous one. :mod:`hapi.checkpoint.state` decides which
process writes and when; :mod:`hapi.checkpoint.background` runs it beside
training.
"""

from __future__ import annotations

import collections
import os
import pickle
from typing import Any, Callable

import numpy as np
import torch

from hapi.checkpoint.errors import CheckpointError, write_failed
from hapi.checkpoint.files import atomic_write, remove_empty_directory


def write_file(state: dict[str, Any], target: str) -> None:
    """``state`` to ``target`` atomically, as a checkpoint that loads with ``weights_only=True``.

    NumPy scalars (``lr=0.1 * np.sqrt(4)`` is common in scaling recipes) pickle
    as NumPy objects, which the safe loader refuses: they are stored as the
    Python numbers they are. The file is written straight to disk, then read
    back with ``torch.load(weights_only=True, mmap=True)`` (its structure, not
    a second copy of the tensors) before it replaces ``target``: anything the
    safe loader would refuse makes the save fail now, naming the entry,
    instead of a backup that is found useless only after a crash.

    Raises:
        CheckpointError: an entry of ``state`` is not a tensor or plain value,
            or the file could not be written (naming the cause: a full disk,
            a directory it may not write to); the directories this write
            created are removed again.
    """
    converted = plain(state)
    created = missing_directories(target)
    try:
        _write(converted, target)
    except BaseException as error:
        for directory in created:
            remove_empty_directory(directory)
        if isinstance(error, (OSError, RuntimeError)) and not isinstance(error, CheckpointError):
            raise write_failed(target, error) from error  # torch says a full disk as a RuntimeError
        raise


def _write(converted: Any, target: str) -> None:
    try:
        with atomic_write(target, "wb", verify=_loads_safely) as handle:
            torch.save(converted, handle)  # an object pickle cannot even write fails here
    except (pickle.PicklingError, pickle.UnpicklingError, AttributeError, TypeError) as error:
        refuse_unsafe(converted, target, error)
        raise


def missing_directories(target: str) -> list[str]:
    """The directories a write of ``target`` creates, deepest first: removed again if it fails."""
    missing, directory = [], os.path.dirname(os.path.abspath(target))
    while not os.path.lexists(directory):
        missing.append(directory)
        directory = os.path.dirname(directory)
    return missing


def detail(error: BaseException) -> str:
    """The unpickler's own message: torch wraps it in a generic ``weights_only`` preamble."""
    inner = error.__context__ if isinstance(error.__context__, pickle.UnpicklingError) else error
    lines = [line.strip() for line in str(inner).splitlines() if line.strip()]
    telling = [line for line in lines if "GLOBAL" in line or "Unsupported" in line]
    return (telling or lines or ["no detail"])[0]


def _loads_safely(file: str) -> None:
    torch.load(file, map_location="cpu", weights_only=True, mmap=True)


def refuse_unsafe(converted: Any, target: str, error: BaseException | None = None) -> None:
    """Raise, naming the entry, if ``converted`` (see :func:`plain`) holds what the safe loader
    refuses, or the safe loader refused it (``error``, an ``UnpicklingError``)."""
    offender = _first_unsafe(converted, "checkpoint")
    if offender is None and not isinstance(error, pickle.UnpicklingError):
        return
    raise CheckpointError(
        f"Not saving {target!r}: {offender or 'an entry: ' + detail(error)}, which "
        "torch.load(weights_only=True) refuses, so the file could never be loaded again. Checkpoints hold tensors and plain Python "
        "values (numbers, strings, lists, dicts): store that entry as one (e.g. float(x), "
        "x.tolist(), or a tensor), or leave it out of the state_dict() that holds it."
    ) from error


# The leaves the safe loader reads (and tensors): Python's plain values, then torch's.
_PLAIN_LEAVES = (str, bytes, int, float, complex, bool, type(None))
_PLAIN_LEAVES += (torch.dtype, torch.device, torch.Size)


def rebuild(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """``value`` with ``leaf(x)`` for each ``x`` that is no dict, list or tuple, the containers
    rebuilt around the results (in order: the same state is walked the same way each time).

    A dict or ``OrderedDict`` keeps its type; any other mapping becomes a dict.
    """
    if isinstance(value, dict):
        rebuilt = type(value)() if type(value) in (dict, collections.OrderedDict) else {}
        rebuilt.update((key, rebuild(item, leaf)) for key, item in value.items())
        return rebuilt
    if type(value) in (list, tuple):
        return type(value)(rebuild(item, leaf) for item in value)
    return leaf(value)


def plain(value: Any) -> Any:
    """``value`` with NumPy scalars and arrays turned into Python numbers and tensors."""
    return rebuild(value, _plain_leaf)


def _plain_leaf(value: Any) -> Any:
    if isinstance(value, np.generic):  # before the numbers: np.float64 is a float subclass
        return value.item()
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    return value


def _first_unsafe(value: Any, path: str) -> str | None:
    """Where the first entry the safe loader would refuse lies, and its type: ``"<path> is a <type>"``."""
    if isinstance(value, dict):
        for key, item in value.items():
            found = _first_unsafe(item, f"{path}[{key!r}]")
            if found:
                return found
        return (
            None
            if type(value) in (dict, collections.OrderedDict)
            else f"{path} is a {type(value).__name__}"
        )
    if type(value) in (list, tuple):
        for index, item in enumerate(value):
            found = _first_unsafe(item, f"{path}[{index}]")
            if found:
                return found
        return None
    if type(value) in _PLAIN_LEAVES or torch.is_tensor(value):
        return None
    return f"{path} is a {type(value).__module__}.{type(value).__qualname__}"
