"""Test helpers: write small MNIST-format (IDX) files.

Imported by tests as ``from idx_files import make_mnist_dir`` (pytest runs with
``pythonpath = ["tests"]``). Files whose name ends in ``.gz`` are gzip'ed.
"""

from __future__ import annotations

import gzip
import os
import struct
from pathlib import Path

import numpy as np

IMAGE_MAGIC = 2051
LABEL_MAGIC = 2049
FILE_NAMES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)


def _write(path, payload: bytes) -> None:
    path = os.fspath(path)
    if path.endswith(".gz"):
        payload = gzip.compress(payload, compresslevel=1, mtime=0)
    with open(path, "wb") as handle:
        handle.write(payload)


def write_idx_images(path, images) -> None:
    """Write a uint8 array ``[N, rows, cols]`` as an IDX3 image file."""
    images = np.asarray(images)
    if images.dtype != np.uint8 or images.ndim != 3:
        raise ValueError(
            f"images must be a uint8 array [N, rows, cols]; got {images.dtype} {images.shape}"
        )
    header = struct.pack(">IIII", IMAGE_MAGIC, *images.shape)
    _write(path, header + np.ascontiguousarray(images).tobytes())


def write_idx_labels(path, labels) -> None:
    """Write an integer array ``[N]`` (values 0..255) as an IDX1 label file."""
    labels = np.asarray(labels)
    if (
        labels.ndim != 1
        or labels.dtype.kind not in "iu"
        or (labels.size and (labels.min() < 0 or labels.max() > 255))
    ):
        raise ValueError(
            f"labels must be a 1-d integer array with values 0..255; got {labels.dtype} {labels.shape}"
        )
    header = struct.pack(">II", LABEL_MAGIC, len(labels))
    _write(path, header + labels.astype(np.uint8).tobytes())


def make_images(labels, rng) -> np.ndarray:
    """Learnable 28x28 images: class k lights a bright 7x7 cell of a 4x4 grid, over dim noise."""
    labels = np.asarray(labels)
    images = rng.integers(0, 64, size=(len(labels), 28, 28), dtype=np.uint8)
    for i, label in enumerate(labels):
        row, col = divmod(int(label), 4)
        cell = rng.integers(192, 256, size=(7, 7), dtype=np.uint8)
        images[i, row * 7 : (row + 1) * 7, col * 7 : (col + 1) * 7] = cell
    return images


def make_mnist_dir(directory, n_train: int = 64, n_test: int = 32, seed: int = 0) -> Path:
    """Write the four gzip'ed MNIST files into ``directory`` (created if needed) and return it.

    Labels cycle through all ten classes (shuffled), so every class appears
    once ``n >= 10``; images are :func:`make_images`, which a tiny CNN learns
    in a few steps.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = rng.permutation(np.arange(n) % 10).astype(np.uint8)
        write_idx_images(directory / f"{prefix}-images-idx3-ubyte.gz", make_images(labels, rng))
        write_idx_labels(directory / f"{prefix}-labels-idx1-ubyte.gz", labels)
    return directory
