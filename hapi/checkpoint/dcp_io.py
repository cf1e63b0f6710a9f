"""A sharded checkpoint's tensors through ``torch.distributed.checkpoint`` (DCP): every process writes its own.

What DCP stores is tensors only -- the network's state and the tensors of
the optimizer state, each process writing the shards it holds (replicated
tensors once) -- in one directory per save. Everything else (optimizer
hyper-parameters, non-tensor optimizer values, counters, RNG states) goes to
the checkpoint's manifest, written by :func:`hapi.checkpoint.save_sharded` like any file.
DCP reshards on reading: a directory saved by 2 FSDP processes loads on 1, 3,
or under DDP, optimizer state included, since every state is named by
parameter (fully qualified names), not by position or rank.

Reading runs no code from the files. A shards directory holds a pickled
``.metadata`` file and ``__<rank>_<n>.distcp`` data files. torch's ``FileSystemReader`` reads
``.metadata`` with a plain ``pickle.load``, so a planted file can run any
code. A second hole is further in: an entry the metadata declares as
``BytesStorageMetadata`` is read by ``DefaultLoadPlanner.load_bytes`` with
``torch.load(weights_only=False)``. And each stored item may name stream
transforms (``transform_descriptors``) that torch looks up and applies.

:class:`SafeFileSystemReader` closes all three: ``.metadata`` is unpickled
with an explicit allowlist of the classes DCP itself writes, and the result is
checked to hold tensor entries only, with no transforms, in files that lie
inside the checkpoint directory. torch-hapi saves only tensors through DCP,
so a checkpoint it wrote always passes. Tensor data is then read by torch
as usual, with ``torch.load(weights_only=True)``.

No file is opened through a symbolic link (:class:`NoFollowFileSystem`, which
the writer uses too): a shards directory, a file in it, or the checkpoint
directory holding them that is a link is refused, whenever it was planted.

Note: ``torch.distributed.checkpoint.load`` (torch 2.13) catches any error
from ``read_metadata``, falls back to the per-rank ``__<rank>.metadata`` and
then raises an ``AssertionError`` that quotes both errors. A caller that wants
the :class:`~hapi.checkpoint.CheckpointError` itself calls
``read_metadata()`` first.

torch reports a failure to read or write the files (a truncated shard, a full
disk, a link refused) as its ``CheckpointException``, a ``BaseException`` that
``except Exception`` misses: a failed read becomes a
:class:`~hapi.checkpoint.CheckpointError` naming the directory and each
process's cause; a failed write is raised as it is, for
:func:`hapi.checkpoint.save_sharded` to clean up after and say in words.

Who writes the manifest is DCP's own choice: its coordinator (the process
that also writes ``.metadata``), which :class:`_Writer` records; this module
never tests a rank. Background saves run their collectives on a process group
of their own (:func:`hapi.distributed.background_group`).
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import pickle
import warnings
from typing import IO, Any, Callable, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint import state_dict as dcp_state
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from hapi import distributed
from hapi.checkpoint import files
from hapi.checkpoint.background import snapshot
from hapi.checkpoint.errors import CheckpointError

_DCP = "torch.distributed.checkpoint.metadata"
# What to do about a sharded checkpoint that cannot be read.
_AGAIN = "use an earlier checkpoint, or save it again with model.save(path, sharded=True)."

# Every global a .metadata written by torch 2.13's dcp.save holds (found by
# unpickling real files -- plain tensors of many dtypes, 0-d to 4-d, and an
# FSDP2 model + Adam state saved from 2 processes -- with a find_class that
# records its calls). Each is a plain data class, a tuple subclass, an enum or
# a constant: creating one runs no code beyond storing its fields.
# BytesStorageMetadata is harmless (an empty data class) and found in real files;
# allowed here so the refusal below can name the entries that hold it.
_METADATA_CLASSES = ("Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata")
_METADATA_CLASSES += ("TensorProperties", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
_METADATA_CLASSES += ("BytesStorageMetadata",)
_ALLOWED = {(_DCP, name): getattr(dcp_metadata, name) for name in _METADATA_CLASSES}
_ALLOWED[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
_ALLOWED[("torch", "Size")] = torch.Size
# torch.layout pickles as a call _get_layout("torch.strided"): a dict lookup
# among torch's own layout objects (KeyError for any other name). It is the
# only function allowed.
_ALLOWED[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
# Constants (never called): every dtype; layouts and memory formats by name too.
_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)
_ALLOWED.update({("torch", n): v for n, v in vars(torch).items() if isinstance(v, _CONSTANTS)})

# StorageMeta.checkpoint_id is the save path, often a pathlib path: pickled as
# pathlib.PosixPath (pathlib._local.PosixPath by Python 3.13, WindowsPath on
# Windows). torch's load path never reads it, so it becomes a pure path, which
# never touches the file system and builds on any OS and Python version.
for _pure in (pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.PurePath):
    for _module in ("pathlib", "pathlib._local"):  # PosixPath and PurePosixPath alike
        _ALLOWED[(_module, _pure.__name__)] = _ALLOWED[(_module, _pure.__name__[4:])] = _pure


class _Unsafe(Exception):
    """Raised inside the unpickler; turned into a CheckpointError that names the directory."""


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that imports nothing outside :data:`_ALLOWED`."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise _Unsafe(f"its .metadata asks to import {module}.{name}") from None


class NoFollowFileSystem(FileSystem):
    """torch's local file system for DCP, opening no file through a symbolic link.

    A file is opened relative to its directory, and that one relative to the
    checkpoint directory, each with ``O_NOFOLLOW``
    (:func:`hapi.checkpoint.files.open_nofollow`): a link planted as a shard, as the
    shards directory or as the checkpoint directory is refused, naming it.
    """

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[IO[bytes]]:
        flags = {"rb": os.O_RDONLY, "wb": os.O_WRONLY | os.O_CREAT | os.O_TRUNC}[mode]
        with os.fdopen(files.open_nofollow(path, flags, levels=3), mode) as stream:
            yield stream


class SafeFileSystemReader(dcp.FileSystemReader):
    """``FileSystemReader`` that refuses checkpoints able to run code, instead of running it.

    Use it as ``dcp.load(state, storage_reader=SafeFileSystemReader(path))``.
    """

    def __init__(self, path: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self.fs = NoFollowFileSystem()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Unpickle ``.metadata`` (or ``__<rank>.metadata``) through the allowlist and check it.

        Raises:
            hapi.checkpoint.CheckpointError: the metadata is missing, imports anything
                DCP does not write, declares non-tensor entries or stream
                transforms, points outside the directory, is damaged, or is
                reached through a symbolic link.
        """
        path = os.fspath(self._get_metadata_path(kwargs.get("rank")))
        directory = os.fspath(self.path)
        try:
            with self.fs.create_stream(path, "rb") as metadata_file:  # refuses a link, naming it
                raw = metadata_file.read()
        except FileNotFoundError:
            raise CheckpointError(
                f"Sharded checkpoint {directory!r} is incomplete: its metadata file {path!r} is "
                f"missing (a save cut short, or a copy that left out this dot-file): {_AGAIN}"
            ) from None
        try:
            metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
            _check(metadata)
        except _Unsafe as error:
            raise CheckpointError(
                f"Sharded checkpoint {directory!r} was not loaded: {error}. torch-hapi refuses "
                f"to run code from checkpoint files, and never writes this: {_AGAIN}"
            ) from None
        except Exception as error:  # noqa: BLE001 -- nothing allowed runs code: any failure is a bad file
            raise CheckpointError(
                f"Sharded checkpoint {directory!r} is damaged: its metadata file {path!r} "
                f"({len(raw)} bytes) cannot be read ({type(error).__name__}: {error}); {_AGAIN}"
            ) from error
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _check(metadata: Any) -> None:
    """Tensor entries only; stored items without transforms, in files of this directory.

    Raises:
        _Unsafe: naming what the metadata holds instead.
    """
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise _Unsafe(f"its .metadata holds a {type(metadata).__name__}, not DCP Metadata")
    entries = metadata.state_dict_metadata.items()
    others = [key for key, value in entries if not isinstance(value, TensorStorageMetadata)]
    if others:
        raise _Unsafe(
            f"its .metadata declares non-tensor entries {others[:5]}, which torch would read "
            "with torch.load(weights_only=False); torch-hapi saves tensors only"
        )
    storage = metadata.storage_data
    for item in storage.values() if isinstance(storage, dict) else [storage]:
        if not isinstance(item, _StorageInfo):
            raise _Unsafe(f"its .metadata stores an item as a {type(item).__name__}")
        if item.transform_descriptors:  # a field of every torch 2.13 _StorageInfo (None)
            raise _Unsafe(f"its .metadata asks for stream transforms {item.transform_descriptors}")
        if not files.is_plain_name(item.relative_path):
            raise _Unsafe(
                f"its .metadata points at the data file {item.relative_path!r}, "
                "outside the checkpoint directory"
            )


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns on one process that it assumes one process; that is what one process means here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)

        yield


def _load(directory: str, payload: dict[str, Any]) -> dict[str, Any]:
    """``payload``'s tensors read from ``directory`` in place (resharded as they are now), safely.

    DCP's ``CheckpointException`` becomes a :class:`CheckpointError` naming ``directory``
    and each process's cause (a failed write is said in words by
    :func:`hapi.checkpoint.save_sharded`).
    """
    try:
        with _quiet():
            dcp.load(payload, storage_reader=SafeFileSystemReader(directory))
    except dcp.CheckpointException as error:
        causes = "; ".join(
            f"process {rank}: {type(cause).__name__}: {cause}"
            for rank, (cause, _) in sorted(error.failures.items())
        )
        raise CheckpointError(
            f"Could not read the shards directory {directory!r} of a sharded checkpoint "
            f"({causes}): a shard was cut off or changed after it was written; {_AGAIN}"
        ) from None
    return payload


def _model_tensors(network: nn.Module) -> dict[str, torch.Tensor]:
    return _split(dcp_state.get_model_state_dict(network))[0]


def _split(values: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:

    tensors = {k: v for k, v in values.items() if torch.is_tensor(v)}
    return tensors, {k: v for k, v in values.items() if k not in tensors}


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer, remembering whether DCP made this process its coordinator."""

    is_coordinator = False

    def __init__(self, path: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self.fs = NoFollowFileSystem()

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)


def save_shards(
    directory: str,
    network: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    then_on_main: Callable[[dict[str, Any] | None], None],
    wait: bool = True,
) -> Callable[[], None]:
    """Write the network's and optimizer's tensors to ``directory``; a collective.

    ``then_on_main(rest)`` runs on rank 0 once every process's shards are
    written, with what the manifest must keep for :func:`load_shards` (the
    optimizer's groups and its non-tensor state values; ``None`` without an
    optimizer), on the process DCP coordinates from, which wrote
    ``.metadata`` last. With ``wait=False`` the tensors are copied to CPU
    memory (DCP's ``async_save``), the rest is copied too (the moment of the
    call), and the writing goes on in a background thread.
    Returns what completes the save: called now with ``wait``, else in the
    caller's background thread (it waits for DCP's future).
    """
    payload: dict[str, Any] = {"network": _model_tensors(network)}
    optimizer_rest = None
    if optimizer is not None:
        # Its groups with parameters named, as torch's state-dict API names them.
        names = {id(p): name for name, p in network.named_parameters()}
        groups = [
            {**g, "params": [names[id(p)] for p in g["params"]]} for g in optimizer.param_groups
        ]
        plain_values: dict[str, Any] = {}
        if optimizer.state:  # torch's API would otherwise create the state with a dry step
            by_name = dcp_state.get_optimizer_state_dict(network, optimizer)
            groups = by_name["param_groups"]
            tensors = {}
            for name, values in by_name["state"].items():
                tensors[name], plain_values[name] = _split(values)
            payload["optimizer"] = tensors
        optimizer_rest = {"param_groups": groups, "plain_values": plain_values}
        optimizer_rest["has_tensors"] = "optimizer" in payload

    writer = _Writer(directory)
    if not wait:
        optimizer_rest = snapshot(optimizer_rest)
    with _quiet():
        if wait:
            dcp.save(payload, storage_writer=writer)
        else:
            future = dcp.async_save(
                payload, storage_writer=writer, process_group=distributed.background_group()
            )

    def complete() -> None:
        if not wait:
            future.result()  # every process's shards written, the metadata too
        if writer.is_coordinator:
            then_on_main(optimizer_rest)

    return complete


def saved_shapes(directory: str) -> dict[str, torch.Size]:
    """The network entries of a sharded checkpoint and their full shapes, read safely."""
    entries = SafeFileSystemReader(directory).read_metadata().state_dict_metadata
    return {key[8:]: entry.size for key, entry in entries.items() if key.startswith("network.")}


def load_shards(directory: str, network: nn.Module, keys: set[str]) -> None:
    """The network's entries named in ``keys`` from ``directory``, resharded as the network is now."""
    template = {k: v for k, v in _model_tensors(network).items() if k in keys}
    loaded = _load(directory, {"network": template})["network"]
    options = dcp_state.StateDictOptions(strict=False)
    dcp_state.set_model_state_dict(network, loaded, options=options)


def load_optimizer_shards(
    directory: str, network: nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any]
) -> None:
    """The optimizer state :func:`save_shards` wrote (``saved``: the manifest's part), resharded."""
    state = {name: dict(values) for name, values in saved["plain_values"].items()}
    if saved["has_tensors"]:  # the optimizer's own state, created now, to read into
        template = dcp_state.get_optimizer_state_dict(network, optimizer)["state"]
        tensors = {name: _split(values)[0] for name, values in template.items()}
        for name, values in _load(directory, {"optimizer": tensors})["optimizer"].items():
            state.setdefault(name, {}).update(values)
    groups = saved["param_groups"]
    dcp_state.set_optimizer_state_dict(network, optimizer, {"state": state, "param_groups": groups})
