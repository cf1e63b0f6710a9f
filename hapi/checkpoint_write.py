"""Writing a checkpoint file: safely (only tensors and plain values), atomically, maybe in the background.

:func:`write_file` writes a state straight to its file and verifies it with the
safe loader before the file replaces the previous one; a background save
copies the state's tensors into reused CPU buffers (:class:`_Staging`) and
writes from a thread (:class:`_BackgroundWrite`). :mod:`hapi.checkpoint`
decides which process writes and when.
"""

from __future__ import annotations

import collections
import pickle
import threading
from typing import Any, Callable

import numpy as np
import torch

from hapi.callbacks.files import atomic_write


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, damaged, unsafe or does not fit the model."""


class _BackgroundWrite:
    """At most one checkpoint write running beside training, in each process.

    Non-daemon: an interpreter that is exiting waits for the write to end, so
    a backup started just before a normal exit is complete on disk.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._target = ""

    def start(self, write: Callable[[], None], target: str) -> None:
        self.join()

        def run() -> None:
            try:
                write()
            except BaseException as error:  # noqa: BLE001 -- reported by join() on the main thread
                self._error = error

        self._target = target
        self._thread = threading.Thread(target=run, name="hapi-checkpoint-write", daemon=False)
        self._thread.start()

    def join(self) -> None:
        """Wait for the running write; raise its error (once)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise CheckpointError(
                f"Writing the checkpoint {self._target!r} in the background failed "
                f"({type(error).__name__}: {error}); the previous file there is "
                "unchanged."
            ) from error


_background = _BackgroundWrite()


class _Staging:
    """CPU copies of a state's tensors, kept from one background save to the next.

    Copying into the previous save's buffers (the same shapes and dtypes, as
    a backup of the same model has) spares allocating and faulting in a fresh
    copy each time: about a third of the copy's cost for a 300 MB state. A
    buffer is reused only after the write that read it has ended.
    """

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []

    def release(self) -> None:
        self._buffers = []

    def copy(self, state: Any) -> Any:
        """``state`` with every tensor replaced by a CPU copy; training may change the originals."""
        previous, self._buffers = self._buffers, []
        return self._copy(state, iter(previous))

    def _copy(self, value: Any, previous: Any) -> Any:
        if torch.is_tensor(value):
            buffer = next(previous, None)
            if (
                buffer is None
                or buffer.shape != value.shape
                or buffer.dtype != value.dtype
                or buffer.layout != value.layout
                or not value.is_contiguous()
            ):
                buffer = value.detach().to("cpu", copy=True)
            else:
                buffer.copy_(value.detach())
            self._buffers.append(buffer)
            return buffer
        if isinstance(value, dict):
            copied = type(value)()
            copied.update((key, self._copy(item, previous)) for key, item in value.items())
            return copied
        if type(value) in (list, tuple):
            return type(value)(self._copy(item, previous) for item in value)
        return value


_staging = _Staging()


def release_staging() -> None:
    """Free the CPU copies kept for the next background save (once saves are done, say)."""
    _background.join()
    _staging.release()


def write_file(state: dict[str, Any], target: str, reuse_previous: bool = False) -> None:
    """``state`` to ``target`` atomically, as a checkpoint that loads with ``weights_only=True``.

    NumPy scalars (``lr=0.1 * np.sqrt(4)`` is common in scaling recipes) pickle
    as NumPy objects, which the safe loader refuses: they are stored as the
    Python numbers they are. The file is written straight to disk, then read
    back with ``torch.load(weights_only=True, mmap=True)`` (its structure, not
    a second copy of the tensors) before it replaces ``target``: anything the
    safe loader would refuse makes the save fail now, naming the entry,
    instead of a backup that is found useless only after a crash.
    ``reuse_previous``: see :func:`callbacks.files.atomic_write`.

    Raises:
        CheckpointError: an entry of ``state`` is not a tensor or plain value.
    """
    plain = _plain(state)
    try:
        with atomic_write(
            target, "wb", verify=_loads_safely, reuse_previous=reuse_previous
        ) as handle:
            torch.save(plain, handle)  # an object pickle cannot even write fails here
    except (pickle.PicklingError, pickle.UnpicklingError, AttributeError, TypeError) as error:
        offender = _first_unsafe(plain, "checkpoint")
        if offender is None and not isinstance(error, pickle.UnpicklingError):
            raise
        raise _unsafe_entry(
            target,
            f"{offender[0]} is a {offender[1]}" if offender else f"an entry: {_detail(error)}",
        ) from error


def _detail(error: BaseException) -> str:
    """The unpickler's own message: torch wraps it in a generic ``weights_only`` preamble."""
    inner = error.__context__ if isinstance(error.__context__, pickle.UnpicklingError) else error
    lines = [line.strip() for line in str(inner).splitlines() if line.strip()]
    telling = [line for line in lines if "GLOBAL" in line or "Unsupported" in line]
    return (telling or lines or ["no detail"])[0]


def _loads_safely(file: str) -> None:
    torch.load(file, map_location="cpu", weights_only=True, mmap=True)


def _refuse_unsafe(plain: Any, target: str) -> None:
    offender = _first_unsafe(plain, "checkpoint")
    if offender is not None:
        raise _unsafe_entry(target, f"{offender[0]} is a {offender[1]}")


def _unsafe_entry(target: str, where: str) -> CheckpointError:
    return CheckpointError(
        f"Not saving {target!r}: {where}, which torch.load(weights_only=True) refuses, so "
        "the file could never be loaded again. Checkpoints hold tensors and plain Python "
        "values (numbers, strings, lists, dicts): store that entry as one (e.g. float(x), "
        "x.tolist(), or a tensor), or leave it out of the state_dict() that holds it."
    )


_PLAIN_LEAVES = (
    torch.Tensor,
    str,
    bytes,
    int,
    float,
    complex,
    bool,
    type(None),
    torch.dtype,
    torch.device,
    torch.Size,
)


def _plain(value: Any) -> Any:
    """``value`` with NumPy scalars and arrays turned into Python numbers and tensors."""
    if isinstance(value, np.generic):  # before the numbers: np.float64 is a float subclass
        return value.item()
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, dict):
        converted = type(value)() if type(value) in (dict, collections.OrderedDict) else {}
        converted.update((key, _plain(item)) for key, item in value.items())
        return converted
    if type(value) in (list, tuple):
        return type(value)(_plain(item) for item in value)
    return value


def _first_unsafe(value: Any, path: str) -> tuple[str, str] | None:
    """Where the first entry the safe loader would refuse lies, and its type."""
    if isinstance(value, dict):
        for key, item in value.items():
            found = _first_unsafe(item, f"{path}[{key!r}]")
            if found:
                return found
        return (
            None if type(value) in (dict, collections.OrderedDict) else (path, type(value).__name__)
        )
    if type(value) in (list, tuple):
        for index, item in enumerate(value):
            found = _first_unsafe(item, f"{path}[{index}]")
            if found:
                return found
        return None
    if type(value) in _PLAIN_LEAVES or isinstance(value, torch.Tensor):
        return None
    return path, f"{type(value).__module__}.{type(value).__qualname__}"
