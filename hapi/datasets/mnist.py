"""MNIST and Fashion-MNIST from their IDX files (gzip'ed or raw); see :mod:`hapi.datasets`."""

from __future__ import annotations

import functools
import gzip
import math
import zlib
from pathlib import Path

import numpy as np

from hapi.datasets import base

_IMAGE_MAGIC = 2051  # 0x00000803: unsigned bytes, 3 dimensions
_LABEL_MAGIC = 2049  # 0x00000801: unsigned bytes, 1 dimension
_SIDE = 28
_STEMS = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def _find_file(directory: Path, stem: str) -> Path | None:
    """``stem.gz`` (preferred) or ``stem`` in ``directory``, or ``None``."""
    return next((p for p in (directory / f"{stem}.gz", directory / stem) if p.is_file()), None)


class _IDXDataset(base.ImageDataset):
    """Shared reader for MNIST-format data sets; subclasses set the class attributes."""

    _get_files = (
        f"put the four files ({', '.join(f'{s}.gz' for pair in _STEMS.values() for s in pair)})"
    )

    def _load(self, root, download: bool) -> tuple[np.ndarray, np.ndarray, Path]:
        """The image and label files of the first directory searched that holds both (else
        fetched), checked."""
        stems = _STEMS[self.mode]
        tried = self._search_dirs(root)
        found = next((ps for d in tried if all(ps := [_find_file(d, s) for s in stems])), None)
        if found is None and not download:
            names = " and ".join(f"{s}.gz" for s in stems)
            raise self._not_found(f"no directory holds {names} (.gz or not)", tried)
        if found is None:
            target = tried[0]
            for stem, magic in zip(stems, (_IMAGE_MAGIC, _LABEL_MAGIC)):
                if _find_file(target, stem) is None:
                    self._fetch(f"{stem}.gz", target, functools.partial(_parse_idx, magic=magic))
            found = [_find_file(target, stem) for stem in stems]
        image_path, label_path = found
        images = _parse_idx(image_path.read_bytes(), image_path, _IMAGE_MAGIC)
        labels = _parse_idx(label_path.read_bytes(), label_path, _LABEL_MAGIC)
        if len(images) != len(labels):
            raise base.DatasetError(
                f"{image_path} holds {len(images)} images but {label_path} holds {len(labels)} "
                "labels; the two files do not belong together.",
                label_path,
            )
        return images, labels, image_path.parent


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
    classes = "T-shirt/top,Trouser,Pullover,Dress,Coat,Sandal,Shirt,Sneaker,Bag,Ankle boot".split(
        ","
    )

    def _hint(self, offer_download: bool = True) -> str:
        return (
            "On Debian/Ubuntu, `apt-get install dataset-fashion-mnist` installs good files in "
            "/usr/share/datasets/fashion-mnist. " + super()._hint(offer_download)
        )


class MNIST(_IDXDataset):
    """MNIST handwritten digits: 60,000 training and 10,000 test 28x28 grey images.

    Same items and errors as :class:`FashionMNIST`; the directory name is
    ``mnist`` and the system directory ``/usr/share/datasets/mnist``.

    Args:
        root: directory holding the IDX files (also searched: ``root/mnist``).
            ``None`` searches ``$HAPI_DATA_HOME/mnist``, ``~/.cache/hapi/mnist``
            and ``/usr/share/datasets/mnist``.
        mode: ``"train"`` or ``"test"``.
        transform: applied to each image, a float32 tensor ``[1, 28, 28]`` in ``[0, 1]``.
        download: fetch missing files from :attr:`mirrors` into ``root`` (or
            ``$HAPI_DATA_HOME/mnist``, else ``~/.cache/hapi/mnist``).

    Raises:
        ValueError: ``mode`` is not ``"train"`` or ``"test"``.
        FileNotFoundError: no searched directory holds the files (and ``download=False``).
        DatasetError: a file is corrupt, or a download failed.
    """

    name = "mnist"
    system_dir = "/usr/share/datasets/mnist"
    mirrors = [
        "https://ossci-datasets.s3.amazonaws.com/mnist/",
        "https://storage.googleapis.com/cvdf-datasets/mnist/",
    ]
    classes = [str(digit) for digit in range(10)]


def _parse_idx(data: bytes, path: Path, magic: int) -> np.ndarray:
    """Decompress (when ``path`` ends in .gz) and check one IDX file; images -> [N, 28, 28], labels -> [N]."""
    if str(path).endswith(".gz"):
        if data[:2] != base.GZIP_MAGIC:
            raise base.bad_file(path, "not a gzip file although its name ends in .gz")
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as error:
            raise base.bad_file(path, f"damaged gzip data {base.damaged(error)}") from error
    item = (_SIDE, _SIDE) if magic == _IMAGE_MAGIC else ()  # an image's shape, or a label's
    header = 8 + 4 * len(item)
    if len(data) < header:
        what = f"only {len(data)} bytes, shorter than the {header}-byte IDX header"
        raise base.bad_file(path, what)
    magic_read, count, *dims = (int(f) for f in np.frombuffer(data, ">u4", count=header // 4))
    if magic_read != magic:
        what = f"magic number {magic_read}, expected {magic} for an IDX {'image' if item else 'label'} file"
        raise base.bad_file(path, what)
    if dims != list(item):
        raise base.bad_file(path, f"images are {dims[0]}x{dims[1]}, expected {_SIDE}x{_SIDE}")
    expected = header + count * math.prod(item)
    if len(data) != expected:
        what = f"{len(data)} bytes after decompression, but its header ({count} items) implies {expected}"
        raise base.bad_file(path, what)
    array = np.frombuffer(data, dtype=np.uint8, offset=header).reshape(count, *item)
    bad = np.flatnonzero(array > 9) if not item else []
    if len(bad):
        raise base.bad_file(path, f"label {array[bad[0]]} at index {bad[0]}, expected labels 0..9")
    return array.copy()  # frombuffer arrays are read-only
