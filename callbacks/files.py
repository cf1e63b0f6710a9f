"""Atomic file writes, shared by every writer in torch-hapi.

A checkpoint or log that is half-written when a process dies is worse than no
file: it hides the previous good one. Every file torch-hapi writes goes through
:func:`atomic_write`: the bytes go to a temporary file in the same directory
(so the final rename never crosses a file system), are flushed and fsync'ed,
and only then replace the target with ``os.replace``, which is atomic on POSIX
and Windows. A crash at any point leaves either the old file or the new one.

This lives in ``callbacks`` (not ``hapi``) because ``callbacks`` must not
import ``hapi``, while ``hapi`` may import ``callbacks``.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import IO, Iterator


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


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary file beside ``path``; on success it replaces ``path``.

    If the body raises, the temporary file is removed and ``path`` is left as
    it was.
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_write supports mode 'wb' or 'w'; received {mode!r}.")
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp_path = tempfile.mkstemp(
        dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp"
    )
    try:
        # mkstemp creates the file 0600; give it the permissions open() would.
        os.chmod(tmp_path, 0o666 & ~_current_umask())
        with os.fdopen(fd, mode, **({"encoding": "utf-8", "newline": ""} if mode == "w" else {})) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_path)
        raise
    _fsync_directory(directory)
