"""A sharded checkpoint: a directory with a manifest and the shards every process wrote.

Layout (names in ``hapi.checkpoint.files``)::

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

import os
import secrets
from typing import Any, Callable

from hapi import distributed
from hapi.checkpoint import background, files
from hapi.checkpoint.errors import CheckpointError, write_failed
from hapi.checkpoint.files import MANIFEST
from hapi.checkpoint.state import check_path
from hapi.checkpoint.write import missing_directories, plain, refuse_unsafe, write_file

__all__ = ["MANIFEST", "save_sharded", "shards_directory"]


def save_sharded(
    path: str | os.PathLike,
    state: dict[str, Any],
    write_shards: Callable[..., Callable[[], None]],
    wait: bool = True,
) -> str:
    """Write the sharded checkpoint ``path`` (a directory); returns it.

    ``write_shards(directory, then_on_main=..., wait=...)`` is the collective
    that writes every process's tensors there (:func:`hapi.checkpoint.save_shards`)
    and returns what completes it; ``then_on_main(optimizer_part)`` writes the
    manifest (``state``, the optimizer's non-tensor parts and the shards'
    name). With ``wait=False`` the tensors are copied to CPU memory and the
    rest runs in the background (see :func:`hapi.checkpoint.save_state`):
    ``state`` is copied now, containers and tensors alike, so the manifest
    holds the moment of the call, not what training has made of its objects
    by the time the shards are on disk.
    """
    created = missing_directories(os.path.join(os.fspath(path), MANIFEST))  # removed on failure
    directory = _no_link(check_path(path, directory=True))
    background.wait_for_writes()
    # Every process must name the same directory: rank 0's random name is everyone's.
    name = "shards-" + distributed.broadcast_bytes(secrets.token_hex(8).encode()).decode()
    shards = files.child(directory, name, "the new shards directory", files.SHARDS_NAME)
    manifest = os.path.join(directory, MANIFEST)
    converted = plain(state)
    refuse_unsafe(converted, manifest)
    if not wait:
        converted = background.snapshot(converted)

    def write_manifest(optimizer_part: dict[str, Any] | None) -> None:
        write_file({**converted, "optimizer_shards": optimizer_part, "shards": name}, manifest)
        files.remove_shards(directory, keep=name)

    def cleaned(run: Callable[..., Any]) -> Callable[..., Any]:
        """``run``, whose failure removes what it wrote of the new shards (they hold disk space)
        and says why in words; torch's ``CheckpointException`` is no ``Exception``."""

        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                return run(*args, **kwargs)
            except BaseException as error:
                files.remove_shards(directory, only=name)  # each process, what is left of it
                for made in created:
                    files.remove_empty_directory(made)
                if isinstance(error, (CheckpointError, KeyboardInterrupt, SystemExit)):
                    raise
                raise write_failed(manifest, error) from error

        return guarded

    complete = cleaned(write_shards)(shards, then_on_main=write_manifest, wait=wait)
    if wait:
        background.agree(cleaned(complete), manifest)
    else:
        background.background.started = True  # on every process (see wait_if_saving)
        background.background.start(cleaned(complete), manifest)
    return directory


def shards_directory(file: str, state: dict[str, Any]) -> str:
    """Where the shards of the sharded checkpoint whose manifest is ``file`` lie.

    Raises:
        CheckpointError: the manifest names anything but a shards directory
            inside the checkpoint's own directory (an absolute path, ``..``,
            a separator, a link leading elsewhere), naming the value; the
            checkpoint's directory or manifest is a symbolic link.
    """
    _no_link(file)
    try:
        return files.child(
            _no_link(os.path.dirname(file)),
            state.get("shards"),
            f"The manifest {file!r} entry 'shards'",
            files.SHARDS_NAME,
            follow_links=False,
        )
    except files.UnsafeNameError as error:
        raise CheckpointError(str(error)) from error


def _no_link(path: str) -> str:
    """``path``, once it is no symbolic link: a sharded checkpoint's directory and manifest never are.

    Raises:
        CheckpointError: naming the path and where the link leads.
    """
    try:
        return files.refuse_link(path.rstrip("/" + os.sep) or path, "Sharded checkpoint: ")
    except files.UnsafeNameError as error:
        raise CheckpointError(str(error)) from None
