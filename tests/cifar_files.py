"""Test helper: write a small CIFAR-10 *binary* release.

Imported by tests as ``from cifar_files import write_cifar_binary`` (pytest
runs with ``pythonpath = ["tests"]``). The layout is the real release's, only
smaller, so ``hapi.datasets.Cifar10(root=directory)`` reads what this writes.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np

CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
TRAIN_FILES = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
TEST_FILE = "test_batch.bin"
BATCH_DIR = "cifar-10-batches-bin"
TARBALL = "cifar-10-binary.tar.gz"


def cifar_records(images, labels) -> bytes:
    """The bytes of a binary batch: per record, a label byte then the image's red, green and blue planes."""
    images = np.asarray(images, dtype=np.uint8).reshape(len(labels), -1)
    labels = np.asarray(labels, dtype=np.uint8).reshape(-1, 1)
    return np.concatenate([labels, images], axis=1).tobytes()


def make_cifar_images(labels, rng) -> np.ndarray:
    """Learnable 32x32 colour images: class k lights one bright 8x8 cell in one channel, over noise.

    The cell is cell k of a 4x4 grid in channel ``k % 3``; every channel
    carries its own noise, so a reader that swaps channels or transposes
    planes returns different pixels.
    """
    labels = np.asarray(labels)
    images = rng.integers(0, 64, size=(len(labels), 3, 32, 32), dtype=np.uint8)
    for i, label in enumerate(labels):
        row, col = divmod(int(label), 4)
        images[i, int(label) % 3, row * 8 : (row + 1) * 8, col * 8 : (col + 1) * 8] = rng.integers(
            192, 256, size=(8, 8), dtype=np.uint8
        )
    return images


def write_cifar_binary(
    directory,
    *,
    train_per_batch: int = 4,
    test: int = 6,
    as_tarball: bool = False,
    seed: int = 0,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Write a small CIFAR-10 binary release into ``directory`` (created if needed).

    Args:
        directory: where to write. With ``as_tarball=False`` the files go into
            ``directory/cifar-10-batches-bin/`` (what ``tar xzf`` of the real
            tarball gives): ``data_batch_1.bin`` to ``data_batch_5.bin``,
            ``test_batch.bin`` and ``batches.meta.txt``. With ``as_tarball=True``
            the same members go into ``directory/cifar-10-binary.tar.gz``.
        train_per_batch: records in each of the five training batches (>= 1).
        test: records in the test batch (>= 1).
        as_tarball: write the tarball instead of the extracted directory.
        seed: seeds the labels and pixels; the same seed writes the same bytes.

    Returns:
        ``{"train": (images, labels), "test": (images, labels)}``: what
        ``Cifar10(directory, mode=...)`` must hold, images uint8
        ``[N, 3, 32, 32]`` (channels red, green, blue) and labels int64 ``[N]``,
        train being batches 1 to 5 in order. Labels cycle through the ten
        classes (shuffled within each split), and images are
        :func:`make_cifar_images`, which a tiny CNN starts to learn in a few steps.
    """
    for name, value in (("train_per_batch", train_per_batch), ("test", test)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer; received {value!r}.")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    expected = {}
    members: dict[str, bytes] = {}
    for split, count, files in (
        ("train", 5 * train_per_batch, TRAIN_FILES),
        ("test", test, (TEST_FILE,)),
    ):
        labels = rng.permutation(np.arange(count) % 10).astype(np.int64)
        images = make_cifar_images(labels, rng)
        expected[split] = (images, labels)
        per_file = count // len(files)
        for i, name in enumerate(files):
            part = slice(i * per_file, (i + 1) * per_file)
            members[name] = cifar_records(images[part], labels[part])
    members["batches.meta.txt"] = ("\n".join(CLASSES) + "\n\n").encode()
    if as_tarball:
        with tarfile.open(directory / TARBALL, "w:gz", compresslevel=1) as archive:
            directory_entry = tarfile.TarInfo(BATCH_DIR)
            directory_entry.type = tarfile.DIRTYPE
            directory_entry.mode = 0o755
            archive.addfile(directory_entry)
            for name, payload in members.items():
                info = tarfile.TarInfo(f"{BATCH_DIR}/{name}")
                info.size = len(payload)
                info.mode = 0o644
                archive.addfile(info, io.BytesIO(payload))
    else:
        (directory / BATCH_DIR).mkdir(exist_ok=True)
        for name, payload in members.items():
            (directory / BATCH_DIR / name).write_bytes(payload)
    return expected
