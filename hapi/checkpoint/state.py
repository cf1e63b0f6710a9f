"""The checkpoint file: its format, who writes it and when, and reading it safely.

A checkpoint is a plain dict of tensors and Python scalars, saved with
``torch.save`` and read back with ``torch.load(weights_only=True)``: a file
that carries code (pickled classes or functions) is refused, never executed.
Writes go through :func:`hapi.checkpoint.files.atomic_write` (see
:mod:`hapi.checkpoint.write`), so a crash while saving leaves the previous
file intact.

Layout of a training checkpoint (``FORMAT``)::

    {"format": "torch-hapi", "version": 1,
     "network": state_dict, "optimizer": state_dict | None,
     "scaler": state_dict | None, "epoch": int, "step": int,
     "rng": {"torch": ByteTensor, "cuda": [ByteTensor], "numpy": {...},
             "python": [int, ...]},
     "fit": {...}}  # resumable saves only (hapi.resume.fit_state): the data order, and per
                    # process its random streams, running figures and, for a Model whose own
                    # train_step carries state between batches, its "step_state" dict

A bare ``state_dict`` saved by plain PyTorch (``torch.save(net.state_dict())``)
loads too, as network weights.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import re
from typing import IO, Any

import torch

from hapi import distributed
from hapi.checkpoint import background, files
from hapi.checkpoint.errors import CheckpointError
from hapi.checkpoint.files import MANIFEST
from hapi.checkpoint.write import detail, plain, refuse_unsafe, write_file

FORMAT = "torch-hapi"
VERSION = 1
SUFFIX = ".pt"

# The global torch's weights-only unpickler refused, e.g. "GLOBAL posix.system".
_GLOBAL = re.compile(r"GLOBAL [A-Za-z_]\w*(\.[A-Za-z_]\w*)+(\s|$)")


def resolve_path(path: str | os.PathLike) -> str:
    """The file a save of ``path`` writes: ``path`` + ``.pt`` unless it ends so.

    Mirrors Paddle, where ``model.save("ckpt/final")`` writes
    ``ckpt/final.pdparams``: users name checkpoints without a suffix.

    Raises:
        ValueError: ``path`` names no file (``""``, or a directory such as
            ``"ckpt/"``), which would write a hidden ``.pt`` (Paddle and
            Keras refuse it too).
    """
    path = check_path(path)
    return path if path.endswith((".pt", ".pth")) else path + SUFFIX


def check_path(path: str | os.PathLike, directory: bool = False) -> str:
    """``path`` as a str, once it names a file (or, with ``directory``, a directory).

    ``""``, a path ending in a separator, ``.`` or ``..`` name no file: a save
    there would write the hidden file ``.pt`` (or ``..pt``) where it ends.

    Raises:
        ValueError: naming the path received and what to pass instead.
    """
    given = os.fsdecode(os.fspath(path))
    name = os.path.basename(given.rstrip("/" + os.sep) if directory else given)
    if "\0" in given or (not given if directory else name in ("", ".", "..")):
        raise ValueError(
            f"A checkpoint path must name a {'directory' if directory else 'file'}; received "
            f"{given!r}, which names none (a save would write the hidden file '.pt' where it "
            "ends). Pass a name, e.g. model.save('checkpoints/final')."
        )
    return given


def save_state(path: str | os.PathLike, state: dict[str, Any], wait: bool = True) -> str:
    """Write ``state`` atomically on the main process; every process waits.

    With ``wait=False`` the main process copies the state's tensors (to CPU
    memory) and returns; a background thread writes the file. The previous
    background write is waited for first, here and in :func:`wait_for_writes`,
    and its failure raised then, on every process. Returns the file written.

    Raises:
        ValueError: ``path`` names no file (see :func:`check_path`).
        CheckpointError: an entry is neither a tensor nor a plain value
            (at once, also with ``wait=False``), or writing failed.
    """
    target = resolve_path(path)
    background.wait_for_writes()

    def start() -> None:
        converted = plain(state)
        refuse_unsafe(converted, target)  # now, not in the background
        staged = background.stage(converted)  # the previous write has ended: reused
        background.background.start(functools.partial(write_file, staged, target), target)

    if not wait:
        background.background.started = True  # on every process: a load now waits for it everywhere

    distributed.on_main(
        functools.partial(write_file, state, target) if wait else start,
        lambda: CheckpointError(
            f"Rank 0 could not write the checkpoint {target!r}; see its error."
        ),
    )
    return target


def _candidates(path: str | os.PathLike) -> list[str]:
    """The files a checkpoint named ``path`` may be: ``path.pt``, ``path``, a sharded one's manifest."""
    given = os.fspath(path)
    if given.endswith((".pt", ".pth")):
        return [given]
    return [given + SUFFIX, given, os.path.join(given, MANIFEST)]


def _existing_files(path: str | os.PathLike, follow_links: bool = True) -> list[str]:
    """The candidates that exist. Without ``follow_links`` (a resume, which reads what
    torch-hapi wrote in its own directories) a symbolic link among them is refused."""
    return [
        candidate if follow_links else files.refuse_link(candidate, "The checkpoint to resume ")
        for candidate in _candidates(path)
        if os.path.islink(candidate) or os.path.isfile(candidate)
    ]


def _existing_file(path: str | os.PathLike) -> str:
    given, found = os.fspath(path), _existing_files(path)
    if found:
        return found[0]
    directory = os.path.dirname(os.path.abspath(given)) or "."
    nearby = (
        sorted(name for name in os.listdir(directory) if name.endswith((".pt", ".pth")))
        if os.path.isdir(directory)
        else []
    )
    hint = f" Checkpoints in {directory}: {nearby}." if nearby else ""
    raise FileNotFoundError(
        f"No checkpoint found at {given!r} (tried {', '.join(map(repr, _candidates(path)))})."
        f"{hint} Pass the path you gave to Model.save(), or a file written by ModelCheckpoint "
        "(<save_dir>/<epoch>, <save_dir>/best, <save_dir>/final)."
    )


def load_state(path: str | os.PathLike) -> tuple[str, dict[str, Any]]:
    """Read a checkpoint safely; returns ``(file, state)`` with tensors on CPU.

    After a background save (every process made it) this is a collective:
    every process waits until the file is on disk, not only the one writing
    it, which alone would read the new file while the others read the old.
    Otherwise it may run on one process alone.

    Raises:
        FileNotFoundError: no such checkpoint (lists the paths tried).
        CheckpointError: the file is truncated or corrupt, carries code, or
            is not a checkpoint at all.
    """
    background.wait_if_saving()  # a background save of it, on whichever process writes it
    file = _existing_file(path)  # a link the user passes, or made, is the user's choice
    with open(file, "rb") as handle:
        return file, _parse(handle, file)


def load_freshest_state(path: str | os.PathLike) -> tuple[str, dict[str, Any]]:
    """The copy of ``path`` furthest into training among all machines, on every process.

    A collective. Only rank 0 writes checkpoints, and when torchrun restarts a
    job the ranks may land on other machines: without a shared file system
    the latest backup may then lie on any machine, and an older one on
    another. One process per machine (local rank 0) reads its copy; the copy
    with the most optimizer steps (then epochs, then batches) is sent to
    every process, the lowest rank's on a tie, and each parses it the same
    safe way.

    Raises:
        FileNotFoundError: on every process, when no machine has the file.
        CheckpointError, OSError: on every process, when a machine's copy
            cannot be read (that machine raises the error itself).
    """
    background.wait_for_writes()
    file = resolve_path(path)

    def read() -> tuple[tuple, bytes, dict[str, Any]] | None:
        # Either kind (a file, or a sharded checkpoint's manifest) may be here, both when
        # a restart changed the strategy: the one further into training wins.
        copies = []
        for found in _existing_files(path, follow_links=False):
            # O_NOFOLLOW: a link planted after the check is not read either.
            with os.fdopen(files.open_nofollow(found, os.O_RDONLY), "rb") as handle:
                payload = handle.read()
            state = _parse(io.BytesIO(payload), found)
            progress = tuple(state.get(key, 0) for key in ("step", "epoch", "epoch_step"))
            copies.append((progress, payload, state))
        # None: another machine may have one.
        return max(copies, key=lambda copy: copy[0]) if copies else None

    freshest = distributed.broadcast_freshest(
        read,
        lambda source: CheckpointError(
            f"Rank {source} could not read its copy of {file!r}; see its error."
        ),
    )
    if freshest is None:
        raise FileNotFoundError(f"No process found a checkpoint at {file!r} on its machine.")
    payload, state = freshest
    state = state if state is not None else _parse(io.BytesIO(payload), file)
    return (os.path.join(os.fspath(path), MANIFEST) if "shards" in state else file), state


def _parse(source: IO[bytes], file: str) -> dict[str, Any]:
    """``torch.load(weights_only=True)`` of ``source`` (the file, or its bytes), its errors explained."""
    try:
        state = torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        if not _carries_code(error):
            raise _damaged(file, error) from error
        raise CheckpointError(
            f"Checkpoint {file!r} holds Python objects other than tensors and plain "
            "values (it may carry code), so torch-hapi refuses to load it: files are "
            "read with torch.load(weights_only=True) and never execute code. If you "
            "wrote this file yourself and trust it, load it with "
            "torch.load(path, weights_only=False) and pass the state dict to "
            f"model.network.load_state_dict(). Details: {detail(error)}"
        ) from error
    except PermissionError:
        raise  # names the file; not a damaged checkpoint
    except Exception as error:  # noqa: BLE001 -- a damaged file can fail anywhere in torch's reader
        raise _damaged(file, error) from error
    return _normalise(file, state)


def _carries_code(error: pickle.UnpicklingError) -> bool:
    """Whether torch refused a pickled global (a class or function), not unreadable bytes.

    A corrupt file also fails inside the weights-only unpickler ("Unsupported
    operand ..."); only a refused ``GLOBAL`` with a well-formed dotted name
    (``posix.system``, ``mymodule.MyClass``) means the file asks to import code.
    """
    return _GLOBAL.search(f"{error}\n{error.__context__ or ''}") is not None


def _damaged(file: str, error: BaseException) -> CheckpointError:
    size = os.path.getsize(file)
    return CheckpointError(
        f"Checkpoint {file!r} ({size} bytes) is truncated or corrupt and cannot be read "
        f"({type(error).__name__}: {detail(error)}). "
        "It was probably cut off while being copied or written by another tool; torch-hapi "
        "itself writes checkpoints atomically. Use an earlier checkpoint or save it again."
    )


def _normalise(file: str, state: Any) -> dict[str, Any]:
    if isinstance(state, dict) and state.get("format") == FORMAT:
        return state
    if isinstance(state, dict) and state and all(torch.is_tensor(v) for v in state.values()):
        return {"format": FORMAT, "version": VERSION, "network": state}
    raise CheckpointError(
        f"{file!r} is not a torch-hapi checkpoint nor a state_dict (found "
        f"{type(state).__name__}{' with keys ' + str(sorted(state)[:8]) if isinstance(state, dict) else ''}). "
        "Save checkpoints with Model.save(path), or torch.save(network.state_dict(), path)."
    )
