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
import secrets
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


def _create_temporary(directory: str, name: str) -> tuple[int, str]:
    """A new file beside the target, created with mode 0o666 less the umask, as open() does.

    Asking the kernel for that mode at creation (instead of ``mkstemp``'s 0600
    and a ``chmod`` computed from ``os.umask``, which must briefly set the
    umask to read it) keeps the process umask untouched: another thread
    creating a file at that moment would get loose permissions.
    """
    for _ in range(100):
        candidate = os.path.join(directory, f".{name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0),
                           0o666), candidate
        except FileExistsError:
            continue
    raise FileExistsError(f"Could not create a temporary file beside {name!r} in {directory!r}.")


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
    fd, tmp_path = _create_temporary(directory, os.path.basename(path))
    try:
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
