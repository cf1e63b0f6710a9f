"""Paddle's test/legacy_test/test_model.py, its data parts, translated to torch-hapi.

Datasets and DataLoaders as fit/evaluate/predict inputs, ``fit(batch_size=(train, eval))``,
``num_iters``, loaders over a ``DistributedBatchSampler``, and inputs/labels given as lists
or tuples of specs. paddle.nn -> torch.nn; ``InputSpec`` lists -> their counts (torch-hapi
reads a list's length); the static-graph twins of each case are dropped (no static graph in
torch). Paddle's MNIST subset (1280 images) becomes a learnable synthetic set of 28x28 images
small enough for a fast test; Paddle's ``DistributedBatchSampler(dataset, batch_size,
num_replicas, rank)`` becomes torch's ``BatchSampler(DistributedSampler(dataset, num_replicas,
rank, shuffle=False), batch_size, drop_last=False)``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler

from callbacks import Callback
from hapi import Model
from hapi.metrics import Accuracy
from hapi.models import LeNet  # Paddle's paddle.vision.models.LeNet

SEED = 555  # Paddle's


class MnistDataset(Dataset):
    """Paddle's MnistDataset(mode, return_label, sample_num): ``(image, label)`` or ``(image,)``.

    Synthetic 28x28 images whose class sets which band of rows is bright, plus noise; NumPy
    samples as Paddle's are. Labels are scalars (torch's CrossEntropyLoss takes [N], Paddle's
    [N, 1]).
    """

    def __init__(self, mode: str, return_label: bool = True, sample_num: int = 192) -> None:
        generator = np.random.default_rng(0 if mode == "train" else 1)
        self.labels = generator.integers(0, 10, sample_num).astype(np.int64)
        self.images = generator.normal(0.0, 0.1, (sample_num, 28, 28)).astype(np.float32)
        for image, label in zip(self.images, self.labels):
            image[2 + 2 * label : 4 + 2 * label] += 3.0
        self.return_label = return_label

    def __getitem__(self, idx: int):
        image = np.reshape(self.images[idx], [1, 28, 28])
        if self.return_label:
            return image, np.array(self.labels[idx]).astype("int64")
        return (image,)

    def __len__(self) -> int:
        return len(self.images)


def compute_acc(pred: np.ndarray, label: np.ndarray) -> float:
    return float(np.mean(np.argmax(pred, -1) == label))


def dynamic_train(model: nn.Module, dataloader: DataLoader) -> None:
    optim = torch.optim.Adam(model.parameters(), lr=0.001)
    model.train()
    for inputs, labels in dataloader:
        loss = nn.CrossEntropyLoss(reduction="sum")(model(inputs), labels)
        loss.backward()
        optim.step()
        optim.zero_grad()


def dynamic_evaluate(model: nn.Module, dataloader: DataLoader) -> float:
    with torch.no_grad():
        model.eval()
        correct = sum(
            int((model(inputs).argmax(-1) == labels).sum()) for inputs, labels in dataloader
        )
    return correct / len(dataloader.dataset)


@pytest.fixture(scope="module")
def setup():
    """TestModel.setUpClass: a hand-trained LeNet, its accuracy, its weights."""
    train_dataset = MnistDataset(mode="train")
    val_dataset = MnistDataset(mode="test")
    test_dataset = MnistDataset(mode="test", return_label=False)
    torch.manual_seed(SEED)
    dy_lenet = LeNet()
    dynamic_train(dy_lenet, DataLoader(train_dataset, batch_size=64))
    acc1 = dynamic_evaluate(dy_lenet, DataLoader(val_dataset, batch_size=64))
    assert acc1 > 0.2  # it learned something, so the comparisons below mean something
    return {
        "train": train_dataset,
        "val": val_dataset,
        "test": test_dataset,
        "acc1": acc1,
        "weights": {k: v.clone() for k, v in dy_lenet.state_dict().items()},
    }


class Steps(Callback):
    def __init__(self) -> None:
        super().__init__()
        self.train = self.eval = 0

    def on_train_batch_end(self, step, logs=None):
        self.train += 1

    def on_eval_batch_end(self, step, logs=None):
        self.eval += 1


def _loader(dataset: Dataset, num_replicas: int | None, rank: int | None) -> DataLoader:
    """Paddle's DataLoader over a DistributedBatchSampler; torch's DistributedSampler needs the
    count and rank given when no process group exists (Paddle reads them from its environment)."""
    sampler = DistributedSampler(
        dataset, num_replicas=num_replicas or 1, rank=rank or 0, shuffle=False
    )
    return DataLoader(dataset, batch_sampler=BatchSampler(sampler, 64, drop_last=False))


def _fit(setup, num_replicas, rank, num_iters, inputs, labels):
    torch.manual_seed(SEED)
    model = Model(LeNet(), inputs=inputs, labels=labels)
    model.prepare(
        torch.optim.Adam(model.parameters(), lr=0.001),
        loss=nn.CrossEntropyLoss(reduction="sum"),
        metrics=Accuracy(),
    )
    model.fit(setup["train"], batch_size=64, shuffle=False, verbose=0)
    result = model.evaluate(setup["val"], batch_size=64, verbose=0)
    np.testing.assert_allclose(result["acc"], setup["acc1"])

    steps = Steps()
    model.fit(setup["train"], batch_size=64, shuffle=False, num_iters=num_iters, verbose=0)
    result = model.evaluate(
        setup["val"], batch_size=64, num_iters=num_iters, callbacks=[steps], verbose=0
    )
    assert steps.eval == (num_iters or 3)

    steps = Steps()
    model.fit(
        setup["train"],
        eval_data=setup["val"],
        batch_size=(64, 64),
        shuffle=False,
        callbacks=[steps],
        verbose=0,
    )
    assert (steps.train, steps.eval) == (3, 3)

    steps = Steps()
    train_loader = _loader(setup["train"], num_replicas, rank)
    val_loader = _loader(setup["val"], num_replicas, rank)
    model.fit(train_loader, val_loader, callbacks=[steps], verbose=0)
    share = 2 if num_replicas is None else 1  # rank 0 of 2 reads half the batches
    assert (steps.train, steps.eval) == (share + 1, share + 1)


@pytest.mark.parametrize(
    "num_replicas, rank, num_iters",
    [(None, None, None), (2, 0, None), (None, None, 1)],
    ids=["fit", "fit_with_rank", "fit_with_num_iters"],
)
def test_fit(setup, num_replicas, rank, num_iters):
    """TestModel.test_fit_dygraph, test_fit_dynamic_with_rank, test_fit_dynamic_with_num_iters:
    fit a Dataset (its accuracy is the hand loop's), again with num_iters, with batch_size as a
    (train, eval) pair, and with DataLoaders over a DistributedBatchSampler.

    Paddle only runs the later fits; the step counts are asserted here."""
    _fit(setup, num_replicas, rank, num_iters, inputs=[1], labels=[1])


def test_fit_with_tuple_input(setup):
    """TestModel.test_fit_dynamic_with_tuple_input: inputs and labels given as tuples."""
    _fit(setup, None, None, None, inputs=("image",), labels=("label",))


def test_evaluate(setup):
    """TestModel.test_evaluate_dygraph: a loaded model evaluates a Dataset to the hand loop's
    accuracy, and a DataLoader over a DistributedBatchSampler."""
    model = Model(LeNet(), inputs=[1], labels=[1])
    model.prepare(metrics=Accuracy())
    model.network.load_state_dict(setup["weights"])
    result = model.evaluate(setup["val"], batch_size=64, verbose=0)
    np.testing.assert_allclose(result["acc"], setup["acc1"])
    result = model.evaluate(_loader(setup["val"], None, None), verbose=0)
    np.testing.assert_allclose(result["acc"], setup["acc1"])


def test_predict(setup):
    """TestModel.test_predict_dygraph: predictions for a Dataset without labels, stacked, one
    row per sample, scoring the hand loop's accuracy.

    Paddle then calls evaluate() on a loader of that label-less data with no loss and no
    metric; torch-hapi's evaluate() needs something to compute, so the loader is predicted
    instead (the same batches, read through a DistributedBatchSampler)."""
    model = Model(LeNet(), inputs=[1])
    model.prepare()
    model.network.load_state_dict(setup["weights"])
    output = model.predict(setup["test"], batch_size=64, stack_outputs=True, verbose=0)
    np.testing.assert_equal(output[0].shape[0], len(setup["test"]))
    acc = compute_acc(output[0].numpy(), setup["val"].labels)
    np.testing.assert_allclose(acc, setup["acc1"])
    (again,) = model.predict(_loader(setup["test"], None, None), stack_outputs=True, verbose=0)
    assert torch.equal(again, output[0])


def test_predict_without_inputs(setup):
    """TestModel.test_predict_without_inputs: a Model given no inputs predicts a Dataset."""
    model = Model(LeNet())
    model.prepare()
    model.network.load_state_dict(setup["weights"])
    output = model.predict(setup["test"], batch_size=64, stack_outputs=True, verbose=0)
    np.testing.assert_equal(output[0].shape[0], len(setup["test"]))
