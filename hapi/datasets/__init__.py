"""MNIST, Fashion-MNIST and CIFAR-10 as map-style datasets, read from their standard files.

MNIST and Fashion-MNIST are four IDX files each, gzip'ed (``.gz``, preferred) or raw::

    train-images-idx3-ubyte  train-labels-idx1-ubyte
    t10k-images-idx3-ubyte   t10k-labels-idx1-ubyte

CIFAR-10 is its *binary* release, ``cifar-10-binary.tar.gz``, read either as
the tarball itself (no extraction) or as the extracted
``cifar-10-batches-bin/`` directory: ``data_batch_1.bin`` to
``data_batch_5.bin`` (train) and ``test_batch.bin`` (test), each a run of
3073-byte records (a label byte, then the red, green and blue 32x32 planes).
The Python release is refused: its batches are pickles.

Where the files are looked for (the first directory holding what the
``mode`` needs wins):

- ``root`` given: ``root``, then ``root/<name>``;
- ``root=None``: ``$HAPI_DATA_HOME/<name>`` (when the variable is set),
  ``~/.cache/hapi/<name>``, then the system directory
  (``/usr/share/datasets/<name>``, where Debian's ``dataset-fashion-mnist``
  package installs real Fashion-MNIST),

with ``<name>`` ``"fashion-mnist"``, ``"mnist"`` or ``"cifar-10"``. CIFAR-10
also looks in each directory's ``cifar-10-batches-bin/`` and then for its
``cifar-10-binary.tar.gz``. Nothing is ever downloaded unless ``download=True``.

A whole file is parsed in one ``np.frombuffer`` call and stored once, as
``self.images`` (uint8: ``[N, 28, 28]`` for the grey sets, ``[N, 3, 32, 32]``
for CIFAR-10) and ``self.labels`` (int64 ``[N]``); items are converted to
float32 in ``[0, 1]`` (divided by 255, nothing else) on access, and
``__getitems__`` converts a whole batch at once. Every check a file must pass
(gzip and tar integrity, IDX magic number, dimensions, payload length, label
range, image and label counts, the files a CIFAR-10 split needs) fails with
:class:`DatasetError`, whose message names the file, what is wrong, and how to
get good files. A data set that is not there at all raises
``FileNotFoundError`` listing every directory tried.
"""

from hapi.datasets.base import DatasetError, default_data_dirs
from hapi.datasets.cifar import Cifar10
from hapi.datasets.mnist import MNIST, FashionMNIST

__all__ = ["Cifar10", "DatasetError", "FashionMNIST", "MNIST", "default_data_dirs"]
