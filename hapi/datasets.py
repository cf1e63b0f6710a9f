"""MNIST and Fashion-MNIST as map-style datasets, read from the standard IDX files.

Each data set is four files, gzip'ed (``.gz``, preferred) or raw::

    train-images-idx3-ubyte  train-labels-idx1-ubyte
    t10k-images-idx3-ubyte   t10k-labels-idx1-ubyte

Where the files are looked for (the first directory holding both files the
``mode`` needs wins):

- ``root`` given: ``root``, then ``root/<name>``;
- ``root=None``: ``$HAPI_DATA_HOME/<name>`` (when the variable is set),
  ``~/.cache/hapi/<name>``, then the system directory
  (``/usr/share/datasets/<name>``, where Debian's ``dataset-fashion-mnist``
  package installs real Fashion-MNIST),

with ``<name>`` ``"fashion-mnist"`` or ``"mnist"``. Nothing is ever downloaded
unless ``download=True``.

A whole file is parsed in one ``np.frombuffer`` call and stored once, as
``self.images`` (uint8 ``[N, 28, 28]``) and ``self.labels`` (int64 ``[N]``);
items are converted to float on access. Every check a file must pass (gzip
integrity, IDX magic number, dimensions, payload length, label range, image and
label counts) fails with :class:`DatasetError`, whose message names the file,
what is wrong, and how to get good files. A data set that is not there at all
raises ``FileNotFoundError`` listing every directory tried.
"""

from __future__ import annotations

import gzip
import os
import urllib.request
import zlib
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = ["DatasetError", "FashionMNIST", "MNIST", "default_data_dirs"]

_IMAGE_MAGIC = 2051  # 0x00000803: unsigned bytes, 3 dimensions
_LABEL_MAGIC = 2049  # 0x00000801: unsigned bytes, 1 dimension
_GZIP_MAGIC = b"\x1f\x8b"
_SIDE = 28
_NUM_CLASSES = 10
_STEMS = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


class DatasetError(RuntimeError):
    """A data set file exists but cannot be used (corrupt, truncated, wrong format),
    or a requested download failed.

    Attributes:
        path: the offending file (``None`` for a download that got nothing).
    """

    def __init__(self, message: str, path: str | os.PathLike | None = None):
        super().__init__(message)
        self.path = None if path is None else os.fspath(path)


def default_data_dirs(name: str, system_dir: str | os.PathLike | None = None) -> list[Path]:
    """The directories searched when ``root=None``, in order.

    Built at call time from ``$HAPI_DATA_HOME`` and ``$HOME``, so changing
    either takes effect at once.
    """
    dirs = []
    data_home = os.environ.get("HAPI_DATA_HOME")
    if data_home:
        dirs.append(Path(data_home).expanduser() / name)
    dirs.append(Path.home() / ".cache" / "hapi" / name)
    if system_dir is not None:
        dirs.append(Path(system_dir))
    return dirs


def _download_dir(name: str, root: str | os.PathLike | None) -> Path:
    if root is not None:
        return Path(root).expanduser()
    data_home = os.environ.get("HAPI_DATA_HOME")
    if data_home:
        return Path(data_home).expanduser() / name
    return Path.home() / ".cache" / "hapi" / name


def _find_file(directory: Path, stem: str) -> Path | None:
    for candidate in (directory / f"{stem}.gz", directory / stem):
        if candidate.is_file():
            return candidate
    return None


class _IDXDataset(Dataset):
    """Shared reader for MNIST-format data sets; subclasses set the class attributes."""

    name: str = ""
    system_dir: str | None = None
    mirrors: list[str] = []
    download_timeout: float = 30.0
    classes: list[str] = []

    def __init__(
        self,
        root: str | os.PathLike | None = None,
        mode: str = "train",
        transform: Callable[[torch.Tensor], object] | None = None,
        download: bool = False,
    ):
        if mode not in _STEMS:
            raise ValueError(f"{type(self).__name__}: mode must be 'train' or 'test'; received {mode!r}.")
        self.mode = mode
        self.transform = transform
        image_path, label_path = self._locate(root, download)
        self.root = image_path.parent
        images = _read_idx(image_path, _IMAGE_MAGIC, self._hint())
        labels = _read_idx(label_path, _LABEL_MAGIC, self._hint())
        if len(images) != len(labels):
            raise DatasetError(
                f"{image_path} holds {len(images)} images but {label_path} holds {len(labels)} labels; "
                f"the two files do not belong together. {self._hint()}",
                label_path,
            )
        self.images = torch.from_numpy(images)  # uint8 [N, 28, 28]
        self.labels = torch.from_numpy(labels.astype(np.int64))  # int64 [N]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index):
        image = self.images[index].unsqueeze(0).to(torch.float32).div_(255.0)
        if self.transform is not None:
            image = self.transform(image)
        return image, self.labels[index]

    def __getitems__(self, indices: list[int]) -> Any:
        """A whole batch in one indexing operation: ``(images [B, 1, 28, 28], labels [B])``.

        The DataLoader calls this with a batch's indices instead of
        ``__getitem__`` per sample. The result is a :class:`hapi.data.Batch`:
        torch-hapi uses its tensors as they are, while a plain DataLoader reads
        it as the list of samples torch expects.
        """
        from hapi.data import Batch  # imported late: reading a data set needs no process machinery

        index = torch.as_tensor(indices, dtype=torch.long)
        images = self.images[index].unsqueeze(1).to(torch.float32).div_(255.0)
        if self.transform is not None:
            images = torch.stack([self.transform(image) for image in images])
        return Batch(images, self.labels[index])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(mode={self.mode!r}, len={len(self)}, root={str(self.root)!r})"

    # -- finding and fetching files -------------------------------------------------

    def _search_dirs(self, root) -> list[Path]:
        if root is not None:
            root = Path(root).expanduser()
            return [root, root / self.name]
        return default_data_dirs(self.name, self.system_dir)

    def _locate(self, root, download: bool) -> tuple[Path, Path]:
        stems = _STEMS[self.mode]
        tried = self._search_dirs(root)
        for directory in tried:
            found = [_find_file(directory, stem) for stem in stems]
            if all(found):
                return found[0], found[1]
        if download:
            return self._download(_download_dir(self.name, root), stems)
        listed = "\n".join(f"  {d}" for d in tried)
        names = " and ".join(f"{s}.gz" for s in stems)
        raise FileNotFoundError(
            f"{type(self).__name__}(mode={self.mode!r}): no directory holds {names} "
            f"(or the same names without .gz). Tried:\n{listed}\n{self._hint()}"
        )

    def _download(self, target: Path, stems) -> tuple[Path, Path]:
        # Imported here so that reading local files never imports the callbacks package.
        from callbacks.files import atomic_write

        paths = []
        for stem in stems:
            existing = _find_file(target, stem)
            if existing is not None:
                paths.append(existing)
                continue
            path = target / f"{stem}.gz"
            magic = _IMAGE_MAGIC if "images" in stem else _LABEL_MAGIC
            urls, last_error = [], None
            for base in self.mirrors:
                url = base.rstrip("/") + f"/{stem}.gz"
                urls.append(url)
                try:
                    with urllib.request.urlopen(url, timeout=self.download_timeout) as response:
                        data = response.read()
                    _parse_idx(data, path, magic, self._hint())  # a bad mirror must not leave a bad file
                except (OSError, DatasetError) as error:  # URLError, HTTPError, timeouts are OSErrors
                    last_error = error
                    continue
                with atomic_write(path, "wb") as handle:
                    handle.write(data)
                break
            else:
                tried = "\n".join(f"  {u}" for u in urls) or "  (no mirrors configured)"
                raise DatasetError(
                    f"{type(self).__name__}: could not download {stem}.gz into {target}. URLs tried:\n"
                    f"{tried}\nLast error: {last_error!r}\n{self._hint(offer_download=False)}",
                    path,
                )
            paths.append(path)
        return paths[0], paths[1]

    def _hint(self, offer_download: bool = True) -> str:
        files = ", ".join(f"{s}.gz" for pair in _STEMS.values() for s in pair)
        return (
            f"To get the data: put the four files ({files}) in $HAPI_DATA_HOME/{self.name}, "
            f"~/.cache/hapi/{self.name} or a directory passed as root="
            + (", or pass download=True." if offer_download else ".")
        )


class FashionMNIST(_IDXDataset):
    """Fashion-MNIST (Zalando): 60,000 training and 10,000 test 28x28 grey images, 10 classes.

    Args:
        root: directory holding the IDX files (also searched: ``root/fashion-mnist``).
            ``None`` searches ``$HAPI_DATA_HOME/fashion-mnist``,
            ``~/.cache/hapi/fashion-mnist`` and ``/usr/share/datasets/fashion-mnist``
            (``apt-get install dataset-fashion-mnist`` on Debian/Ubuntu).
        mode: ``"train"`` or ``"test"``.
        transform: applied to each image, a float32 tensor ``[1, 28, 28]`` in ``[0, 1]``.
        download: fetch missing files from :attr:`mirrors` into ``root`` (or
            ``$HAPI_DATA_HOME/fashion-mnist``, else ``~/.cache/hapi/fashion-mnist``).

    Items are ``(image, label)``: float32 ``[1, 28, 28]`` and an int64 0-d tensor.

    Raises:
        ValueError: ``mode`` is not ``"train"`` or ``"test"``.
        FileNotFoundError: no searched directory holds the files (and ``download=False``).
        DatasetError: a file is corrupt, or a download failed.
    """

    name = "fashion-mnist"
    system_dir = "/usr/share/datasets/fashion-mnist"
    mirrors = [
        "https://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
        "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
    ]
    classes = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
               "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]

    def _hint(self, offer_download: bool = True) -> str:
        return (
            "On Debian/Ubuntu, `apt-get install dataset-fashion-mnist` installs good files in "
            "/usr/share/datasets/fashion-mnist. " + super()._hint(offer_download)
        )


class MNIST(_IDXDataset):
    """MNIST handwritten digits: 60,000 training and 10,000 test 28x28 grey images.

    Same arguments, items and errors as :class:`FashionMNIST`; the directory
    name is ``mnist`` and the system directory ``/usr/share/datasets/mnist``.
    """

    name = "mnist"
    system_dir = "/usr/share/datasets/mnist"
    mirrors = [
        "https://ossci-datasets.s3.amazonaws.com/mnist/",
        "https://storage.googleapis.com/cvdf-datasets/mnist/",
    ]
    classes = [str(digit) for digit in range(10)]


# -- IDX parsing -------------------------------------------------------------------


def _read_idx(path: Path, magic: int, hint: str) -> np.ndarray:
    try:
        data = path.read_bytes()
    except OSError as error:
        raise DatasetError(f"{path}: cannot be read ({error}). {hint}", path) from error
    return _parse_idx(data, path, magic, hint)


def _parse_idx(data: bytes, path: Path, magic: int, hint: str) -> np.ndarray:
    """Decompress (when ``path`` ends in .gz) and check one IDX file; images -> [N, 28, 28], labels -> [N]."""

    def fail(what: str) -> DatasetError:
        return DatasetError(f"{path}: {what}. Delete it and get good files. {hint}", path)

    if str(path).endswith(".gz"):
        if data[:2] != _GZIP_MAGIC:
            raise fail("not a gzip file although its name ends in .gz")
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as error:
            raise fail(f"damaged gzip data ({type(error).__name__}: {str(error) or 'truncated'})") from error
    is_images = magic == _IMAGE_MAGIC
    header = 16 if is_images else 8
    if len(data) < header:
        raise fail(f"only {len(data)} bytes, shorter than the {header}-byte IDX header")
    fields = np.frombuffer(data, dtype=">u4", count=header // 4)
    if int(fields[0]) != magic:
        kind = "image" if is_images else "label"
        raise fail(f"magic number {int(fields[0])}, expected {magic} for an IDX {kind} file")
    count = int(fields[1])
    if is_images and (int(fields[2]), int(fields[3])) != (_SIDE, _SIDE):
        raise fail(f"images are {int(fields[2])}x{int(fields[3])}, expected {_SIDE}x{_SIDE}")
    expected = header + count * (_SIDE * _SIDE if is_images else 1)
    if len(data) != expected:
        raise fail(f"{len(data)} bytes after decompression, but its header ({count} items) implies {expected}")
    array = np.frombuffer(data, dtype=np.uint8, offset=header)
    if is_images:
        return array.reshape(count, _SIDE, _SIDE).copy()  # copy: frombuffer arrays are read-only
    if count and int(array.max()) >= _NUM_CLASSES:
        bad = int(np.argmax(array >= _NUM_CLASSES))
        raise fail(f"label {int(array[bad])} at index {bad}, expected labels 0..{_NUM_CLASSES - 1}")
    return array
