"""Checkpoint files: one file per save, written atomically, read safely.

A checkpoint is a plain dict of tensors and Python scalars, saved with
``torch.save`` and read back with ``torch.load(weights_only=True)``: a file
that carries code (pickled classes or functions) is refused, never executed.
Writes go through :func:`callbacks.files.atomic_write`, so a crash while
saving leaves the previous file intact.

Layout of a training checkpoint (``FORMAT``)::

    {"format": "torch-hapi", "version": 1,
     "network": state_dict, "optimizer": state_dict | None,
     "scaler": state_dict | None, "epoch": int, "step": int,
     "rng": {"torch": ByteTensor, "cuda": [ByteTensor], "numpy": {...},
             "python": [int, ...]}}

A bare ``state_dict`` saved by plain PyTorch (``torch.save(net.state_dict())``)
loads too, as network weights.
"""

from __future__ import annotations

import collections
import functools
import io
import os
import pickle
import random
import re
import secrets
import shutil
import threading
import warnings
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from callbacks.files import atomic_write
from hapi import distributed

FORMAT = "torch-hapi"
VERSION = 1
SUFFIX = ".pt"
MANIFEST = "checkpoint.pt"  # in the directory of a sharded checkpoint

# The global torch's weights-only unpickler refused, e.g. "GLOBAL posix.system".
_GLOBAL = re.compile(r"GLOBAL [A-Za-z_]\w*(\.[A-Za-z_]\w*)+(\s|$)")


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, damaged, unsafe or does not fit the model."""


def resolve_path(path: str | os.PathLike) -> str:
    """The file a save of ``path`` writes: ``path`` + ``.pt`` unless it ends so.

    Mirrors Paddle, where ``model.save("ckpt/final")`` writes
    ``ckpt/final.pdparams``: users name checkpoints without a suffix.
    """
    path = os.fspath(path)
    return path if path.endswith((".pt", ".pth")) else path + SUFFIX


def save_sharded(path: str | os.PathLike, state: dict[str, Any],
                 write_shards: Callable[..., Callable[[], None]], wait: bool = True) -> str:
    """A sharded checkpoint: a directory ``path`` with a manifest and a directory of shards.

    ``write_shards(directory, then_on_main=..., wait=...)`` is the collective
    that writes every process's tensors there (:func:`hapi.distributed.save_shards`)
    and returns what completes it. Each save writes a new shards directory;
    the manifest (``state``, the optimizer's non-tensor parts and the shards'
    name), replaced atomically once every shard is written, then names it,
    and older ones are removed. A crash at any point leaves the previous
    checkpoint loadable. With ``wait=False`` the tensors are copied to CPU
    memory and the rest runs in the background (see :func:`save_state`).
    Returns the directory.
    """
    wait_for_writes()
    directory = os.fspath(path)
    # Every process must name the same directory: rank 0's random name is everyone's.
    name = "shards-" + distributed.broadcast_bytes(secrets.token_hex(8).encode()).decode()
    manifest = os.path.join(directory, MANIFEST)
    _refuse_unsafe(_plain(state), manifest)

    def write_manifest(optimizer_part: dict[str, Any] | None) -> None:
        write_file({**state, "optimizer_shards": optimizer_part, "shards": name}, manifest)
        for entry in os.listdir(directory):
            if entry.startswith("shards-") and entry != name:
                shutil.rmtree(os.path.join(directory, entry), ignore_errors=True)

    complete = write_shards(os.path.join(directory, name), then_on_main=write_manifest, wait=wait)
    if wait:
        _agree(complete, manifest)
    else:
        _background.start(complete, manifest)
    return directory


def _agree(action: Callable[[], None], target: str) -> None:
    """``action()`` on every process; a failure on any is raised on all."""
    failure = None
    try:
        action()
    except Exception as error:  # noqa: BLE001 -- every process must learn of it
        failure = error
    if distributed.any_true(failure is not None):
        if failure is not None:
            raise failure
        raise CheckpointError(f"Another process failed to write the checkpoint {target!r}; see its error.")


def shards_directory(file: str, state: dict[str, Any]) -> str:
    """Where the shards of the sharded checkpoint whose manifest is ``file`` lie."""
    return os.path.join(os.path.dirname(file), state["shards"])


def save_state(path: str | os.PathLike, state: dict[str, Any], wait: bool = True) -> str:
    """Write ``state`` atomically on the main process; every process waits.

    With ``wait=False`` the main process copies the state's tensors (to CPU
    memory) and returns; a background thread writes the file. The previous
    background write is waited for first, here and in :func:`wait_for_writes`,
    and its failure raised then, on every process. Returns the file written.

    Raises:
        CheckpointError: an entry is neither a tensor nor a plain value
            (at once, also with ``wait=False``), or writing failed.
    """
    wait_for_writes()
    target = resolve_path(path)

    def write() -> None:
        write_file(state, target)

    def start() -> None:
        plain = _plain(state)
        _refuse_unsafe(plain, target)  # now, not in the background
        # Backups rewrite one file again and again: its previous blocks are reused.
        staged = _staging.copy(plain)  # the previous write has ended (save_state waited for it)
        _background.start(functools.partial(write_file, staged, target, reuse_previous=True), target)

    distributed.on_main(write if wait else start, lambda: CheckpointError(
        f"Rank 0 could not write the checkpoint {target!r}; see its error."))
    return target


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
            raise CheckpointError(f"Writing the checkpoint {self._target!r} in the background failed "
                                  f"({type(error).__name__}: {error}); the previous file there is "
                                  "unchanged.") from error


_background = _BackgroundWrite()


def wait_for_writes() -> None:
    """Every process waits until its background write (if any) is on disk.

    A collective. Raises on every process when a write failed on any.
    """
    _agree(_background.join, "written in the background")


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
            if (buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype
                    or buffer.layout != value.layout or not value.is_contiguous()):
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
        with atomic_write(target, "wb", verify=_loads_safely, reuse_previous=reuse_previous) as handle:
            torch.save(plain, handle)  # an object pickle cannot even write fails here
    except (pickle.PicklingError, pickle.UnpicklingError, AttributeError, TypeError) as error:
        offender = _first_unsafe(plain, "checkpoint")
        if offender is None and not isinstance(error, pickle.UnpicklingError):
            raise
        raise _unsafe_entry(target, f"{offender[0]} is a {offender[1]}" if offender
                            else f"an entry: {_detail(error)}") from error


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


_PLAIN_LEAVES = (torch.Tensor, str, bytes, int, float, complex, bool, type(None), torch.dtype,
                 torch.device, torch.Size)


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
        return None if type(value) in (dict, collections.OrderedDict) else (path, type(value).__name__)
    if type(value) in (list, tuple):
        for index, item in enumerate(value):
            found = _first_unsafe(item, f"{path}[{index}]")
            if found:
                return found
        return None
    if type(value) in _PLAIN_LEAVES or isinstance(value, torch.Tensor):
        return None
    return path, f"{type(value).__module__}.{type(value).__qualname__}"


def _candidates(path: str | os.PathLike) -> list[str]:
    """The files a checkpoint named ``path`` may be: ``path.pt``, ``path``, a sharded one's manifest."""
    given = os.fspath(path)
    if given.endswith((".pt", ".pth")):
        return [given]
    return [given + SUFFIX, given, os.path.join(given, MANIFEST)]


def _existing_files(path: str | os.PathLike) -> list[str]:
    return [candidate for candidate in _candidates(path) if os.path.isfile(candidate)]


def _existing_file(path: str | os.PathLike) -> str:
    given = os.fspath(path)
    candidates = _candidates(path)
    found = _existing_files(path)
    if found:
        return found[0]
    directory = os.path.dirname(os.path.abspath(given)) or "."
    nearby = sorted(name for name in os.listdir(directory) if name.endswith((".pt", ".pth"))) \
        if os.path.isdir(directory) else []
    hint = f" Checkpoints in {directory}: {nearby}." if nearby else ""
    raise FileNotFoundError(
        f"No checkpoint found at {given!r} (tried {', '.join(repr(c) for c in candidates)})."
        f"{hint} Pass the path you gave to Model.save(), or a file written by ModelCheckpoint "
        "(<save_dir>/<epoch>, <save_dir>/best, <save_dir>/final)."
    )


def load_state(path: str | os.PathLike) -> tuple[str, dict[str, Any]]:
    """Read a checkpoint safely; returns ``(file, state)`` with tensors on CPU.

    Raises:
        FileNotFoundError: no such checkpoint (lists the paths tried).
        CheckpointError: the file is truncated or corrupt, carries code, or
            is not a checkpoint at all.
    """
    _background.join()  # this process's own background write of it, if any, first
    file = _existing_file(path)
    return file, _parse(file, file)


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
    wait_for_writes()
    file = resolve_path(path)

    def read() -> tuple[tuple, bytes, dict[str, Any]] | None:
        # Either kind (a file, or a sharded checkpoint's manifest) may be here, both when
        # a restart changed the strategy: the one further into training wins.
        copies = []
        for found in _existing_files(path):
            with open(found, "rb") as handle:
                payload = handle.read()
            state = _parse(io.BytesIO(payload), found)
            copies.append((tuple(state.get(key, 0) for key in ("step", "epoch", "epoch_step")), payload, state))
        return max(copies, key=lambda copy: copy[0]) if copies else None  # None: another machine may have one

    freshest = distributed.broadcast_freshest(read, lambda source: CheckpointError(
        f"Rank {source} could not read its copy of {file!r}; see its error."))
    if freshest is None:
        raise FileNotFoundError(f"No process found a checkpoint at {file!r} on its machine.")
    payload, state = freshest
    state = state if state is not None else _parse(io.BytesIO(payload), file)
    return (os.path.join(os.fspath(path), MANIFEST) if "shards" in state else file), state


def _parse(source: str | io.BytesIO, file: str) -> dict[str, Any]:
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
            f"model.network.load_state_dict(). Details: {_detail(error)}"
        ) from error
    except PermissionError:
        raise  # names the file; not a damaged checkpoint
    except Exception as error:  # noqa: BLE001 -- a damaged file can fail anywhere in torch's reader
        raise _damaged(file, error) from error
    return _normalise(file, state)


def _detail(error: BaseException) -> str:
    """The unpickler's own message: torch wraps it in a generic ``weights_only`` preamble."""
    inner = error.__context__ if isinstance(error.__context__, pickle.UnpicklingError) else error
    lines = [line.strip() for line in str(inner).splitlines() if line.strip()]
    telling = [line for line in lines if "GLOBAL" in line or "Unsupported" in line]
    return (telling or lines or ["no detail"])[0]


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
        f"({type(error).__name__}: {_detail(error)}). "
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


def match_state_dict(
    network: nn.Module, saved: dict[str, torch.Tensor], file: str, skip_mismatch: bool
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Check ``saved`` against ``network``; returns the loadable part and the skipped keys.

    Raises:
        CheckpointError: unless ``skip_mismatch``, when any key is missing,
            unexpected or of another shape -- the sign of another architecture.
    """
    expected = network.state_dict()
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    reshaped = [
        f"{k}: file {tuple(saved[k].shape)} vs network {tuple(expected[k].shape)}"
        for k in expected
        if k in saved and saved[k].shape != expected[k].shape
    ]
    if (missing or unexpected or reshaped) and not skip_mismatch:
        problems = []
        if reshaped:
            problems.append(f"shape mismatch: {', '.join(reshaped)}")
        if missing:
            problems.append(f"missing in the file: {missing}")
        if unexpected:
            problems.append(f"not in the network: {unexpected}")
        raise CheckpointError(
            f"Checkpoint {file!r} does not fit this network ({type(network).__name__}): "
            f"{'; '.join(problems)}. It was probably saved from another architecture. "
            "Load it into the network it came from, or pass skip_mismatch=True to load "
            "only the tensors whose names and shapes match."
        )
    loadable = {
        k: v for k, v in saved.items() if k in expected and v.shape == expected[k].shape
    }
    skipped = sorted(set(missing) | set(unexpected) | {k for k in saved if k in expected and k not in loadable})
    return loadable, skipped


def rng_state() -> dict[str, Any]:
    """Every random generator's state, in tensors and plain values only."""
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "python": [random.getstate()[0], *random.getstate()[1], random.getstate()[2]],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    saved_np = state["numpy"]
    np.random.set_state((
        "MT19937",
        saved_np["keys"].numpy().astype(np.uint32),
        saved_np["pos"],
        saved_np["has_gauss"],
        saved_np["cached_gaussian"],
    ))
    python = state["python"]
    random.setstate((python[0], tuple(python[1:-1]), python[-1]))


def load_optimizer_state(optimizer: torch.optim.Optimizer, optimizer_state: dict,
                         saved_type: str | None, source: str,
                         load: Callable[[dict], None] | None = None,
                         keep_hyperparameters: bool = False) -> None:
    """Load a saved optimizer state, refusing one from another optimizer class.

    ``load(state)`` puts it in (the strategy's way: sharded under FSDP);
    by default ``optimizer.load_state_dict``. With ``keep_hyperparameters``
    the optimizer's own settings (``lr``, ``betas``, ``weight_decay``, ...:
    what the user passed to ``prepare``) stay, and only the per-parameter
    state (momentum buffers, Adam's moments and step counts) comes from the
    file; a warning names each setting the file had otherwise. torch's
    ``load_state_dict`` would silently take the file's: fine-tuning at 1e-4
    from a checkpoint trained at 1e-3 would train at 1e-3.
    """
    given = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    try:
        if saved_type is not None and saved_type != type(optimizer).__name__:
            raise ValueError(f"it was saved from a {saved_type} optimizer")
        # A state from another optimizer class would load without complaint and
        # fail at the next step; its hyper-parameters give it away.
        groups = optimizer_state.get("param_groups") or [{}]
        lacking = sorted(set(optimizer.defaults) - set(groups[0]))
        if lacking:
            raise ValueError(f"it was saved from another optimizer (its settings lack {lacking})")
        (load or optimizer.load_state_dict)(optimizer_state)
    except (ValueError, KeyError, RuntimeError) as error:
        raise CheckpointError(
            f"The optimizer state in {source} does not fit this model's optimizer "
            f"({type(optimizer).__name__}): {error}. Pass reset_optimizer=True to load only the "
            "network's weights."
        ) from error
    if not keep_hyperparameters:
        return
    differences = []
    for index, (group, settings) in enumerate(zip(optimizer.param_groups, given)):
        for key, value in settings.items():
            if key in group and not _same_setting(group[key], value):
                where = f"group {index} " if len(given) > 1 else ""
                differences.append(f"{where}{key}={group[key]!r} in the file, {value!r} given")
        group.update(settings)
    if differences:
        warnings.warn(
            f"The optimizer state loaded from {source} was saved with other settings than the "
            f"{type(optimizer).__name__} given to prepare(): {'; '.join(differences)}. Training uses "
            "the settings given to prepare(); the per-parameter state (momentum, moments, step "
            "counts) comes from the file. To train with the file's settings, build the optimizer "
            "with them.", stacklevel=3)


def _same_setting(saved: Any, given: Any) -> bool:
    if torch.is_tensor(saved) or torch.is_tensor(given):
        return torch.is_tensor(saved) and torch.is_tensor(given) and torch.equal(saved.cpu(), given.cpu())
    try:
        return bool(saved == given) or (isinstance(saved, (tuple, list)) and list(saved) == list(given))
    except (TypeError, ValueError, RuntimeError):
        return saved is given


def fit_state(data_seed: int, epoch_items: int | None, rng: dict[str, Any], metrics: Any,
              callbacks: Any) -> dict[str, Any]:
    """What resuming a fit needs beyond the model (collective: every process calls it).

    Random streams and running sums differ between processes, so each rank's
    are kept and each resumes its own. ``epoch_items`` is how far the epoch
    went into its global order of samples, which a resume on another number
    of processes continues from.
    """
    return {
        "data_seed": data_seed,
        "epoch_items": epoch_items,
        "per_rank": distributed.gather_objects({"rng": rng, "metrics": metrics.state_dict()}),
        "callbacks": [[type(c).__name__, c.state_dict()] for c in callbacks],
    }


def check_fitting(fitting: bool) -> None:
    if not fitting:
        raise RuntimeError(
            "load(..., resume=True) continues a fit in progress; call it from a callback's "
            "on_train_begin (callbacks.BackupAndRestore does), or load without resume=True."
        )


def check_resumable(file: str, state: dict[str, Any]) -> None:
    if "fit" not in state:
        raise CheckpointError(
            f"{file!r} was not saved to resume a fit (save(..., resumable=True) during fit, as "
            "BackupAndRestore does), so it lacks the data order, RNG and callback states. Load it "
            "without resume=True to start from its weights."
        )


def restore_fit(saved: dict[str, Any], file: str, metrics: Any, callbacks: Any) -> bool:
    """Give each process its random streams and running figures, and each callback its state.

    Returns False when the file was written by another number of processes:
    the per-process parts cannot be matched, and the caller restarts the
    interrupted epoch.
    """
    own = distributed.own(saved["per_rank"])
    if own is not None:
        set_rng_state(own["rng"])
        metrics.load_state_dict(own["metrics"])
    else:
        epoch = ("the rest of the interrupted epoch is split across the processes there are now (each "
                 "remaining sample trained once); random streams and that epoch's running figures start "
                 "afresh, so results differ from an uninterrupted run"
                 if saved.get("epoch_items") is not None else
                 "the data splits differently, so the interrupted epoch restarts from its first batch "
                 "with fresh random streams; results will differ from an uninterrupted run")
        warnings.warn(
            f"Resuming from {file!r}, saved by {len(saved['per_rank'])} processes, on "
            f"{distributed.world_size()}: the weights, optimizer and callbacks are restored, and "
            f"{epoch}.", stacklevel=4)
    callbacks = list(callbacks)
    names = [name for name, _ in saved["callbacks"]]
    if names != [type(c).__name__ for c in callbacks]:
        warnings.warn(
            f"Resuming from {file!r}: its callbacks {names} differ from this fit's "
            f"{[type(c).__name__ for c in callbacks]}; callbacks are matched by class name in "
            "order, and the others start afresh.", stacklevel=4)
    pending = list(saved["callbacks"])
    for callback in callbacks:
        match = next((i for i, (name, _) in enumerate(pending) if name == type(callback).__name__), None)
        if match is not None:
            callback.load_state_dict(pending.pop(match)[1])
    return own is not None
