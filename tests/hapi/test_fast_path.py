"""The in-memory fast path: whole batches by index, the same batches as the per-sample path."""

from __future__ import annotations

import torch
from idx_files import make_mnist_dir
from torch.utils.data import DataLoader, Dataset, TensorDataset

from hapi.data import (
    Batch,
    EpochBatches,
    ExplainingCollate,
    TensorBatches,
    make_loader,
    permutation,
    set_epoch,
)
from hapi.datasets import FashionMNIST


class PerSample(Dataset):
    """The same data without __getitems__: the DataLoader's per-sample path."""

    def __init__(self, dataset):
        self.dataset = dataset
        self.calls = 0

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        self.calls += 1
        return self.dataset[index]


def _epochs(loader, epochs=2):
    batches = []
    for epoch in range(epochs):
        set_epoch(loader, epoch)
        batches.append([tuple(t.clone() for t in batch) for batch in loader])
    return batches


def _assert_same(fast, slow):
    assert len(fast) == len(slow)
    for fast_epoch, slow_epoch in zip(fast, slow):
        assert len(fast_epoch) == len(slow_epoch)
        for a, b in zip(fast_epoch, slow_epoch):
            assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_fashion_mnist_batches_equal_the_per_sample_path(tmp_path, monkeypatch):
    data = FashionMNIST(root=str(make_mnist_dir(tmp_path, n_train=100, n_test=10)), mode="train")
    slow_data = PerSample(data)
    fast = _epochs(make_loader(data, role="train_data", batch_size=16, shuffle=True, seed=7))
    slow = _epochs(make_loader(slow_data, role="train_data", batch_size=16, shuffle=True, seed=7))
    _assert_same(fast, slow)
    assert fast[0][0][0].shape == (16, 1, 28, 28) and fast[0][0][0].dtype == torch.float32
    assert slow_data.calls == 200  # the per-sample path called __getitem__ for every sample

    calls = []
    monkeypatch.setattr(FashionMNIST, "__getitem__", lambda self, i: calls.append(i))
    _epochs(make_loader(data, role="train_data", batch_size=16, shuffle=True, seed=7))
    assert calls == []  # the fast path never goes sample by sample


def test_tensors_and_tensor_datasets_take_the_fast_path():
    x, y = torch.randn(50, 3), torch.randint(0, 3, (50,))
    for data in ((x, y), TensorDataset(x, y)):
        loader = make_loader(data, role="train_data", batch_size=8, shuffle=True, seed=3)
        assert isinstance(loader.dataset, TensorBatches)
        fast = _epochs(loader)
        slow = _epochs(
            make_loader(
                PerSample(TensorDataset(x, y)),
                role="train_data",
                batch_size=8,
                shuffle=True,
                seed=3,
            )
        )
        _assert_same(fast, slow)


def test_each_rank_gets_its_shard_as_whole_batches():
    x = torch.arange(20).float().unsqueeze(1)
    data = TensorBatches(x, torch.arange(20))
    seen = []
    for rank in (0, 1):
        batches = EpochBatches(
            permutation(20, True), 20, batch_size=4, seed=5, num_replicas=2, rank=rank
        )
        loader = DataLoader(data, batch_sampler=batches, collate_fn=ExplainingCollate("train_data"))
        seen.append([int(i) for _, labels in loader for i in labels])
    assert sorted(seen[0] + seen[1]) == list(range(20)) and not set(seen[0]) & set(seen[1])


def test_a_batch_still_reads_as_samples_for_a_plain_dataloader(tmp_path):
    data = FashionMNIST(root=str(make_mnist_dir(tmp_path, n_train=20, n_test=4)), mode="test")
    batch = data.__getitems__([0, 2])
    assert isinstance(batch, Batch) and len(batch) == 2
    image, label = batch[1]
    assert torch.equal(image, data[2][0]) and label == data[2][1]
    images, labels = next(iter(DataLoader(data, batch_size=4)))  # torch's default_collate
    assert images.shape == (4, 1, 28, 28) and labels.shape == (4,)


def test_in_memory_data_that_fits_is_batched_on_the_device(monkeypatch):
    # "meta" stands in for a GPU: a batch gathered there proves no per-step host copy.
    from hapi import data as data_module

    monkeypatch.setattr(data_module, "free_device_memory", lambda device: 10**9)
    x, y = torch.randn(40, 3), torch.arange(40)
    loader = make_loader(
        (x, y), role="train_data", batch_size=8, shuffle=True, device=torch.device("meta")
    )
    batches = list(loader)
    assert len(batches) == 5
    assert all(t.device.type == "meta" for batch in batches for t in batch)
    assert loader.pin_memory is False  # device data is never pinned
    assert x.device.type == "cpu"  # the user's tensors stay where they were


def test_data_too_big_for_the_device_stays_on_the_host(monkeypatch):
    from hapi import data as data_module

    x, y = torch.randn(40, 3), torch.arange(40)
    needed = 40 * 3 * 4 + 40 * 8
    monkeypatch.setattr(data_module, "free_device_memory", lambda device: needed * 3)  # over 25%
    batches = list(make_loader((x, y), role="eval_data", batch_size=8, device=torch.device("meta")))
    assert all(t.device.type == "cpu" for batch in batches for t in batch)
    monkeypatch.setattr(data_module, "free_device_memory", lambda device: needed * 4)  # exactly 25%
    batches = list(make_loader((x, y), role="eval_data", batch_size=8, device=torch.device("meta")))
    assert all(t.device.type == "meta" for batch in batches for t in batch)


def test_worker_processes_and_per_sample_data_keep_host_loading(monkeypatch):
    from hapi import data as data_module

    monkeypatch.setattr(data_module, "free_device_memory", lambda device: 10**9)
    x, y = torch.randn(16, 3), torch.arange(16)
    per_sample = PerSample(TensorDataset(x, y))
    batches = list(
        make_loader(per_sample, role="eval_data", batch_size=8, device=torch.device("meta"))
    )
    assert all(t.device.type == "cpu" for batch in batches for t in batch)
    loader = make_loader(
        (x, y), role="eval_data", batch_size=8, num_workers=1, device=torch.device("meta")
    )
    assert all(t.device.type == "cpu" for batch in loader for t in batch)


def test_the_cpu_never_gets_a_data_copy():
    from hapi.data import free_device_memory

    assert free_device_memory(torch.device("cpu")) == 0


def test_hapi_data_sets_are_batched_on_the_device_and_left_in_place(tmp_path, monkeypatch):
    from hapi import data as data_module

    monkeypatch.setattr(data_module, "free_device_memory", lambda device: 10**9)
    make_mnist_dir(tmp_path, n_train=20, n_test=4)
    dataset = FashionMNIST(root=tmp_path, mode="train")
    assert dataset.nbytes == 20 * 28 * 28 + 20 * 8
    images, labels = next(
        iter(make_loader(dataset, role="train_data", batch_size=8, device=torch.device("meta")))
    )
    assert (images.device.type, images.dtype, tuple(images.shape)) == (
        "meta",
        torch.float32,
        (8, 1, 28, 28),
    )
    assert labels.device.type == "meta"
    assert dataset.images.device.type == "cpu"  # the user's data set still reads from the host
