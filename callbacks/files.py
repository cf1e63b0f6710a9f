"""Every file torch-hapi writes, renames, links or deletes, and every name it joins to a directory.

Two jobs, kept in one module so that there is one place to check them:

* **Atomic writes.** A checkpoint or log that is half-written when a process
  dies is worse than no file: it hides the previous good one. Every file goes
  through :func:`atomic_write`: the bytes go to a temporary file in the same
  directory (so the final rename never crosses a file system), are flushed
  and fsync'ed, and only then replace the target with ``os.replace``, which is
  atomic on POSIX and Windows. A crash at any point leaves either the old file
  or the new one.
* **Confinement.** A checkpoint is data from outside: a crafted one must not
  make torch-hapi write, delete or read outside the directories the user
  gave. Names read back from a file (a rotated checkpoint, a run directory, a
  sharded checkpoint's shards) are joined to their directory by
  :func:`child` only, which refuses anything but a plain file name; nothing
  here writes through a symbolic link or into a file with a second hard link;
  deletions remove only entries of the shape torch-hapi itself creates.

This lives in ``callbacks`` (not ``hapi``) because ``callbacks`` must not
import ``hapi``, while ``hapi`` may import ``callbacks``: the checkpoint
package (:mod:`hapi.checkpoint`) and the callbacks both go through it.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import secrets
import shutil
import stat
from typing import IO, Any, Callable, Iterator

# The layout of a sharded checkpoint directory (written by hapi.checkpoint): a manifest and
# one shards directory per save, whose files torch's distributed checkpoint names.
MANIFEST = "checkpoint.pt"
SHARDS_NAME = re.compile(r"shards-[0-9a-f]{16}")
_DCP_FILE = re.compile(r"(__\d+)?\.metadata(\.tmp)?|__\d+_\d+\.distcp")

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_BINARY = getattr(os, "O_BINARY", 0)


class UnsafeNameError(ValueError):
    """A name read from a file would lead outside its directory (or is no name at all)."""


def is_plain_name(name: Any) -> bool:
    """True for a bare file name: no directory part on POSIX or Windows, not '.' nor '..'."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "\0" not in name
        and pathlib.PurePosixPath(name).name == name
        and pathlib.PureWindowsPath(name).name == name
    )


def check_name(name: Any, entry: str, pattern: re.Pattern[str] | None = None) -> str:
    """``name`` itself, once it is a plain file name (and matches ``pattern``, when given).

    ``entry`` says where the name came from (``"ModelCheckpoint state 'written'"``),
    for the error.

    Raises:
        UnsafeNameError: naming ``entry`` and the value received.
    """
    if not is_plain_name(name) or (pattern is not None and not pattern.fullmatch(name)):
        shape = f" of the form {pattern.pattern!r}" if pattern is not None else ""
        raise UnsafeNameError(
            f"{entry} must be a plain file name{shape} inside its directory (no directory part, "
            f"not absolute, not '.' or '..', not empty, no NUL); received {name!r}. The file it "
            "was read from is damaged or was crafted: torch-hapi never writes, reads or deletes "
            "outside the directories it was given. Use another checkpoint, or start afresh."
        )
    return name


def child(
    directory: str | os.PathLike,
    name: Any,
    entry: str,
    pattern: re.Pattern[str] | None = None,
    follow_links: bool = True,
) -> str:
    """``directory/name`` for a ``name`` that :func:`check_name` accepts.

    ``follow_links=False`` also refuses a ``directory/name`` that is a
    symbolic link (which could lead anywhere): for names whose target is then
    read or written into, not replaced.

    Raises:
        UnsafeNameError: naming ``entry`` and the value received.
    """
    path = os.path.join(os.fspath(directory), check_name(name, entry, pattern))
    if not follow_links and os.path.islink(path):
        raise UnsafeNameError(
            f"{entry} names {name!r}, and {path!r} is a symbolic link (to "
            f"{os.readlink(path)!r}); torch-hapi does not follow links out of the directories "
            "it was given. Replace the link with the directory itself."
        )
    return path


def _fsync_directory(directory: str) -> None:
    # Makes the rename itself durable; not possible on every platform.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _create_temporary(directory: str, name: str) -> tuple[int, str]:
    """A new file beside the target, created with mode 0o666 less the umask, as open() does.

    Asking the kernel for that mode at creation (instead of ``mkstemp``'s 0600
    and a ``chmod`` computed from ``os.umask``, which must briefly set the
    umask to read it) keeps the process umask untouched: another thread
    creating a file at that moment would get loose permissions. ``O_EXCL``
    never opens an existing file, nor follows a link planted under the name.
    """
    for _ in range(100):
        candidate = os.path.join(directory, f".{name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(
                candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _BINARY, 0o666
            ), candidate
        except FileExistsError:
            continue
    raise FileExistsError(f"Could not create a temporary file beside {name!r} in {directory!r}.")


def _only_name(status: os.stat_result) -> bool:
    """A regular file with no other name: writing into it changes nothing else."""
    return stat.S_ISREG(status.st_mode) and status.st_nlink == 1


def _open_spare(spare: str) -> int | None:
    """The spare, opened for writing, if it is a plain file of ours; else ``None``.

    ``O_NOFOLLOW``: a link planted under the spare's name is never opened
    (its target would be overwritten); a second hard link to it (a file
    elsewhere, say) is refused after opening.
    """
    try:
        fd = os.open(spare, os.O_WRONLY | _NOFOLLOW | _BINARY)
    except OSError:  # missing, a link (ELOOP), a directory...
        return None
    if not _only_name(os.fstat(fd)):
        os.close(fd)
        return None
    return fd


@contextlib.contextmanager
def atomic_write(
    path: str | os.PathLike,
    mode: str = "wb",
    verify: Callable[[str], None] | None = None,
    reuse_previous: bool = False,
) -> Iterator[IO]:
    """Open a temporary file beside ``path``; on success it replaces ``path``.

    If the body raises, the temporary file is removed and ``path`` is left as
    it was. ``verify(temporary_path)``, when given, runs on the complete,
    synced file before it replaces ``path``; raising there keeps ``path`` too.
    A symbolic link at ``path`` is replaced, never written through.

    ``reuse_previous`` (for files rewritten again and again, like backups):
    the file this write replaces is kept under a hidden name (:func:`spare_of`)
    and the next write goes into it, overwriting in place. A new file makes
    the file system allocate and map every block again, which on ext4 costs
    about 0.4-0.9 s of kernel time per 300 MB against 0.1 s for blocks it
    already has. The spare is never the live file: ``path`` still changes
    only by an atomic rename. Readers that keep the old file open (or mapped)
    across two later writes would see it change, so use it only for files no
    one maps. Only a regular file with a single name is kept or reused.
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_write supports mode 'wb' or 'w'; received {mode!r}.")
    path = os.fspath(path)
    if not os.path.basename(path):
        raise ValueError(
            f"atomic_write needs a file name; received {path!r}, a directory. Name the file."
        )
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    spare = spare_of(path)
    fd = _open_spare(spare) if reuse_previous else None
    if fd is not None:
        tmp_path = spare
    else:
        fd, tmp_path = _create_temporary(directory, os.path.basename(path))
    try:
        with os.fdopen(
            fd, mode, **({"encoding": "utf-8", "newline": ""} if mode == "w" else {})
        ) as handle:
            yield handle
            handle.truncate()  # a reused file may be longer than what was written
            handle.flush()
            os.fsync(handle.fileno())
        if verify is not None:
            verify(tmp_path)
        replaced = _keep_as_spare(path, directory) if reuse_previous else None
        os.replace(tmp_path, path)
        if replaced is not None:
            os.replace(replaced, spare)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_path)
        raise
    _fsync_directory(directory)


def spare_of(path: str | os.PathLike) -> str:
    """The hidden file :func:`atomic_write` keeps beside ``path`` with ``reuse_previous``."""
    path = os.fspath(path)
    return os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.spare")


def _keep_as_spare(path: str, directory: str) -> str | None:
    """A second name for the file at ``path``, so that replacing ``path`` does not free it.

    Only for a regular file with no other name: a link (or a hard link to a
    file elsewhere) planted at ``path`` must not become a spare written into.
    """
    try:
        if not _only_name(os.lstat(path)):
            return None
    except OSError:
        return None
    link = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(6)}.link")
    try:
        os.link(path, link, follow_symlinks=False)
    except (OSError, NotImplementedError):  # no hard links here: the old file is freed as usual
        return None
    return link


def link_or_copy(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """Give the file ``source`` a second name ``target`` (replacing it atomically).

    A hard link costs no write; where the file system has none, the bytes are
    copied (atomically too). ``source`` must be a regular file, not a link:
    what ``target`` then names is always that file's content.
    """
    source, target = os.fspath(source), os.fspath(target)
    if not stat.S_ISREG(os.lstat(source).st_mode):
        raise OSError(f"Not linking {source!r} to {target!r}: it is not a regular file.")
    temporary = os.path.join(
        os.path.dirname(os.path.abspath(target)),
        f".{os.path.basename(target)}.{secrets.token_hex(6)}.link",
    )
    try:
        os.link(source, temporary, follow_symlinks=False)
    except (OSError, NotImplementedError):
        fd = os.open(source, os.O_RDONLY | _NOFOLLOW | _BINARY)
        with atomic_write(target) as handle, os.fdopen(fd, "rb") as original:
            shutil.copyfileobj(original, handle)
        return
    try:
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)
        raise


def keep_as_previous(path: str | os.PathLike, previous: str | os.PathLike) -> bool:
    """Give the file at ``path`` the second name ``previous`` (replacing it), before ``path`` is
    rewritten; returns whether it did.

    For a file replaced by :func:`atomic_write` (never written in place: a
    file with two names is neither reused as a spare nor written into), so
    ``previous`` keeps the old content when ``path`` gets the new one.
    Nothing happens when ``path`` is missing or not a regular file (a link
    planted there is never followed).
    """
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return False
    except FileNotFoundError:
        return False
    link_or_copy(path, previous)
    return True


def remove_with_spare(path: str | os.PathLike) -> None:
    """Delete ``path`` and the spare :func:`atomic_write` may keep beside it.

    ``os.remove`` deletes a link itself, never its target; a directory of
    that name is left alone.
    """
    for name in (os.fspath(path), spare_of(path)):
        with contextlib.suppress(FileNotFoundError, IsADirectoryError, PermissionError):
            if not stat.S_ISDIR(os.lstat(name).st_mode):
                os.remove(name)


def remove_shards(directory: str | os.PathLike, keep: str | None = None) -> None:
    """Delete the shards directories (``shards-<16 hex>``) in ``directory``, but ``keep``.

    Only what torch's distributed checkpoint writes there is deleted (its
    ``.metadata`` and ``__<rank>_<n>.distcp`` files), then the directory if it
    is empty: a link of that name is unlinked, never followed, and a file of
    anyone else's inside stays, with its directory.
    """
    directory = os.fspath(directory)
    try:
        entries = os.listdir(directory)
    except FileNotFoundError:
        return
    for entry in entries:
        if entry == keep or not SHARDS_NAME.fullmatch(entry):
            continue
        shards = os.path.join(directory, entry)
        if os.path.islink(shards) or not os.path.isdir(shards):
            continue
        for name in os.listdir(shards):
            if _DCP_FILE.fullmatch(name):
                with contextlib.suppress(FileNotFoundError, IsADirectoryError, PermissionError):
                    os.remove(os.path.join(shards, name))
        remove_empty_directory(shards)


def remove_sharded(directory: str | os.PathLike) -> None:
    """Delete a sharded checkpoint torch-hapi wrote: its manifest, its shards, then ``directory`` if empty."""
    remove_with_spare(os.path.join(os.fspath(directory), MANIFEST))
    remove_shards(directory)
    remove_empty_directory(directory)


def remove_empty_directory(directory: str | os.PathLike) -> None:
    """``rmdir``: a directory that still holds anything (or is a link) stays."""
    with contextlib.suppress(OSError):
        if not os.path.islink(directory):
            os.rmdir(directory)
