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
  :func:`child` only, which refuses anything but a plain file name. No
  symbolic link inside a checkpoint, backup or shards directory is followed,
  whenever it was planted (:func:`refuse_link`, :func:`open_nofollow`; a link
  at a file's name is replaced, never written through); deletions remove
  only entries of the shape torch-hapi itself creates.

The checkpoint package owns it; the callbacks reach it as ``hapi.checkpoint.files``
(and ``hapi.checkpoint.atomic_write``), and ``tests/test_layering.py`` fails if any
other module writes, renames, links or deletes a file.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import secrets
import shutil
import socket
import stat
from typing import IO, Any, Callable, Iterator

from hapi.checkpoint.errors import CheckpointError

# The layout of a sharded checkpoint directory (written by hapi.checkpoint): a manifest and
# one shards directory per save, whose files torch's distributed checkpoint names.
MANIFEST = "checkpoint.pt"
SHARDS_NAME = re.compile(r"shards-[0-9a-f]{16}")
_DCP_FILE = re.compile(r"(__\d+)?\.metadata(\.tmp)?|__\d+_\d+\.distcp")

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_BINARY = getattr(os, "O_BINARY", 0)


class UnsafeNameError(ValueError, CheckpointError):
    """A name read from a file would lead outside its directory (or is no name at all), or a
    path where torch-hapi keeps its own files is a symbolic link.

    A ``ValueError``, and a :class:`~hapi.checkpoint.CheckpointError` too: a checkpoint
    that names such a path cannot be loaded safely."""


def is_plain_name(name: Any) -> bool:
    """True for a bare file name: no directory part on POSIX or Windows, not '.' nor '..'."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "\0" not in name
        and pathlib.PureWindowsPath(name).name == name  # '/' and '\\' separate there, drives too
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
            f"{entry} must be a plain file name{shape} (no directory part, not '.', '..' or "
            f"empty); received {name!r}. The file it was read from is damaged or was crafted: "
            "use another checkpoint, or start afresh."
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
    return path if follow_links else refuse_link(path, f"{entry} names {name!r}, and ")


def refuse_link(path: str | os.PathLike, what: str = "") -> str:
    """``path`` as a str without trailing separators, once it is no symbolic link (``lstat``:
    the link itself is looked at, also for ``"link/"``).

    For the entries of a checkpoint, backup or shards directory, where a link
    planted before, between or during runs would lead reads, writes and
    deletions anywhere. ``what`` starts the message (where the path came from).

    Raises:
        UnsafeNameError: naming the path and where the link leads.
    """
    path = os.fspath(path).rstrip("/" + os.sep) or os.fspath(path)
    if os.path.islink(path):
        raise UnsafeNameError(
            f"{what}{path!r} is a symbolic link (to {os.readlink(path)!r}), which torch-hapi "
            "never follows in its checkpoint, backup or shards directories. Remove it, or pass "
            "the real path (os.path.realpath) of a checkpoint kept elsewhere."
        )
    return path


def open_nofollow(path: str | os.PathLike, flags: int, levels: int = 1) -> int:
    """``os.open(path, flags)`` (mode 0o666 less the umask), where none of the last ``levels``
    parts of ``path`` -- the file and the directories that hold it -- may be a symbolic link.

    Each part is opened relative to the one above it with ``O_NOFOLLOW``, so a
    link planted at any moment, even between two checks, is never followed.

    Raises:
        UnsafeNameError: a part is a symbolic link (see :func:`refuse_link`).
    """
    every = pathlib.PurePath(os.path.abspath(os.fspath(path))).parts
    head, parts = os.path.join(*every[:-levels]), every[-levels:]
    if os.open not in os.supports_dir_fd:  # Windows: look, then open
        for index in range(levels):
            refuse_link(os.path.join(head, *parts[: index + 1]))
        return os.open(path, flags | _NOFOLLOW | _BINARY, 0o666)
    fd = os.open(head, os.O_RDONLY | _DIRECTORY)
    for index, part in enumerate(parts):
        here = flags if index == levels - 1 else os.O_RDONLY | _DIRECTORY
        try:
            opened = os.open(part, here | _NOFOLLOW | _BINARY, 0o666, dir_fd=fd)
        except OSError:
            refuse_link(os.path.join(head, *parts[: index + 1]))
            raise
        finally:
            os.close(fd)  # the directory above: only the part opened now is needed
        fd = opened
    return fd


# Temporaries are named by machine and process, so that a killed writer's can be told apart.
_HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"


def _remove_orphans(directory: str, name: str) -> None:
    """Delete the temporaries of ``name`` that writers killed on this machine left behind.

    Each would hold up to a whole checkpoint, and a job restarted after every
    crash (``torchrun --max-restarts``) would pile them up. A temporary is an
    orphan when its process is gone; another machine's (a shared file system)
    and a live writer's are left alone. POSIX only: elsewhere a process cannot
    be asked whether it lives without touching it.
    """
    if os.name != "posix":
        return
    pattern = re.compile(rf"\.{re.escape(name)}\.{re.escape(_HOST)}\.(\d+)\.[0-9a-f]{{12}}\.tmp")
    with contextlib.suppress(OSError):
        for entry in os.listdir(directory):
            match = pattern.fullmatch(entry)
            try:
                if match:
                    os.kill(int(match.group(1)), 0)  # signal 0: no signal, only the question
            except ProcessLookupError:  # unlink removes a link itself, never its target
                os.unlink(os.path.join(directory, entry))
            except PermissionError:  # another user's process: alive
                pass


@contextlib.contextmanager
def atomic_write(
    path: str | os.PathLike,
    mode: str = "wb",
    verify: Callable[[str], None] | None = None,
) -> Iterator[IO]:
    """Open a temporary file beside ``path``; on success it replaces ``path``.

    If the body raises, the temporary file is removed and ``path`` is left as
    it was. ``verify(temporary_path)``, when given, runs on the complete,
    synced file before it replaces ``path``; raising there keeps ``path`` too.
    A symbolic link at ``path`` is replaced, never written through.

    Each write has a temporary file of its own, and the final ``os.replace``
    is the only step that touches ``path``: any number of writers of one path
    (two jobs, say) and its readers never see a file half-written or mixed.
    (Reusing the replaced file's blocks for the next write was cheaper in
    kernel time, but a reader still reading that file would see it change.)

    The temporary is created with mode 0o666 less the umask, as open() does,
    without touching the process umask (another thread creating a file at
    that moment would get loose permissions); ``O_EXCL`` never opens an
    existing file, nor follows a link planted under its name (a new name: 48
    random bits beside the machine and process).
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_write supports mode 'wb' or 'w'; received {mode!r}.")
    path = os.fspath(path)
    name = os.path.basename(path)
    if not name:
        raise ValueError(f"atomic_write needs a file name; received the directory {path!r}.")
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    _remove_orphans(directory, name)
    tmp_path = os.path.join(directory, f".{name}.{_HOST}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _BINARY
    fd = os.open(tmp_path, flags, 0o666)
    text = {"encoding": "utf-8", "newline": ""} if mode == "w" else {}
    try:
        with os.fdopen(fd, mode, **text) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        if verify is not None:
            verify(tmp_path)
        os.replace(tmp_path, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_path)
        raise
    with contextlib.suppress(OSError):  # makes the rename itself durable; not everywhere possible
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def spare_of(path: str | os.PathLike) -> str:
    """The hidden spare earlier versions kept beside ``path``, deleted with it."""
    path = os.fspath(path)
    return os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.spare")


def link_or_copy(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """Give the file ``source`` a second name ``target`` (replacing it atomically).

    A hard link costs no write; where the file system has none, the bytes are
    copied (atomically too). ``source`` must be a regular file, not a link:
    what ``target`` then names is always that file's content.
    """
    source, target = os.fspath(source), os.fspath(target)
    if not stat.S_ISREG(os.lstat(source).st_mode):
        raise OSError(f"Not linking {source!r} to {target!r}: it is not a regular file.")
    directory, name = os.path.split(os.path.abspath(target))
    temporary = os.path.join(directory, f".{name}.{secrets.token_hex(6)}.link")

    try:
        os.link(source, temporary, follow_symlinks=False)
    except (OSError, NotImplementedError):  # no hard links here: a copy
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

    For a file replaced by :func:`atomic_write` (never written in place), so
    ``previous`` keeps the old content when ``path`` gets the new one.
    Nothing happens when ``path`` is missing or not a regular file (a link
    planted there is never followed).
    """
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISREG(os.lstat(path).st_mode):
            link_or_copy(path, previous)
            return True
    return False


def remove_with_spare(path: str | os.PathLike) -> None:
    """Delete ``path`` and the spare earlier versions kept beside it (:func:`spare_of`).

    ``os.remove`` deletes a link itself, never its target; a directory of
    that name is left alone.
    """
    for name in (os.fspath(path), spare_of(path)):
        with contextlib.suppress(FileNotFoundError, IsADirectoryError, PermissionError):
            if not stat.S_ISDIR(os.lstat(name).st_mode):
                os.remove(name)


def _delete(
    directory: str | os.PathLike, wanted: Callable[[str], Any], at: int | None = None
) -> None:
    """Delete the entries of ``directory`` (relative to the directory open as ``at``) whose name
    ``wanted`` accepts: a file, or a shards directory with what torch's distributed checkpoint
    wrote in it (its ``.metadata`` and ``__<rank>_<n>.distcp`` files), then that directory if
    empty. A link -- as ``directory``, as an entry, or inside a shards directory -- is never
    followed; another directory, and a file of anyone else's inside a shards one, stay.

    Where the platform acts relative to an open directory (POSIX), the directory
    stays the one opened even if a link replaces its name meanwhile; elsewhere
    (Windows) names are joined to the path, once looked at.
    """
    relative = os.unlink in os.supports_dir_fd
    try:
        if relative:
            fd = os.open(directory, os.O_RDONLY | _DIRECTORY | _NOFOLLOW, dir_fd=at)
        elif not stat.S_ISDIR(os.lstat(directory).st_mode):
            return
    except OSError:  # missing, not a directory, or a link
        return
    where = {"dir_fd": fd} if relative else {}
    try:
        for name in os.listdir(fd if relative else directory):
            entry = name if relative else os.path.join(directory, name)
            with contextlib.suppress(OSError):  # gone already, not ours to delete, or not empty
                if wanted(name) and SHARDS_NAME.fullmatch(name):
                    _delete(entry, _DCP_FILE.fullmatch, fd if relative else None)
                    os.rmdir(entry, **where)
                elif wanted(name) and not stat.S_ISDIR(os.lstat(entry, **where).st_mode):
                    os.unlink(entry, **where)
    finally:
        if relative:
            os.close(fd)


def remove_shards(directory: str | os.PathLike, wanted: Callable[[str], Any] = bool) -> None:
    """Delete the shards directories (``shards-<16 hex>``) in ``directory`` whose name
    ``wanted`` accepts (by default all); see :func:`_delete`."""
    _delete(directory, lambda name: SHARDS_NAME.fullmatch(name) and wanted(name))


def remove_sharded(directory: str | os.PathLike) -> None:
    """Delete a sharded checkpoint torch-hapi wrote: its manifest, its shards, then ``directory``
    if empty. A link as ``directory`` (or in it) is never followed: nothing is deleted through it.
    """
    # The manifest first: a deletion cut short leaves no manifest naming missing shards.
    _delete(directory, lambda name: name in (MANIFEST, os.path.basename(spare_of(MANIFEST))))
    remove_shards(directory)
    remove_empty_directory(directory)


def remove_empty_directory(directory: str | os.PathLike) -> None:
    """``rmdir``: a directory that still holds anything (or is a link) stays."""
    with contextlib.suppress(OSError):
        if not os.path.islink(directory):
            os.rmdir(directory)
