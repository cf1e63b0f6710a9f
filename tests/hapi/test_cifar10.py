"""hapi.datasets.Cifar10 on small binary batches written here; never the real data, never the network."""

from __future__ import annotations

import io
import tarfile
import urllib.request

import numpy as np
import pytest
import torch
from cifar_files import (
    BATCH_DIR,
    CLASSES,
    TARBALL,
    TEST_FILE,
    TRAIN_FILES,
    cifar_records,
    write_cifar_binary,
)
from torch import nn
from torch.utils.data import DataLoader

from hapi import Model
from hapi.data import Batch
from hapi.datasets import Cifar10, DatasetError, default_data_dirs

URL = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz"


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """No test sees the real HOME, $HAPI_DATA_HOME, /usr/share/datasets or a real mirror."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HAPI_DATA_HOME", raising=False)
    monkeypatch.setattr(Cifar10, "system_dir", str(tmp_path / "system" / "cifar-10"))
    monkeypatch.setattr(Cifar10, "mirrors", [])


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the network must not be used here")

    monkeypatch.setattr(urllib.request, "urlopen", refuse)


def _pack(path, entries, compress=True):
    """A tarball of ``(name, payload)`` entries; payload None is a directory, ("symlink", target) a link."""
    with tarfile.open(path, "w:gz" if compress else "w") as archive:
        for name, payload in entries:
            info = tarfile.TarInfo(name)
            if payload is None:
                info.type = tarfile.DIRTYPE
                archive.addfile(info)
            elif isinstance(payload, tuple):
                info.type, info.linkname = tarfile.SYMTYPE, payload[1]
                archive.addfile(info)
            else:
                info.size = len(payload)
                archive.addfile(info, io.BytesIO(payload))
    return path


def _release_members(tmp_path):
    """The members of a good small release, as (member name, bytes), in the real archive's naming."""
    write_cifar_binary(tmp_path / "src", train_per_batch=2, test=3)
    names = [*TRAIN_FILES, TEST_FILE, "batches.meta.txt"]
    return [(BATCH_DIR, None)] + [
        (f"{BATCH_DIR}/{n}", (tmp_path / "src" / BATCH_DIR / n).read_bytes()) for n in names
    ]


# -- items ------------------------------------------------------------------------


@pytest.mark.parametrize("as_tarball", [False, True], ids=["extracted", "tarball"])
@pytest.mark.parametrize("mode", ["train", "test"])
def test_pixels_and_labels_round_trip(tmp_path, mode, as_tarball):
    expected = write_cifar_binary(
        tmp_path, train_per_batch=3, test=5, as_tarball=as_tarball, seed=1
    )
    data = Cifar10(tmp_path, mode=mode)
    images, labels = expected[mode]
    assert len(data) == (15 if mode == "train" else 5)
    assert data.images.dtype == torch.uint8 and data.images.shape == (len(data), 3, 32, 32)
    assert data.labels.dtype == torch.int64 and data.labels.shape == (len(data),)
    assert np.array_equal(data.images.numpy(), images) and np.array_equal(
        data.labels.numpy(), labels
    )
    image, label = data[-1]
    assert image.dtype == torch.float32 and image.shape == (3, 32, 32)
    assert torch.equal(image, torch.from_numpy(images[-1]).float() / 255)
    assert label.dtype == torch.int64 and label.dim() == 0 and int(label) == labels[-1]
    assert data.root == (tmp_path if as_tarball else tmp_path / BATCH_DIR)
    assert data.classes == CLASSES and len(data.classes) == 10


def test_channel_order_red_green_blue_row_major(tmp_path):
    red = (np.arange(1024) % 251).astype(np.uint8)
    green = np.full(1024, 100, np.uint8)
    blue = np.full(1024, 3, np.uint8)
    blue[33] = 200  # row 1, column 1
    (tmp_path / TEST_FILE).write_bytes(
        bytes([7]) + red.tobytes() + green.tobytes() + blue.tobytes()
    )
    data = Cifar10(tmp_path, mode="test")
    assert data.labels.tolist() == [7]
    assert np.array_equal(data.images[0, 0].numpy(), red.reshape(32, 32))
    assert int(data.images[0, 0, 1, 0]) == 32 and int(data.images[0, 0, 0, 1]) == 1  # row-major
    assert (data.images[0, 1] == 100).all()
    assert int(data.images[0, 2, 1, 1]) == 200 and int(data.images[0, 2].sum()) == 200 + 3 * 1023
    assert data[0][0][2, 1, 1] == pytest.approx(200 / 255)


def test_train_is_batches_one_to_five_in_order(tmp_path):
    for i, name in enumerate(TRAIN_FILES):
        images = np.full((2, 3, 32, 32), 10 * (i + 1), np.uint8)
        (tmp_path / name).write_bytes(cifar_records(images, [i, 9 - i]))
    data = Cifar10(
        tmp_path
    )  # the .bin files directly in root, no test_batch.bin needed for mode="train"
    assert data.labels.tolist() == [0, 9, 1, 8, 2, 7, 3, 6, 4, 5]
    assert data.images[:, 1, 5, 5].tolist() == [10, 10, 20, 20, 30, 30, 40, 40, 50, 50]
    assert data.root == tmp_path


def test_getitems_is_the_stacked_items_with_transform(tmp_path):
    write_cifar_binary(tmp_path, train_per_batch=4)
    for transform in (None, lambda x: x * 2 - 1):
        data = Cifar10(tmp_path, transform=transform)
        batch = data.__getitems__([5, 0, 19, 5])
        assert isinstance(batch, Batch)
        images, labels = batch.tensors
        assert images.shape == (4, 3, 32, 32) and images.dtype == torch.float32
        assert torch.equal(images, torch.stack([data[i][0] for i in (5, 0, 19, 5)]))
        assert torch.equal(labels, torch.stack([data[i][1] for i in (5, 0, 19, 5)]))
    assert images.min() < 0 and torch.equal(data[3][0], data.images[3].float() / 255 * 2 - 1)


def test_plain_dataloader_batches(tmp_path):
    write_cifar_binary(tmp_path, train_per_batch=4)
    images, labels = next(iter(DataLoader(Cifar10(tmp_path), batch_size=8, shuffle=True)))
    assert images.shape == (8, 3, 32, 32) and images.dtype == torch.float32
    assert labels.shape == (8,) and labels.dtype == torch.int64


def test_bad_mode_and_single_file_root(tmp_path):
    write_cifar_binary(tmp_path)
    with pytest.raises(ValueError, match="'valid'"):
        Cifar10(tmp_path, mode="valid")
    with pytest.raises(ValueError, match="one batch file.*pass the directory"):
        Cifar10(tmp_path / BATCH_DIR / "data_batch_1.bin")


# -- where files are found --------------------------------------------------------


def test_search_order_data_home_then_cache_then_system(tmp_path, monkeypatch, no_network):
    write_cifar_binary(tmp_path / "system" / "cifar-10", train_per_batch=1, as_tarball=True)
    assert len(Cifar10()) == 5
    write_cifar_binary(tmp_path / "home" / ".cache" / "hapi" / "cifar-10", train_per_batch=2)
    assert len(Cifar10()) == 10
    monkeypatch.setenv("HAPI_DATA_HOME", str(tmp_path / "dh"))
    assert len(Cifar10()) == 10  # variable set, but no files there yet
    write_cifar_binary(tmp_path / "dh" / "cifar-10", train_per_batch=3, as_tarball=True)
    assert len(Cifar10()) == 15
    write_cifar_binary(
        tmp_path / "dh" / "cifar-10", train_per_batch=4
    )  # extracted beside the tarball: wins
    assert len(Cifar10()) == 20
    assert default_data_dirs("cifar-10", Cifar10.system_dir) == [
        tmp_path / "dh" / "cifar-10",
        tmp_path / "home" / ".cache" / "hapi" / "cifar-10",
        tmp_path / "system" / "cifar-10",
    ]


def test_root_forms(tmp_path):
    write_cifar_binary(tmp_path / "r" / "cifar-10", train_per_batch=2, as_tarball=True)
    assert len(Cifar10(tmp_path / "r")) == 10  # root/cifar-10/cifar-10-binary.tar.gz
    assert len(Cifar10(tmp_path / "r" / "cifar-10" / TARBALL)) == 10  # the tarball itself
    write_cifar_binary(tmp_path / "x", train_per_batch=1)
    assert len(Cifar10(str(tmp_path / "x" / BATCH_DIR))) == 5  # the extracted directory itself


def test_root_given_does_not_search_defaults(tmp_path):
    write_cifar_binary(tmp_path / "home" / ".cache" / "hapi" / "cifar-10")
    with pytest.raises(FileNotFoundError):
        Cifar10(tmp_path / "empty")


def test_missing_lists_every_path_tried(tmp_path, monkeypatch, no_network):
    monkeypatch.setenv("HAPI_DATA_HOME", str(tmp_path / "dh"))
    with pytest.raises(FileNotFoundError) as info:
        Cifar10(mode="test")
    message = str(info.value)
    for base in default_data_dirs("cifar-10", Cifar10.system_dir):
        for tried in (base, base / BATCH_DIR, base / TARBALL):
            assert f"  {tried}\n" in message
    assert "test_batch.bin" in message and URL in message and "download=True" in message


# -- the Python release -----------------------------------------------------------


def test_python_release_tarball_as_root(tmp_path):
    (tmp_path / "cifar-10-python.tar.gz").write_bytes(b"\x1f\x8b whatever")
    with pytest.raises(DatasetError) as info:
        Cifar10(tmp_path / "cifar-10-python.tar.gz")
    message = str(info.value)
    assert "cifar-10-python.tar.gz: this is the CIFAR-10 Python release" in message
    assert URL in message and info.value.path == str(tmp_path / "cifar-10-python.tar.gz")


@pytest.mark.parametrize(
    "layout", ["root holds cifar-10-batches-py", "root is cifar-10-batches-py"]
)
def test_python_release_directory(tmp_path, layout):
    python_dir = tmp_path / "cifar-10-batches-py"
    python_dir.mkdir()
    for name in ("data_batch_1", "test_batch", "batches.meta"):
        (python_dir / name).write_bytes(b"\x80\x04pickle")
    root = tmp_path if layout.startswith("root holds") else python_dir
    with pytest.raises(DatasetError, match="Python release.*binary release") as info:
        Cifar10(root)
    assert str(python_dir) in str(info.value) and URL in str(info.value)


def test_python_release_inside_a_binary_named_tarball(tmp_path):
    _pack(
        tmp_path / TARBALL,
        [("cifar-10-batches-py", None), ("cifar-10-batches-py/data_batch_1", b"x")],
    )
    with pytest.raises(DatasetError, match="Python release"):
        Cifar10(tmp_path)


def test_binary_release_further_down_the_search_wins_over_python_release(tmp_path):
    (tmp_path / "home" / ".cache" / "hapi" / "cifar-10" / "cifar-10-batches-py").mkdir(parents=True)
    write_cifar_binary(tmp_path / "system" / "cifar-10", train_per_batch=1, as_tarball=True)
    assert len(Cifar10()) == 5


# -- corrupt files ----------------------------------------------------------------


def _extracted(tmp_path, edit):
    write_cifar_binary(tmp_path, train_per_batch=2, test=3)
    return edit(tmp_path / BATCH_DIR)


def _rewrite(path, edit):
    path.write_bytes(edit(path.read_bytes()))
    return path


def _with_label(data: bytes, record: int, label: int) -> bytes:
    data = bytearray(data)
    data[record * 3073] = label
    return bytes(data)


def _tarball(tmp_path, change, compress=True):
    entries = change(_release_members(tmp_path))
    return _pack(tmp_path / TARBALL, entries, compress)


def _replace(name, payload):
    return lambda entries: [(n, payload if n == f"{BATCH_DIR}/{name}" else p) for n, p in entries]


def _regzip(tmp_path, edit):
    path = _tarball(tmp_path, lambda e: e)
    return _rewrite(path, edit)


def _flip_middle(data: bytes) -> bytes:
    data = bytearray(data)
    data[len(data) // 2] ^= 0xFF
    return bytes(data)


# case -> (mode, builder(tmp_path) -> the file the message must name, expected text)
CORRUPT = {
    "length not a multiple": (
        "train",
        lambda t: _extracted(
            t, lambda d: _rewrite(d / "data_batch_2.bin", lambda b: b[:3073] + b"\0\0")
        ),
        "length 3075 is not a multiple of 3073 bytes per record",
    ),
    "label out of range": (
        "train",
        lambda t: _extracted(
            t, lambda d: _rewrite(d / "data_batch_4.bin", lambda b: _with_label(b, 1, 12))
        ),
        "record 1 has label 12 outside 0..9",
    ),
    "missing batch": (
        "train",
        lambda t: _extracted(
            t, lambda d: (d / "data_batch_3.bin").unlink() or (d / "data_batch_3.bin")
        ),
        "data_batch_3.bin: missing",
    ),
    "empty batch": (
        "test",
        lambda t: _extracted(t, lambda d: _rewrite(d / TEST_FILE, lambda b: b"")),
        "empty, expected records of 3073 bytes",
    ),
    "not gzip": ("train", lambda t: _tarball(t, lambda e: e, compress=False), "not a gzip file"),
    "truncated gzip": (
        "train",
        lambda t: _regzip(t, lambda b: b[:-20]),
        "damaged gzip or tar data",
    ),
    "bad gzip crc": (
        "test",
        lambda t: _regzip(t, lambda b: b[:-8] + bytes(4) + b[-4:]),
        "damaged gzip or tar data",
    ),
    "corrupt deflate data": (
        "test",
        lambda t: _regzip(t, _flip_middle),
        "damaged gzip or tar data",
    ),
    "member missing": (
        "train",
        lambda t: _tarball(t, lambda e: [x for x in e if not x[0].endswith("batch_3.bin")]),
        f"member {BATCH_DIR}/data_batch_3.bin missing from the archive",
    ),
    "unexpected member": (
        "test",
        lambda t: _tarball(t, lambda e: e + [("../evil.bin", b"x")]),
        "unexpected member '../evil.bin'",
    ),
    "symlink member": (
        "train",
        lambda t: _tarball(t, _replace("data_batch_1.bin", ("link", "/etc/passwd"))),
        f"member {BATCH_DIR}/data_batch_1.bin is not a regular file",
    ),
    "duplicate member": (
        "test",
        lambda t: _tarball(t, lambda e: e + [e[-2]]),
        f"member {BATCH_DIR}/test_batch.bin appears twice",
    ),
    "member length": (
        "train",
        lambda t: _tarball(t, _replace("data_batch_5.bin", bytes(3073 * 2 - 1))),
        f"(member {BATCH_DIR}/data_batch_5.bin): length 6145 is not a multiple of 3073",
    ),
    "member label": (
        "test",
        lambda t: _tarball(t, _replace(TEST_FILE, _with_label(bytes(3073), 0, 255))),
        f"(member {BATCH_DIR}/test_batch.bin): record 0 has label 255 outside 0..9",
    ),
}


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_corrupt_file_names_file_problem_and_fix(case, tmp_path):
    mode, build, expected = CORRUPT[case]
    bad = build(tmp_path)
    with pytest.raises(DatasetError) as info:
        Cifar10(tmp_path, mode=mode)
    message = str(info.value)
    assert message.startswith(str(bad)) and info.value.path == str(bad)
    assert expected in message
    assert URL in message
    assert isinstance(info.value, RuntimeError)


# -- download (file:// mirrors: never the network) ---------------------------------


@pytest.fixture
def served(tmp_path):
    """A directory holding a good small tarball, and mirrors that serve it (the first one is dead)."""
    expected = write_cifar_binary(
        tmp_path / "served", train_per_batch=2, test=4, as_tarball=True, seed=5
    )
    mirrors = [(tmp_path / "nowhere").as_uri() + "/", (tmp_path / "served").as_uri() + "/"]
    return tmp_path / "served", mirrors, expected


def test_no_download_when_files_exist(tmp_path, no_network):
    write_cifar_binary(tmp_path)
    assert len(Cifar10(tmp_path, download=True)) == 20


def test_download_into_root_then_read_without_download(tmp_path, served, monkeypatch):
    directory, mirrors, expected = served
    monkeypatch.setattr(Cifar10, "mirrors", mirrors)
    data = Cifar10(tmp_path / "fresh", mode="test", download=True)
    assert (
        np.array_equal(data.images.numpy(), expected["test"][0]) and data.root == tmp_path / "fresh"
    )
    assert sorted(p.name for p in (tmp_path / "fresh").iterdir()) == [TARBALL]
    assert (tmp_path / "fresh" / TARBALL).read_bytes() == (directory / TARBALL).read_bytes()
    monkeypatch.setattr(Cifar10, "mirrors", [])
    assert np.array_equal(Cifar10(tmp_path / "fresh").labels.numpy(), expected["train"][1])


def test_download_into_data_home(tmp_path, served, monkeypatch):
    monkeypatch.setattr(Cifar10, "mirrors", served[1])
    monkeypatch.setenv("HAPI_DATA_HOME", str(tmp_path / "dh"))
    assert len(Cifar10(download=True)) == 10
    assert (tmp_path / "dh" / "cifar-10" / TARBALL).is_file()


def test_download_failure_names_urls(tmp_path, monkeypatch):
    url = (tmp_path / "nowhere").as_uri() + "/"
    monkeypatch.setattr(Cifar10, "mirrors", [url])
    with pytest.raises(DatasetError) as info:
        Cifar10(tmp_path / "r", download=True)
    assert url + TARBALL in str(info.value) and "download=True" not in str(info.value)
    assert not (tmp_path / "r" / TARBALL).exists()


@pytest.mark.parametrize("content", ["html page", "bad train batch"])
def test_download_rejects_bad_content_for_either_mode(tmp_path, served, monkeypatch, content):
    directory, mirrors, _ = served
    if content == "html page":
        (directory / TARBALL).write_bytes(b"<html>not found</html>")
        expected = "not a gzip file"
    else:  # the tarball serves both modes, so a bad train batch is refused even for mode="test"
        _pack(directory / TARBALL, _replace("data_batch_2.bin", b"\0")(_release_members(tmp_path)))
        expected = "length 1 is not a multiple"
    monkeypatch.setattr(Cifar10, "mirrors", mirrors[1:])
    with pytest.raises(DatasetError, match=expected):
        Cifar10(tmp_path / "r", mode="test", download=True)
    assert not (tmp_path / "r" / TARBALL).exists()


# -- training ---------------------------------------------------------------------


def test_model_fit_and_evaluate_on_cifar10(tmp_path, monkeypatch):
    write_cifar_binary(tmp_path, train_per_batch=4, test=6)
    train, test = Cifar10(tmp_path), Cifar10(tmp_path, mode="test")
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )
    model = Model(net, device="cpu")
    model.prepare(torch.optim.Adam(model.parameters(), lr=1e-2), nn.CrossEntropyLoss())
    calls = []
    monkeypatch.setattr(Cifar10, "__getitem__", lambda self, i: calls.append(i))
    history = model.fit(train, batch_size=8, epochs=1, num_iters=2, verbose=0)
    assert calls == []  # whole batches through __getitems__, never sample by sample
    assert len(history.history["loss"]) == 1 and np.isfinite(history.history["loss"][0])
    logs = model.evaluate(test, batch_size=4, verbose=0)
    assert np.isfinite(logs["loss"])
    assert model.predict(test, batch_size=4, stack_outputs=True, verbose=0)[0].shape == (6, 10)
