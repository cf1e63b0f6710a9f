"""Paddle Fleet's data-parallel quick start: a small CNN on CIFAR-10, your own DataLoader.

The quick start's network -- conv 3->32 (k3), ReLU, max-pool 2; conv 32->64
(k3), ReLU, max-pool 2; conv 64->64 (k3), ReLU; flatten 1024 -> linear 64 ->
ReLU -> linear 10 -- with Adam (lr 1e-3), batch 32, 10 epochs and an
evaluation after each epoch. Fleet's five steps (import fleet,
``fleet.init``, ``distributed_model``, ``distributed_optimizer``, a loader on
a ``DistributedBatchSampler``) shrink to one here: the training loader is
still your own ``DataLoader`` on a distributed batch sampler, and
``Model.fit`` uses it as given -- it calls the sampler's ``set_epoch`` each
epoch, so every epoch reshuffles, alike on all processes. The network, the
optimizer and the process group need no change (``Model`` does them).

One difference from the seed: its validation loader also uses a
``DistributedBatchSampler``, which pads or (with ``drop_last``) drops test
images, so its accuracy is not quite the test set's. Here the validation
loader is a plain ``DataLoader``; torch-hapi splits it over the processes
with every test image counted exactly once.

Launch::

    python examples/cifar10_fleet.py
    torchrun --standalone --nproc_per_node=2 examples/cifar10_fleet.py
    torchrun --nnodes=2 --nproc_per_node=4 --rdzv-backend=c10d \\
        --rdzv-endpoint=192.168.1.2:29400 --rdzv-id=cifar examples/cifar10_fleet.py  # on each machine

Data: CIFAR-10's *binary* release, ``cifar-10-binary.tar.gz`` from
https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz (163 MiB), the
tarball itself or its extracted ``cifar-10-batches-bin`` directory, in
``--data-root DIR`` or in ``$HAPI_DATA_HOME/cifar-10`` /
``~/.cache/hapi/cifar-10`` (``hapi.datasets.Cifar10``).

Options: ``--epochs N`` (default 10, the seed's), ``--num-iters N`` caps the
training batches, ``--num-workers N`` (default 2, the seed's), ``--output
DIR`` (default ``output/cifar10_fleet``) receives ``model.pt``. Prints one
JSON line on the main process: the last evaluation's ``loss`` and ``acc``,
``val_acc_history`` and ``val_loss_history`` (one value per epoch, the
seed's lists) and ``fit_seconds``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Sized

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from hapi import Model
from hapi.datasets import Cifar10
from hapi.distributed import is_main, rank, world_size
from hapi.metrics import Accuracy

BATCH_SIZE = 32
LEARNING_RATE = 1e-3


class MyNet(nn.Module):
    """The quick start's network, for 3x32x32 images (32 -> 30 -> 15 -> 13 -> 6 -> 4: 64x4x4 = 1024)."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, kernel_size=3)
        self.pool1 = nn.MaxPool2d(kernel_size=2, stride=2)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3)
        self.pool2 = nn.MaxPool2d(kernel_size=2, stride=2)
        self.conv3 = nn.Conv2d(64, 64, kernel_size=3)
        self.flatten = nn.Flatten()
        self.linear1 = nn.Linear(1024, 64)
        self.linear2 = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool1(F.relu(self.conv1(x)))
        x = self.pool2(F.relu(self.conv2(x)))
        x = F.relu(self.conv3(x))
        x = F.relu(self.linear1(self.flatten(x)))
        return self.linear2(x)


class DistributedBatchSampler(BatchSampler):
    """Paddle's ``DistributedBatchSampler`` on torch: this process's shard of the data, in batches.

    A ``DistributedSampler`` picks the shard (all ranks shuffle with the same
    seed, so the shards never overlap); ``BatchSampler`` groups it. The
    ``set_epoch`` method is what makes it distributed-aware for torch-hapi:
    ``Model.fit`` keeps a loader whose batch sampler has one, and calls it at
    the start of each epoch, so each epoch gets a fresh shuffle.
    """

    def __init__(
        self,
        dataset: Sized,
        batch_size: int,
        num_replicas: int,
        rank: int,
        shuffle: bool = False,
        drop_last: bool = False,
        seed: int = 0,
    ) -> None:
        shard = DistributedSampler(
            dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed
        )
        super().__init__(shard, batch_size, drop_last)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)


def main(argv: list[str] | None = None) -> dict[str, float | list[float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", default=None)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--num-iters", type=int, default=None)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--output", default=os.path.join("output", "cifar10_fleet"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.num_workers < 0:
        parser.error(f"--num-workers must be 0 or more; received {args.num_workers}.")
    torch.manual_seed(args.seed)

    # Model first: it joins the process group, so rank() and world_size() are known below.
    model = Model(MyNet(num_classes=10))
    model.prepare(
        torch.optim.Adam(model.parameters(), lr=LEARNING_RATE), nn.CrossEntropyLoss(), Accuracy()
    )

    cifar10_train = Cifar10(root=args.data_root, mode="train")
    cifar10_test = Cifar10(root=args.data_root, mode="test")
    train_sampler = DistributedBatchSampler(
        cifar10_train,
        BATCH_SIZE,
        num_replicas=world_size(),
        rank=rank(),
        shuffle=True,
        drop_last=True,
        seed=args.seed,
    )
    train_loader = DataLoader(
        cifar10_train, batch_sampler=train_sampler, num_workers=args.num_workers
    )
    valid_loader = DataLoader(cifar10_test, batch_size=BATCH_SIZE, num_workers=args.num_workers)

    started = time.perf_counter()
    history = model.fit(
        train_loader,
        eval_data=valid_loader,
        epochs=args.epochs,
        num_iters=args.num_iters,
        log_freq=1000,
    )
    fit_seconds = time.perf_counter() - started
    model.save(
        os.path.join(args.output, "model"), training=False
    )  # every rank calls it; rank 0 writes

    val_acc_history, val_loss_history = history.history["val_acc"], history.history["val_loss"]
    results: dict[str, float | list[float]] = {
        "loss": val_loss_history[-1],
        "acc": val_acc_history[-1],
        "val_acc_history": val_acc_history,
        "val_loss_history": val_loss_history,
        "fit_seconds": fit_seconds,
    }
    if is_main():
        print(
            json.dumps(
                {
                    name: [round(v, 4) for v in value]
                    if isinstance(value, list)
                    else round(value, 4)
                    for name, value in results.items()
                }
            ),
            flush=True,
        )
    return results


if __name__ == "__main__":
    main()
