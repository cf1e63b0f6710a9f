"""hapi.datasets on small IDX files written here; never the real data, never the network."""

from __future__ import annotations

import functools
import gzip
import http.server
import socket
import struct
import threading
import urllib.request

import numpy as np
import pytest
import torch
from idx_files import FILE_NAMES, make_mnist_dir, write_idx_images, write_idx_labels
from torch.utils.data import DataLoader

from hapi.datasets import MNIST, DatasetError, FashionMNIST, default_data_dirs

CLASSES = [FashionMNIST, MNIST]


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """No test sees the real HOME, $HAPI_DATA_HOME, /usr/share/datasets or a real mirror."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HAPI_DATA_HOME", raising=False)
    for cls in CLASSES:
        monkeypatch.setattr(cls, "system_dir", str(tmp_path / "system" / cls.name))
        monkeypatch.setattr(cls, "mirrors", [])


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the network must not be used here")

    monkeypatch.setattr(urllib.request, "urlopen", refuse)


@pytest.fixture
def server(tmp_path):
    """A local HTTP server over a fresh make_mnist_dir; yields its base URL."""
    served = make_mnist_dir(tmp_path / "served", n_train=20, n_test=10, seed=3)
    handler = functools.partial(QuietHandler, directory=str(served))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(
        target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=5)


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def closed_port_url() -> str:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}/"


# -- items ------------------------------------------------------------------------


@pytest.mark.parametrize("cls", CLASSES)
def test_items_shapes_dtypes_and_range(cls, tmp_path):
    data = cls(make_mnist_dir(tmp_path / "d"), mode="train")
    assert len(data) == 64
    image, label = data[0]
    assert image.shape == (1, 28, 28) and image.dtype == torch.float32
    assert 0.0 <= image.min() and image.max() <= 1.0 and image.max() > 0.7
    assert label.dtype == torch.int64 and label.dim() == 0 and 0 <= int(label) < 10
    assert data.images.shape == (64, 28, 28) and data.images.dtype == torch.uint8
    assert data.labels.shape == (64,) and data.labels.dtype == torch.int64
    assert torch.equal(data[5][0], data.images[5].unsqueeze(0).float() / 255)
    assert sorted(set(data.labels.tolist())) == list(range(10))


def test_mode_train_and_test_read_their_own_files(tmp_path):
    root = make_mnist_dir(tmp_path / "d", n_train=30, n_test=12)
    assert len(FashionMNIST(root, mode="train")) == 30
    assert len(FashionMNIST(root, mode="test")) == 12


def test_values_round_trip(tmp_path):
    images = np.arange(3 * 28 * 28, dtype=np.int64).reshape(3, 28, 28).astype(np.uint8)
    write_idx_images(tmp_path / "t10k-images-idx3-ubyte.gz", images)
    write_idx_labels(tmp_path / "t10k-labels-idx1-ubyte.gz", np.array([7, 0, 9]))
    data = MNIST(tmp_path, mode="test")
    assert np.array_equal(data.images.numpy(), images)
    assert data.labels.tolist() == [7, 0, 9]
    assert data[-1][0][0, 0, 0] == pytest.approx(images[2, 0, 0] / 255)


def test_raw_files_and_gz_preferred(tmp_path):
    raw = np.full((2, 28, 28), 10, dtype=np.uint8)
    write_idx_images(tmp_path / "train-images-idx3-ubyte", raw)
    write_idx_labels(tmp_path / "train-labels-idx1-ubyte", np.array([1, 2]))
    assert FashionMNIST(tmp_path).labels.tolist() == [1, 2]
    write_idx_images(tmp_path / "train-images-idx3-ubyte.gz", raw + 1)
    write_idx_labels(tmp_path / "train-labels-idx1-ubyte.gz", np.array([3, 4]))
    data = FashionMNIST(tmp_path)
    assert data.labels.tolist() == [3, 4] and int(data.images[0, 0, 0]) == 11


def test_transform_applied_to_image(tmp_path):
    data = FashionMNIST(make_mnist_dir(tmp_path / "d"), transform=lambda x: x * 2 - 1)
    image, _ = data[0]
    assert image.min() < 0 and torch.equal(image, data.images[0].unsqueeze(0).float() / 255 * 2 - 1)


def test_dataloader_batches(tmp_path):
    data = FashionMNIST(make_mnist_dir(tmp_path / "d"))
    images, labels = next(iter(DataLoader(data, batch_size=16, shuffle=True)))
    assert images.shape == (16, 1, 28, 28) and images.dtype == torch.float32
    assert labels.shape == (16,) and labels.dtype == torch.int64


def test_bad_mode_is_value_error(tmp_path):
    with pytest.raises(ValueError, match="'valid'"):
        FashionMNIST(make_mnist_dir(tmp_path / "d"), mode="valid")


# -- where files are found --------------------------------------------------------


@pytest.mark.parametrize("cls", CLASSES)
def test_root_and_root_subdirectory(cls, tmp_path):
    make_mnist_dir(tmp_path / "root" / cls.name, n_train=14)
    data = cls(tmp_path / "root")
    assert len(data) == 14 and data.root == tmp_path / "root" / cls.name
    assert len(cls(str(tmp_path / "root" / cls.name))) == 14


def test_search_order_data_home_then_cache_then_system(tmp_path, monkeypatch):
    name = FashionMNIST.name
    make_mnist_dir(tmp_path / "system" / name, n_train=11)
    assert len(FashionMNIST()) == 11
    make_mnist_dir(tmp_path / "home" / ".cache" / "hapi" / name, n_train=12)
    assert len(FashionMNIST()) == 12
    monkeypatch.setenv("HAPI_DATA_HOME", str(tmp_path / "data_home"))
    assert len(FashionMNIST()) == 12  # variable set, but no files there yet
    make_mnist_dir(tmp_path / "data_home" / name, n_train=13)
    assert len(FashionMNIST()) == 13
    assert default_data_dirs(name, FashionMNIST.system_dir) == [
        tmp_path / "data_home" / name,
        tmp_path / "home" / ".cache" / "hapi" / name,
        tmp_path / "system" / name,
    ]


def test_directory_needs_both_files_of_the_mode(tmp_path, monkeypatch):
    half = tmp_path / "home" / ".cache" / "hapi" / "mnist"
    make_mnist_dir(half, n_train=12)
    (half / "train-labels-idx1-ubyte.gz").unlink()
    make_mnist_dir(tmp_path / "system" / "mnist", n_train=11)
    assert len(MNIST()) == 11
    assert len(MNIST(mode="test")) == 32  # the half-full directory still has the test pair


def test_root_given_does_not_search_defaults(tmp_path):
    make_mnist_dir(tmp_path / "home" / ".cache" / "hapi" / "fashion-mnist")
    with pytest.raises(FileNotFoundError):
        FashionMNIST(tmp_path / "empty")


def test_missing_lists_every_path_tried(tmp_path, monkeypatch, no_network):
    monkeypatch.setenv("HAPI_DATA_HOME", str(tmp_path / "dh"))
    with pytest.raises(FileNotFoundError) as info:
        FashionMNIST(mode="test")
    message = str(info.value)
    for tried in default_data_dirs("fashion-mnist", FashionMNIST.system_dir):
        assert str(tried) in message
    assert "t10k-images-idx3-ubyte.gz" in message
    assert "apt-get install dataset-fashion-mnist" in message and "download=True" in message
    with pytest.raises(FileNotFoundError) as info:
        MNIST(tmp_path / "r")
    assert str(tmp_path / "r") in str(info.value) and str(tmp_path / "r" / "mnist") in str(
        info.value
    )


# -- corrupt files ----------------------------------------------------------------


def _gz(payload: bytes) -> bytes:
    return gzip.compress(payload, mtime=0)


def _images_payload(n=4, rows=28, cols=28, magic=2051) -> bytes:
    return struct.pack(">IIII", magic, n, rows, cols) + bytes(n * rows * cols)


def _labels_payload(labels=(1, 2, 3, 4), magic=2049) -> bytes:
    return struct.pack(">II", magic, len(labels)) + bytes(labels)


CORRUPT = {
    "bad image magic": ("images", _gz(_images_payload(magic=2049)), "magic number 2049"),
    "bad label magic": ("labels", _gz(_labels_payload(magic=2051)), "magic number 2051"),
    "wrong image size": ("images", _gz(_images_payload(rows=32, cols=32)), "32x32"),
    "truncated payload": ("images", _gz(_images_payload()[:-100]), "header"),
    "too long payload": ("labels", _gz(_labels_payload() + b"\0"), "header"),
    "short header": ("labels", _gz(b"\0\0\x08"), "header"),
    "truncated gzip": ("images", _gz(_images_payload())[:-30], "gzip"),
    "bad crc": (
        "labels",
        _gz(_labels_payload())[:-8] + b"\0\0\0\0" + _gz(_labels_payload())[-4:],
        "gzip",
    ),
    "not gzip": ("images", _images_payload(), "not a gzip file"),
    "label out of range": ("labels", _gz(_labels_payload((1, 12, 3, 4))), "label 12 at index 1"),
    "count mismatch": ("labels", _gz(_labels_payload((1, 2, 3))), "4 images but"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_corrupt_file_names_file_and_fix(case, tmp_path):
    kind, content, expected = CORRUPT[case]
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(_gz(_images_payload()))
    (tmp_path / "train-labels-idx1-ubyte.gz").write_bytes(_gz(_labels_payload()))
    bad = tmp_path / f"train-{kind}-idx{3 if kind == 'images' else 1}-ubyte.gz"
    bad.write_bytes(content)
    with pytest.raises(DatasetError) as info:
        FashionMNIST(tmp_path)
    message = str(info.value)
    assert str(bad) in message and info.value.path == str(bad)
    assert expected in message
    assert "apt-get install dataset-fashion-mnist" in message
    assert isinstance(info.value, RuntimeError)


def test_corrupt_raw_file(tmp_path):
    (tmp_path / "t10k-images-idx3-ubyte").write_bytes(_images_payload()[:500])
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(_labels_payload())
    with pytest.raises(DatasetError, match="t10k-images-idx3-ubyte: 500 bytes"):
        MNIST(tmp_path, mode="test")


# -- download ---------------------------------------------------------------------


def test_no_download_when_files_exist(tmp_path, no_network):
    root = make_mnist_dir(tmp_path / "d")
    assert len(FashionMNIST(root, download=True)) == 64


@pytest.mark.parametrize("cls", CLASSES)
def test_download_into_root(cls, tmp_path, server, monkeypatch):
    monkeypatch.setattr(cls, "mirrors", [closed_port_url(), server])  # first mirror is down
    root = tmp_path / "fresh"
    data = cls(root, mode="test", download=True)
    assert len(data) == 10 and data.root == root
    assert sorted(p.name for p in root.iterdir()) == [
        "t10k-images-idx3-ubyte.gz",
        "t10k-labels-idx1-ubyte.gz",
    ]
    assert (root / "t10k-images-idx3-ubyte.gz").read_bytes() == (
        tmp_path / "served" / FILE_NAMES[2]
    ).read_bytes()


def test_download_into_data_home_then_found_without_download(tmp_path, server, monkeypatch):
    monkeypatch.setattr(FashionMNIST, "mirrors", [server])
    monkeypatch.setenv("HAPI_DATA_HOME", str(tmp_path / "dh"))
    assert len(FashionMNIST(download=True)) == 20
    assert (tmp_path / "dh" / "fashion-mnist" / "train-images-idx3-ubyte.gz").is_file()
    monkeypatch.setattr(FashionMNIST, "mirrors", [])
    assert len(FashionMNIST()) == 20


def test_download_into_home_cache(tmp_path, server, monkeypatch):
    monkeypatch.setattr(MNIST, "mirrors", [server])
    MNIST(download=True)
    assert (
        tmp_path / "home" / ".cache" / "hapi" / "mnist" / "train-labels-idx1-ubyte.gz"
    ).is_file()


def test_download_failure_names_urls(tmp_path, monkeypatch):
    url = closed_port_url()
    monkeypatch.setattr(FashionMNIST, "mirrors", [url])
    with pytest.raises(DatasetError) as info:
        FashionMNIST(tmp_path / "r", download=True)
    message = str(info.value)
    assert url + "train-images-idx3-ubyte.gz" in message
    assert "refused" in message.lower() or "URLError" in message
    assert "apt-get install dataset-fashion-mnist" in message
    assert not (tmp_path / "r" / "train-images-idx3-ubyte.gz").exists()


def test_download_rejects_bad_content(tmp_path, server, monkeypatch):
    served = tmp_path / "served"
    (served / "train-images-idx3-ubyte.gz").write_bytes(b"<html>not found</html>")
    monkeypatch.setattr(MNIST, "mirrors", [server])
    with pytest.raises(DatasetError, match="not a gzip file"):
        MNIST(tmp_path / "r", download=True)
    assert not (tmp_path / "r" / "train-images-idx3-ubyte.gz").exists()
