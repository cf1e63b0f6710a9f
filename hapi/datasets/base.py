"""What the data-set readers share: errors, where files are looked for, uint8 storage
with float items and whole batches, downloads, and file reading."""

from __future__ import annotations

import copy
import os
import urllib.request
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch.utils.data import Dataset

GZIP_MAGIC = b"\x1f\x8b"


class DatasetError(RuntimeError):
    """A data set file exists but cannot be used (corrupt, truncated, wrong format),
    or a requested download failed.

    Raised instead of a bare ``struct``/``gzip`` error so that the message can
    name the file, what is wrong with it and how to get good files. A data set
    that is not there at all raises ``FileNotFoundError`` instead.

    Args:
        message: what is wrong and what to do.
        path: the offending file, when there is one.

    Attributes:
        path: the offending file (``None`` for a download that got nothing).
    """

    def __init__(self, message: str, path: str | os.PathLike | None = None):
        super().__init__(message)
        self.path = None if path is None else os.fspath(path)


def default_data_dirs(name: str, system_dir: str | os.PathLike | None = None) -> list[Path]:
    """The directories a data set searches when ``root=None``, in order.

    Built at call time from ``$HAPI_DATA_HOME`` and ``$HOME``, so changing
    either takes effect at once. Useful to see where to put downloaded files.

    Args:
        name: the data set's directory name: ``"fashion-mnist"``, ``"mnist"``
            or ``"cifar-10"``.
        system_dir: a system-wide directory searched last (e.g.
            ``/usr/share/datasets/fashion-mnist``), or ``None``.

    Returns:
        ``[$HAPI_DATA_HOME/<name> (when set), ~/.cache/hapi/<name>, system_dir
        (when given)]`` as ``Path`` objects.
    """
    data_home = os.environ.get("HAPI_DATA_HOME")
    dirs = [Path(data_home).expanduser() / name] if data_home else []
    dirs.append(Path.home() / ".cache" / "hapi" / name)
    return dirs if system_dir is None else [*dirs, Path(system_dir)]


def bad_file(path: Path, what: str, todo: str = "Delete it and get good files.") -> DatasetError:
    """The :class:`DatasetError` for a file that is there but wrong: the file, what, what to do
    (the data set adds how to get good files)."""
    return DatasetError(f"{path}: {what}. {todo}", path)


def damaged(error: BaseException) -> str:
    """Why gzip or tar gave up, for a message (a truncated stream often says nothing)."""
    return f"({type(error).__name__}: {str(error) or 'truncated'})"


class ImageDataset(Dataset):
    """What every reader here shares: arguments, uint8 storage, float items, whole batches.

    Subclasses set the class attributes and implement ``_load(root, download)``, which
    finds (or fetches) and checks the files and returns ``(uint8 images, labels, the
    directory they came from)``; ``_get_files`` says what to fetch for :meth:`_hint`, which
    ends the message of every :class:`DatasetError` it raises.
    Images stay uint8 (a quarter of float32's memory) and become float only when
    accessed, one item or one batch at a time.
    """

    name: str = ""
    system_dir: str | None = None
    mirrors: list[str] = []
    download_timeout: float = 30.0
    classes: list[str] = []
    _get_files: str = ""  # what to fetch and put where the files are looked for

    def __init__(
        self,
        root: str | os.PathLike | None = None,
        mode: str = "train",
        transform: Callable[[torch.Tensor], object] | None = None,
        download: bool = False,
    ):
        if mode not in ("train", "test"):
            raise ValueError(
                f"{type(self).__name__}: mode must be 'train' or 'test'; received {mode!r}."
            )
        self.mode = mode
        self.transform = transform
        try:
            images, labels, self.root = self._load(root, download)
        except DatasetError as error:  # how to get good files (download=True once not tried)
            error.args = (f"{error} {self._hint(offer_download=not download)}",)
            raise
        self.images = torch.from_numpy(images)  # uint8, one row per sample
        self.labels = torch.from_numpy(labels.astype(np.int64))  # int64 [N]

    def _as_float(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 images ``[B, ...]`` as float32 ``[B, C, H, W]`` in ``[0, 1]``."""
        if self.images.dim() == 3:  # grey images are stored without a channel axis
            images = images.unsqueeze(1)
        return images.to(torch.float32).div_(255.0)

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def draws_random_numbers(self) -> bool:
        """Only a transform can draw (see :class:`hapi.data.SeededDataset`); the images are fixed."""
        return self.transform is not None

    def __getitem__(self, index):
        image = self._as_float(self.images[index].unsqueeze(0))[0]
        if self.transform is not None:
            image = self.transform(image)
        return image, self.labels[index]

    def __getitems__(self, indices: list[int]) -> Any:
        """A whole batch in one indexing operation: ``(images [B, C, H, W], labels [B])``.

        The DataLoader calls this with a batch's indices instead of
        ``__getitem__`` per sample. The result is a :class:`hapi.data.Batch`:
        torch-hapi uses its tensors as they are, while a plain DataLoader reads
        it as the list of samples torch expects.
        """
        from hapi.data import Batch  # imported late: reading a data set needs no process machinery

        index = torch.as_tensor(indices, dtype=torch.long, device=self.images.device)
        images = self._as_float(self.images[index])
        if self.transform is not None:
            images = torch.stack([self.transform(image) for image in images])
        return Batch(images, self.labels[index])

    @property
    def nbytes(self) -> int:
        """Bytes the stored images and labels take (what a copy to a GPU would take)."""
        return self.images.nbytes + self.labels.nbytes

    def to(self, device: str | torch.device) -> "ImageDataset":
        """The same data set with its stored images and labels on ``device``.

        torch-hapi calls this to batch in-memory data on the GPU with no copy
        per step; the data set itself is left where it was.

        Args:
            device: where the copy keeps its tensors (``"cuda"``, a ``torch.device``).

        Returns:
            A shallow copy of this data set whose ``images`` and ``labels`` live
            on ``device``.
        """
        moved = copy.copy(self)
        moved.images, moved.labels = self.images.to(device), self.labels.to(device)
        return moved

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(mode={self.mode!r}, len={len(self)}, root={str(self.root)!r})"
        )

    def _hint(self, offer_download: bool = True) -> str:
        """How to get good files: the end of every message about missing or bad ones."""
        return (
            f"To get the data: {self._get_files} in $HAPI_DATA_HOME/{self.name}, "
            f"~/.cache/hapi/{self.name} or a directory passed as root="
            + (", or pass download=True." if offer_download else ".")
        )

    def _not_found(self, what: str, tried: list[Path]) -> FileNotFoundError:
        listed = "\n".join(f"  {d}" for d in tried)
        return FileNotFoundError(
            f"{type(self).__name__}(mode={self.mode!r}): {what}. Tried:\n{listed}\n{self._hint()}"
        )

    def _search_dirs(self, root) -> list[Path]:
        """Where to look, in order; ``download=True`` puts files in the first."""
        if root is not None:
            root = Path(root).expanduser()
            return [root, root / self.name]
        return default_data_dirs(self.name, self.system_dir)

    def _fetch(self, filename: str, target: Path, check: Callable[[bytes, Path], Any]) -> Any:
        """Download ``filename`` from the first of ``self.mirrors`` that serves good bytes.

        ``check(data, path)`` must raise :class:`DatasetError` on bad content, so
        that a mirror answering with an error page never leaves a file behind;
        good bytes are written atomically to ``target/filename``. Returns what
        ``check`` returned, so the caller need not parse the file twice.
        """
        # Imported here: only a download writes a file (hapi.checkpoint owns every write).
        from hapi.checkpoint import atomic_write

        path = target / filename
        urls, last_error = [base.rstrip("/") + "/" + filename for base in self.mirrors], None
        for url in urls:
            try:
                with urllib.request.urlopen(url, timeout=self.download_timeout) as response:
                    data = response.read()
                result = check(data, path)
            except (OSError, DatasetError) as error:  # URLError, HTTPError, timeouts are OSErrors
                last_error = error
                continue
            with atomic_write(path, "wb") as handle:
                handle.write(data)
            return result
        tried = "\n".join(f"  {u}" for u in urls) or "  (no mirrors configured)"
        raise DatasetError(
            f"{type(self).__name__}: could not download {filename} into {target}. URLs tried:\n"
            f"{tried}\nLast error: {last_error!r}.",
            path,
        )
