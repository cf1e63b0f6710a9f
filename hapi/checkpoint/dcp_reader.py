"""Read sharded (torch.distributed.checkpoint) checkpoints without running code from them.

A sharded checkpoint is a directory with a pickled ``.metadata`` file and
``__<rank>_<n>.distcp`` data files. torch's ``FileSystemReader`` reads
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
the writer of :mod:`hapi.checkpoint.dcp_io` uses too): a shards directory, a
file in it, or the checkpoint directory holding them that is a link is
refused, whenever it was planted.

Note: ``torch.distributed.checkpoint.load`` (torch 2.13) catches any error
from ``read_metadata``, falls back to the per-rank ``__<rank>.metadata`` and
then raises an ``AssertionError`` that quotes both errors. A caller that wants
the :class:`~hapi.checkpoint.CheckpointError` itself calls
``read_metadata()`` first.
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import pickle
from typing import IO, Any, Iterator, NoReturn

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from hapi.checkpoint import files
from hapi.checkpoint.errors import CheckpointError

_DCP = "torch.distributed.checkpoint.metadata"

# Every global a .metadata written by torch 2.13's dcp.save holds (found by
# unpickling real files -- plain tensors of many dtypes, 0-d to 4-d, and an
# FSDP2 model + Adam state saved from 2 processes -- with a find_class that
# records its calls). Each is a plain data class, a tuple subclass, an enum or
# a constant: creating one runs no code beyond storing its fields.
_ALLOWED: dict[tuple[str, str], Any] = {
    (_DCP, name): getattr(dcp_metadata, name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
        # Harmless (an empty data class) and found in real files; allowed here so the
        # refusal below can name the entries that hold it.
        "BytesStorageMetadata",
    )
}
_ALLOWED[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
_ALLOWED[("torch", "Size")] = torch.Size
# torch.layout pickles as a call _get_layout("torch.strided"): a dict lookup
# among torch's own layout objects (KeyError for any other name). It is the
# only function allowed.
_ALLOWED[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
# Constants (never called): every dtype; layouts and memory formats by name too.
_ALLOWED.update(
    {
        ("torch", name): value
        for name, value in vars(torch).items()
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format))
    }
)
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


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` that refuses checkpoints able to run code, instead of running it.

    Use it as ``dcp.load(state, storage_reader=SafeFileSystemReader(path))``.
    """

    def __init__(self, path: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self.fs = NoFollowFileSystem()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Unpickle ``.metadata`` (or ``__<rank>.metadata``) through the allowlist and check it.

        Raises:
            hapi.checkpoint.CheckpointError: the metadata imports anything DCP
                does not write, declares non-tensor entries or stream
                transforms, points outside the directory, is damaged, or is
                reached through a symbolic link.
        """
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as metadata_file:
                raw = metadata_file.read()
        except files.UnsafeNameError as error:
            raise CheckpointError(f"Sharded checkpoint {os.fspath(self.path)!r}: {error}") from None
        try:
            metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
        except _Unsafe as error:
            self._refuse(str(error))
        except Exception as error:  # noqa: BLE001 -- nothing allowed runs code: any failure is a bad file
            raise CheckpointError(
                f"Sharded checkpoint {os.fspath(self.path)!r} is damaged: its metadata file "
                f"{os.fspath(path)!r} ({len(raw)} bytes) cannot be read ({type(error).__name__}: "
                f"{error}). It was probably cut off while being copied or written. Use an earlier "
                "checkpoint, or save it again with model.save(path, sharded=True)."
            ) from error
        self._check(metadata)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _check(self, metadata: Any) -> None:
        """Tensor entries only; stored items without transforms, in files of this directory."""
        if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
            self._refuse(f"its .metadata holds a {type(metadata).__name__}, not DCP Metadata")
        others = [
            key
            for key, value in metadata.state_dict_metadata.items()
            if not isinstance(value, TensorStorageMetadata)
        ]
        if others:
            self._refuse(
                f"its .metadata declares non-tensor entries {others[:5]}, which torch "
                "would read with torch.load(weights_only=False); torch-hapi saves "
                "tensors only"
            )
        storage = metadata.storage_data
        if not isinstance(storage, dict):
            self._refuse(
                f"its .metadata has storage_data of type {type(storage).__name__}, not a dict"
            )
        for item in storage.values():
            if not isinstance(item, _StorageInfo):
                self._refuse(
                    f"its .metadata stores an item as a {type(item).__name__}, not _StorageInfo"
                )
            if getattr(item, "transform_descriptors", None):
                self._refuse(
                    f"its .metadata asks for stream transforms {list(item.transform_descriptors)}"
                )
            if not files.is_plain_name(item.relative_path):
                self._refuse(
                    f"its .metadata points at the data file {item.relative_path!r}, "
                    "outside the checkpoint directory"
                )

    def _refuse(self, found: str) -> NoReturn:
        raise CheckpointError(
            f"Sharded checkpoint {os.fspath(self.path)!r} was not loaded: {found}. torch-hapi refuses "
            "to run code from checkpoint files, and a checkpoint it wrote never holds this. If you "
            "made this checkpoint, save it again with model.save(path, sharded=True) from a trusted run."
        )
