"""The checkpoint file: its format, who writes it and when, writing it safely and reading it safely.

A checkpoint is a plain dict of tensors and Python scalars, saved with
``torch.save`` and read back with ``torch.load(weights_only=True)``: a file
that carries code (pickled classes or functions) is refused, never executed.
Each file is written through :func:`hapi.checkpoint.files.atomic_write` and
read back with the safe loader before it replaces the previous one
(:func:`write_file`), so a crash while saving leaves the previous file intact
and a file that could never be loaded again is never written.

Layout of a training checkpoint (``FORMAT``)::

    {"format": "torch-hapi", "version": 1,
     "network": state_dict, "optimizer": state_dict | None,
     "scaler": state_dict | None, "epoch": int, "step": int,
     "rng": {"torch": ByteTensor, "cuda": [ByteTensor], "numpy": {...},
             "python": [int, ...]},
     "fit": {...}}  # resumable saves only (hapi.state._fit_state): the data order, and per
                    # process its random streams, running figures and, for a Model whose own
                    # train_step carries state between batches, its "step_state" dict

A bare ``state_dict`` saved by plain PyTorch (``torch.save(net.state_dict())``)
loads too, as network weights.

A sharded checkpoint (:func:`save_sharded`) is a directory instead::

    <path>/checkpoint.pt          the manifest: counters, RNG, fit state, the
                                  optimizer's non-tensor parts, and "shards"
    <path>/shards-<16 hex>/       the tensors, written through
                                  torch.distributed.checkpoint (hapi.checkpoint.dcp_io)

Each save writes a new shards directory; the manifest, replaced atomically
once every shard is written, then names it, and older ones are removed. A
crash at any point leaves the previous checkpoint loadable. The manifest is
data from outside when read back: the shards directory it names is joined to
the checkpoint's directory only as a plain name of the form torch-hapi writes,
never a path (``hapi.checkpoint.files.child``). No link is followed: not as the
checkpoint's directory, its manifest, a shards directory or a shard, whenever
it was planted (refused with a :class:`CheckpointError` naming it).
"""

from __future__ import annotations

import functools
import glob
import io
import os
import pickle
import re
import secrets
from typing import IO, Any, Callable

import numpy as np
import torch

from hapi import distributed
from hapi.checkpoint import background, files
from hapi.checkpoint.background import rebuild
from hapi.checkpoint.errors import CheckpointError, write_failed
from hapi.checkpoint.files import MANIFEST

FORMAT = "torch-hapi"
VERSION = 1
SUFFIX = ".pt"
_SHARDED = "Sharded checkpoint: "  # starts the refusal of a link as its directory or manifest


# The global torch's weights-only unpickler refused, e.g. "GLOBAL posix.system".
_GLOBAL = re.compile(r"GLOBAL [A-Za-z_]\w*(\.[A-Za-z_]\w*)+(\s|$)")
# The leaves the safe loader reads (and tensors): Python's plain values, then torch's.
_PLAIN_LEAVES = (str, bytes, int, float, complex, bool, type(None))
_PLAIN_LEAVES += (torch.dtype, torch.device, torch.Size)
# A written file read back with the safe loader: its structure, not a second copy of the tensors.
_LOADS_SAFELY = functools.partial(torch.load, map_location="cpu", weights_only=True, mmap=True)


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
            f"{given!r}. Pass a name, e.g. model.save('checkpoints/final')."
        )
    return given


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
    created = _missing_directories(target)
    try:
        with files.atomic_write(target, "wb", verify=_LOADS_SAFELY) as handle:
            torch.save(converted, handle)  # an object pickle cannot even write fails here
    except BaseException as error:
        for directory in created:
            files.remove_empty_directory(directory)
        if isinstance(error, (pickle.PickleError, AttributeError, TypeError)):
            refuse_unsafe(converted, target, error)
        if isinstance(error, Exception) and not isinstance(error, CheckpointError):
            raise write_failed(target, error) from error  # torch says a full disk as a RuntimeError
        raise


def _missing_directories(target: str) -> list[str]:
    """The directories a write of ``target`` creates, deepest first: removed again if it fails."""
    missing, directory = [], os.path.dirname(os.path.abspath(target))
    while not os.path.lexists(directory):
        missing.append(directory)
        directory = os.path.dirname(directory)
    return missing


def _detail(error: BaseException) -> str:
    """The unpickler's own message: torch wraps it in a generic ``weights_only`` preamble."""
    inner = error.__context__ if isinstance(error.__context__, pickle.UnpicklingError) else error
    lines = [line.strip() for line in str(inner).splitlines() if line.strip()]
    telling = [line for line in lines if "GLOBAL" in line or "Unsupported" in line]
    return (telling or lines or ["no detail"])[0]


def refuse_unsafe(converted: Any, target: str, error: BaseException | None = None) -> None:
    """Raise, naming the entry, if ``converted`` (see :func:`plain`) holds what the safe loader
    refuses, or the safe loader refused it (``error``, an ``UnpicklingError``)."""
    offender = _first_unsafe(converted, "checkpoint")
    if offender is None and not isinstance(error, pickle.UnpicklingError):
        return
    raise CheckpointError(
        f"Not saving {target!r}: {offender or 'an entry: ' + _detail(error)}, which "
        "torch.load(weights_only=True) refuses. Store it as a tensor or a plain Python value "
        "(float(x), x.tolist()), or leave it out of the state_dict() that holds it."
    ) from error


def _first_unsafe(value: Any, path: str) -> str | None:
    """Where the first entry the safe loader would refuse lies in a :func:`plain` value, and its
    type: ``"<path> is a <type>"``. Its dicts are all ``dict`` or ``OrderedDict`` already."""
    if isinstance(value, dict) or type(value) in (list, tuple):
        entries = value.items() if isinstance(value, dict) else enumerate(value)
        found = (_first_unsafe(item, f"{path}[{key!r}]") for key, item in entries)
        return next(filter(None, found), None)
    if type(value) in _PLAIN_LEAVES or torch.is_tensor(value):
        return None
    return f"{path} is a {type(value).__module__}.{type(value).__qualname__}"


def plain(value: Any) -> Any:
    """``value`` with NumPy scalars and arrays turned into Python numbers and tensors."""

    def leaf(item: Any) -> Any:
        if isinstance(item, np.generic):  # before the numbers: np.float64 is a float subclass
            return item.item()
        if isinstance(item, np.ndarray):
            return torch.from_numpy(np.ascontiguousarray(item))
        return item

    return rebuild(value, leaf)


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
        staged = background.snapshot(converted, reuse=True)  # the previous write has ended
        where = os.path.abspath(target)  # the place named now, whatever chdir comes meanwhile
        background.background.start(functools.partial(write_file, staged, where), target)

    if not wait:
        background.background.started = True  # on every process: a load now waits for it everywhere
    failed = f"Rank 0 could not write the checkpoint {target!r}; see its error."
    write = functools.partial(write_file, state, target) if wait else start
    distributed.on_main(write, functools.partial(CheckpointError, failed))
    return target


def save_sharded(
    path: str | os.PathLike,
    state: dict[str, Any],
    network: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    wait: bool = True,
) -> str:
    """Write the sharded checkpoint ``path`` (a directory); returns it.

    Every process writes its tensors of ``network`` and ``optimizer`` there
    (:func:`hapi.checkpoint.save_shards`, a collective); once all are written,
    the main process writes the manifest (``state``, the optimizer's
    non-tensor parts and the shards' name). With ``wait=False`` the tensors
    are copied to CPU memory and the rest runs in the background (see
    :func:`save_state`): ``state`` is copied now, containers and tensors
    alike, so the manifest holds the moment of the call, not what training
    has made of its objects by the time the shards are on disk. A failure
    removes what it wrote of the new shards (they hold disk space) and the
    directories it created, and says why in words.
    """
    from hapi.checkpoint import dcp_io  # torch.distributed.checkpoint: imported on first use

    created = _missing_directories(os.path.join(os.fspath(path), MANIFEST))
    given = files.refuse_link(check_path(path, directory=True), _SHARDED)
    directory = os.path.abspath(given)  # the place named now, whatever chdir comes meanwhile
    background.wait_for_writes()
    # Every process must name the same directory: rank 0's random name is everyone's.
    name = "shards-" + distributed.broadcast_bytes(secrets.token_hex(8).encode()).decode()
    manifest = os.path.join(directory, MANIFEST)
    converted = plain(state)
    refuse_unsafe(converted, manifest)
    if not wait:
        converted = background.snapshot(converted)

    def write_manifest(optimizer_part: dict[str, Any] | None) -> None:
        write_file({**converted, "optimizer_shards": optimizer_part, "shards": name}, manifest)
        files.remove_shards(directory, lambda other: other != name)

    def cleaned(run: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return run(*args, **kwargs)
        except BaseException as error:  # torch's CheckpointException is no Exception
            # Each process removes what is left of its own new shards.
            files.remove_shards(directory, lambda other: other == name)
            for made in created:
                files.remove_empty_directory(made)
            if isinstance(error, (CheckpointError, KeyboardInterrupt, SystemExit)):
                raise
            raise write_failed(manifest, error) from error

    shards = os.path.join(directory, name)
    complete = cleaned(
        dcp_io.save_shards, shards, network, optimizer, then_on_main=write_manifest, wait=wait
    )
    if wait:
        background.agree(functools.partial(cleaned, complete), manifest)
    else:
        background.background.started = True  # on every process (see wait_if_saving)
        background.background.start(functools.partial(cleaned, complete), manifest)
    return given


def shards_directory(file: str, state: dict[str, Any]) -> str:
    """Where the shards of the sharded checkpoint whose manifest is ``file`` lie.

    Raises:
        UnsafeNameError: (a CheckpointError) the manifest names anything but
            a shards directory inside the checkpoint's own directory (an
            absolute path, ``..``, a separator, a link leading elsewhere),
            naming the value; the checkpoint's directory or manifest is a
            symbolic link.
    """
    directory = files.refuse_link(os.path.dirname(files.refuse_link(file, _SHARDED)), _SHARDED)
    entry = f"The manifest {file!r} entry 'shards'"
    # follow_links=False: the shards directory is read and deleted, never replaced.
    return files.child(directory, state.get("shards"), entry, files.SHARDS_NAME, False)


def _candidates(path: str | os.PathLike) -> list[str]:
    """The files a checkpoint named ``path`` may be: ``path.pt``, ``path``, a sharded one's manifest."""
    given = os.fspath(path)
    if given.endswith((".pt", ".pth")):
        return [given]
    return [given + SUFFIX, given, os.path.join(given, MANIFEST)]


def _existing_files(path: str | os.PathLike) -> list[str]:
    return [c for c in _candidates(path) if os.path.islink(c) or os.path.isfile(c)]


def load_state(path: str | os.PathLike) -> tuple[str, dict[str, Any]]:
    """Read a checkpoint safely; returns ``(file, state)`` with tensors on CPU.

    After a background save (every process made it) this is a collective:
    every process waits until the file is on disk, not only the one writing
    it, which alone would read the new file while the others read the old.
    Otherwise it may run on one process alone. A link the user passes, or
    made, is the user's choice: it is followed.

    Raises:
        FileNotFoundError: no such checkpoint (lists the paths tried).
        CheckpointError: the file is truncated or corrupt, carries code, or
            is not a checkpoint at all.
    """
    background.wait_if_saving()  # a background save of it, on whichever process writes it
    found = _existing_files(path)
    if not found:
        directory = os.path.dirname(os.path.abspath(path))
        listed = glob.glob("*.pt*", root_dir=directory)  # none for a missing directory
        nearby = sorted(name for name in listed if name.endswith((".pt", ".pth")))
        raise FileNotFoundError(
            f"No checkpoint found at {os.fspath(path)!r} (tried "
            f"{', '.join(map(repr, _candidates(path)))})."
            f"{f' Checkpoints in {directory}: {nearby}.' if nearby else ''} Pass the path you "
            "gave to Model.save(), or a file written by ModelCheckpoint (<save_dir>/<epoch>, "
            "<save_dir>/best, <save_dir>/final)."
        )
    with open(found[0], "rb") as handle:
        return found[0], _parse(handle, found[0])


def load_freshest_state(path: str | os.PathLike) -> tuple[str, dict[str, Any]]:
    """The copy of ``path`` furthest into training among all machines, on every process.

    A collective. Only rank 0 writes checkpoints, and when torchrun restarts a
    job the ranks may land on other machines: without a shared file system
    the latest backup may then lie on any machine, and an older one on
    another. One process per machine (local rank 0) reads its copy; the copy
    with the most optimizer steps (then epochs, then batches) is sent to
    every process, the lowest rank's on a tie, and each parses it the same
    safe way. It reads what torch-hapi wrote in its own directories: a
    symbolic link there is refused, never followed.

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
        for found in _existing_files(path):
            # O_NOFOLLOW: a link is refused, also one planted after the look.
            with os.fdopen(files.open_nofollow(found, os.O_RDONLY), "rb") as handle:
                payload = handle.read()
            state = _parse(io.BytesIO(payload), found)
            progress = tuple(state.get(key, 0) for key in ("step", "epoch", "epoch_step"))
            copies.append((progress, payload, state))
        # None: another machine may have one.
        return max(copies, key=lambda copy: copy[0]) if copies else None

    def failed(source: int) -> CheckpointError:
        return CheckpointError(f"Rank {source} could not read its copy of {file!r}; see its error.")

    freshest = distributed.broadcast_freshest(read, failed)

    if freshest is None:
        raise FileNotFoundError(f"No process found a checkpoint at {file!r} on its machine.")
    payload, state = freshest
    state = state if state is not None else _parse(io.BytesIO(payload), file)
    return (os.path.join(os.fspath(path), MANIFEST) if "shards" in state else file), state


def _parse(source: IO[bytes], file: str) -> dict[str, Any]:
    """``torch.load(weights_only=True)`` of ``source`` (the file, or its bytes), its errors explained.

    A corrupt file also fails inside the weights-only unpickler ("Unsupported
    operand ..."); only a refused ``GLOBAL`` with a well-formed dotted name
    (``posix.system``, ``mymodule.MyClass``) means the file asks to import code.
    """
    try:
        state = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 -- a damaged file can fail anywhere in torch's reader
        said = f"{error}\n{error.__context__ or ''}"
        if isinstance(error, pickle.UnpicklingError) and _GLOBAL.search(said):
            raise CheckpointError(
                f"Checkpoint {file!r} holds Python objects that may carry code, so torch-hapi "
                "refuses to load it: files are read with torch.load(weights_only=True) and never "
                "execute code. If you trust it, load it with torch.load(path, weights_only=False)"
                f" into model.network.load_state_dict(). Details: {_detail(error)}"
            ) from error
        raise CheckpointError(
            f"Checkpoint {file!r} ({os.path.getsize(file)} bytes) is truncated or corrupt and "
            f"cannot be read ({type(error).__name__}: {_detail(error)}): it was cut off while "
            "copied or written. Use an earlier checkpoint, or save it again."
        ) from error
    if isinstance(state, dict) and state.get("format") == FORMAT:
        return state
    if isinstance(state, dict) and all(
        torch.is_tensor(v) or str(k).endswith("_extra_state") for k, v in state.items()
    ):  # a plain state_dict (save(training=False) writes one; {} for a parameterless network)
        return {"format": FORMAT, "version": VERSION, "network": state}
    keys = f" with keys {sorted(state)[:8]}" if isinstance(state, dict) else ""
    raise CheckpointError(
        f"{file!r} is not a torch-hapi checkpoint nor a state_dict (found "
        f"{type(state).__name__}{keys}). Save checkpoints with Model.save(path), or "
        "torch.save(network.state_dict(), path)."
    )
