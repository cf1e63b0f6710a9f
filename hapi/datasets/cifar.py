"""CIFAR-10 from its binary release (tarball or extracted ``.bin`` files); see :mod:`hapi.datasets`."""

from __future__ import annotations

import functools
import gzip
import io
import tarfile
import zlib
from pathlib import Path

import numpy as np

from hapi.datasets import base

_SIDE = 32
_RECORD = 1 + 3 * _SIDE * _SIDE  # 3073: a label byte, then the red, green, blue planes
_TARBALL = "cifar-10-binary.tar.gz"
_DIR = "cifar-10-batches-bin"
_URL = "https://www.cs.toronto.edu/~kriz/" + _TARBALL
_FILES = {"train": tuple(f"data_batch_{i}.bin" for i in range(1, 6)), "test": ("test_batch.bin",)}
_BATCHES = _FILES["train"] + _FILES["test"]
# Names from the Python (pickle) release, refused with directions to the binary one.
_PYTHON_NAMES = ("cifar-10-python.tar.gz", "cifar-10-batches-py", "data_batch_1", "test_batch")


class Cifar10(base.ImageDataset):
    """CIFAR-10: 50,000 training and 10,000 test 32x32 colour images, 10 classes.

    Reads the *binary* release, ``cifar-10-binary.tar.gz``: either the tarball
    itself (members are read straight from the archive, nothing is extracted
    to disk) or the ``cifar-10-batches-bin`` directory extracted from it. The
    Python release (``cifar-10-python.tar.gz``) is refused with directions to
    the binary one: its batches are pickles, and unpickling a file runs
    whatever code it holds.

    Args:
        root: a directory holding the ``.bin`` files, a ``cifar-10-batches-bin``
            directory or ``cifar-10-binary.tar.gz`` (``root/cifar-10`` is searched
            the same way), or the tarball's own path. ``None`` searches
            ``$HAPI_DATA_HOME/cifar-10``, ``~/.cache/hapi/cifar-10`` and
            ``/usr/share/datasets/cifar-10``. In each directory the extracted
            files win over the tarball: they need no decompression.
        mode: ``"train"`` (``data_batch_1.bin`` to ``data_batch_5.bin``, in that
            order) or ``"test"`` (``test_batch.bin``).
        transform: applied to each image, a float32 tensor ``[3, 32, 32]`` in ``[0, 1]``.
        download: fetch ``cifar-10-binary.tar.gz`` (about 162 MiB) from :attr:`mirrors` into
            ``root`` (or ``$HAPI_DATA_HOME/cifar-10``, else ``~/.cache/hapi/cifar-10``)
            when no local copy is found. The tarball is kept as it is.

    Items are ``(image, label)``: float32 ``[3, 32, 32]`` (channels red, green,
    blue; values divided by 255, as for :class:`FashionMNIST`) and an int64 0-d
    tensor. ``self.images`` is uint8 ``[N, 3, 32, 32]``, ``self.labels`` int64
    ``[N]``. The batch sizes are not checked against the release's 10,000, so
    a cut-down copy works too.

    Raises:
        ValueError: ``mode`` is not ``"train"`` or ``"test"``, or ``root`` is a single ``.bin`` file.
        FileNotFoundError: no searched directory holds the files (and ``download=False``).
        DatasetError: a file is corrupt, the extraction is incomplete, the Python
            release was found instead, or a download failed.
    """

    name = "cifar-10"
    system_dir = "/usr/share/datasets/cifar-10"
    mirrors = ["https://www.cs.toronto.edu/~kriz/"]
    _get_files = (
        f"download the binary release {_URL} (not cifar-10-python.tar.gz) and put it, "
        f"or the {_DIR} directory extracted from it,"
    )
    classes = "airplane automobile bird cat deer dog frog horse ship truck".split()

    def _load(self, root, download: bool) -> tuple[np.ndarray, np.ndarray, Path]:
        parsed, directory = self._read(root, download)
        # One copy into fresh, writable, contiguous arrays (frombuffer views are read-only).
        images, labels = zip(*(parsed[n] for n in _FILES[self.mode]))
        return np.concatenate(images), np.concatenate(labels), directory

    def _read(self, root, download: bool) -> tuple[dict[str, tuple], Path]:
        """``({batch name: (images, labels)}, the directory)`` from the first place searched that
        holds extracted batches or the tarball, else downloaded."""
        names = _FILES[self.mode]
        path = None if root is None else Path(root).expanduser()
        if path is not None and path.is_file():
            if path.name in _PYTHON_NAMES:
                raise _python_release_error(str(path), path)
            if path.suffix == ".bin":
                raise ValueError(
                    f"{type(self).__name__}: root={str(path)!r} is one batch file; pass the directory "
                    f"that holds all of them, {str(path.parent)!r}, or the {_TARBALL} tarball."
                )
            # Any other file is read as the tarball, whatever its name.
            return _read_tarball(path.read_bytes(), path, names), path.parent
        tried: list[Path] = []
        for top in self._search_dirs(root):
            for directory in (top, top / _DIR):
                tried.append(directory)
                present = [n for n in names if (directory / n).is_file()]
                missing = [n for n in names if n not in present]
                if present and missing:  # a broken extraction is an error, not a miss
                    raise base.bad_file(
                        directory / missing[0],
                        f"missing; {directory} has {', '.join(present)} but not "
                        f"{', '.join(missing)}, so the extraction of {_TARBALL} is incomplete",
                        f"Extract the tarball again, or delete {directory}.",
                    )
                if present:
                    return {
                        n: _parse_cifar((directory / n).read_bytes(), directory / n) for n in names
                    }, directory
            tried.append(top / _TARBALL)
            if tried[-1].is_file():
                return _read_tarball(tried[-1].read_bytes(), tried[-1], names), top
        if download:  # into the first directory searched; the tarball serves both modes
            check = functools.partial(_read_tarball, names=_BATCHES)
            return self._fetch(_TARBALL, tried[0], check), tried[0]
        python_release = [d / n for d in tried for n in _PYTHON_NAMES if (d / n).exists()]
        if python_release:
            raise _python_release_error(", ".join(map(str, python_release)), python_release[0])
        raise self._not_found(f"found neither {', '.join(names)} nor {_TARBALL}", tried)


def _python_release_error(what: str, path: Path) -> base.DatasetError:
    return base.DatasetError(
        f"{what}: this is the CIFAR-10 Python release, whose batches are pickles; torch-hapi does "
        "not unpickle data files (unpickling runs code from the file). It reads the binary "
        f"release, {_TARBALL}.",
        path,
    )


def _read_tarball(
    data: bytes, path: Path, names: tuple[str, ...]
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Parse the batches ``names`` of a ``cifar-10-binary.tar.gz`` whose bytes are ``data``.

    One pass over the stream (tarfile's ``r|`` mode: a gzip'ed tar cannot seek
    back cheaply), nothing written to disk, and read to the end so that gzip's
    CRC check runs. Members outside the binary release's list are refused, so
    a different archive (the Python release, CIFAR-100, a repackaged copy) is
    reported rather than half-read.
    """

    def fail(what: str) -> base.DatasetError:
        return base.bad_file(path, what, "Delete it and download it again.")

    if data[:2] != base.GZIP_MAGIC:
        raise fail("not a gzip file, so not cifar-10-binary.tar.gz")
    wanted = {f"{_DIR}/{n}": n for n in names}
    allowed = {_DIR} | {f"{_DIR}/{n}" for n in (*_BATCHES, "batches.meta.txt", "readme.html")}
    payloads: dict[str, bytes] = {}
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(data), mode="rb") as stream:
            with tarfile.open(fileobj=stream, mode="r|") as archive:
                for member in archive:
                    member_name = member.name.removeprefix("./").rstrip("/")
                    if member_name.split("/")[0] == "cifar-10-batches-py":
                        raise _python_release_error(str(path), path)
                    if member_name not in allowed:
                        raise fail(
                            f"unexpected member {member.name!r}; the binary release holds only "
                            f"{_DIR}/ with the six .bin batches, batches.meta.txt and readme.html"
                        )
                    if member_name not in wanted:
                        continue
                    if not member.isfile():
                        raise fail(f"member {member_name} is not a regular file")
                    if member_name in payloads:
                        raise fail(f"member {member_name} appears twice")
                    payloads[member_name] = archive.extractfile(member).read()
            # The rest of the stream: GzipFile checks CRC and length at its end.
            while stream.read(1 << 20):
                pass
    except (tarfile.TarError, OSError, EOFError, zlib.error) as error:
        raise fail(f"damaged gzip or tar data {base.damaged(error)}") from error
    missing = [m for m in wanted if m not in payloads]
    if missing:
        raise fail(f"member {', '.join(missing)} missing from the archive")
    return {wanted[m]: _parse_cifar(payloads[m], path, member=m) for m in wanted}


def _parse_cifar(
    data: bytes, path: Path, member: str | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Check one binary batch: ``(images uint8 [N, 3, 32, 32], labels uint8 [N])``, views of ``data``."""

    def fail(what: str) -> base.DatasetError:
        if member is None:
            return base.bad_file(path, what)
        return base.DatasetError(
            f"{path} (member {member}): {what}. Delete {path.name} and download it again.", path
        )

    if not data:
        raise fail(f"empty, expected records of {_RECORD} bytes")
    if len(data) % _RECORD:
        raise fail(
            f"length {len(data)} is not a multiple of {_RECORD} bytes per record "
            f"(1 label byte + {_RECORD - 1} pixel bytes): truncated, or not a CIFAR-10 binary batch"
        )
    records = np.frombuffer(data, dtype=np.uint8).reshape(-1, _RECORD)
    labels = records[:, 0]
    bad = np.flatnonzero(labels > 9)
    if bad.size:
        raise fail(f"record {bad[0]} has label {labels[bad[0]]} outside 0..9")
    # Each record's pixels are the red, then green, then blue 32x32 plane, row-major: already [3, 32, 32].
    return records[:, 1:].reshape(-1, 3, _SIDE, _SIDE), labels
