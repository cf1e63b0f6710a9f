"""d2l's multi-GPU chapter (concise implementation): ResNet-18 on Fashion-MNIST.

d2l's slightly modified ResNet-18 for 28x28 single-channel images -- a 3x3
stem convolution with 64 channels, batch norm and ReLU, no max-pool; four
stages of two residual blocks (64, 128, 256, 512 channels; stages 2-4 halve
the resolution and take a 1x1 shortcut convolution); global average pooling;
a linear layer to 10 classes -- with the chapter's initialisation (normal,
std 0.01, for convolution and linear weights) and plain SGD.

The chapter trains on one GPU at batch 256 / lr 0.1, then on two GPUs at
batch 512 / lr 0.2: twice the batch, twice the learning rate (the linear
scaling rule). torch-hapi's ``batch_size`` is per process, so this script
keeps 256 per process and sets the default learning rate to 0.1 x the number
of processes; ``--lr`` overrides it. d2l's ``nn.DataParallel`` (one process
splitting each batch over its GPUs) becomes one process per device, which is
what ``torchrun`` starts::

    python examples/resnet18_fashion.py                                         # batch 256, lr 0.1
    torchrun --standalone --nproc_per_node=2 examples/resnet18_fashion.py       # 2 x 256, lr 0.2

A CPU affords only part of the data set: ``--subset N`` trains on the first
N training images and ``--test-subset N`` evaluates on the first N test
images (both default to everything), e.g.
``python examples/resnet18_fashion.py --subset 2048 --epochs 1``.

Options: ``--data-root DIR``, ``--epochs N`` (default 10, the chapter's),
``--batch-size B`` (per process, default 256), ``--lr LR``, ``--output DIR``
(default ``output/resnet18_fashion``) receives ``model.pt``. Prints one JSON
line on the main process: test ``loss`` and ``acc``, ``seconds_per_epoch``
(training only, as d2l's timer), ``lr``, ``global_batch``, ``world_size``,
``train_images``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset, Subset

from callbacks import Callback
from hapi import Model
from hapi.datasets import FashionMNIST
from hapi.distributed import is_main, world_size
from hapi.metrics import Accuracy


class Residual(nn.Module):
    """d2l's residual block: two 3x3 convolutions with batch norm, plus the input.

    With ``use_1x1conv`` the shortcut is a 1x1 convolution of the same
    stride, so the input matches the block's new channel count and size.
    """

    def __init__(
        self, in_channels: int, out_channels: int, use_1x1conv: bool = False, strides: int = 1
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, stride=strides)
        self.conv2 = nn.Conv2d(out_channels, out_channels, kernel_size=3, padding=1)
        self.conv3 = (
            nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=strides)
            if use_1x1conv
            else None
        )
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.bn2 = nn.BatchNorm2d(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        shortcut = self.conv3(x) if self.conv3 is not None else x
        return F.relu(y + shortcut)


def resnet_stage(
    in_channels: int, out_channels: int, num_residuals: int, first_stage: bool = False
) -> nn.Sequential:
    """Residual blocks; every stage but the first starts by halving the resolution."""
    blocks = []
    for i in range(num_residuals):
        if i == 0 and not first_stage:
            blocks.append(Residual(in_channels, out_channels, use_1x1conv=True, strides=2))
        else:
            blocks.append(Residual(out_channels, out_channels))
    return nn.Sequential(*blocks)


def resnet18(num_classes: int = 10, in_channels: int = 1) -> nn.Sequential:
    """d2l's ResNet-18 variant: a smaller stem (3x3, stride 1) and no max-pool, for 28x28 inputs."""
    net = nn.Sequential(
        nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
    )
    net.add_module("resnet_block1", resnet_stage(64, 64, 2, first_stage=True))
    net.add_module("resnet_block2", resnet_stage(64, 128, 2))
    net.add_module("resnet_block3", resnet_stage(128, 256, 2))
    net.add_module("resnet_block4", resnet_stage(256, 512, 2))
    net.add_module("global_avg_pool", nn.AdaptiveAvgPool2d((1, 1)))
    net.add_module("fc", nn.Sequential(nn.Flatten(), nn.Linear(512, num_classes)))
    return net


def init_weights(module: nn.Module) -> None:
    """The chapter's initialisation: normal weights, std 0.01, for convolutions and linear layers."""
    if type(module) in (nn.Linear, nn.Conv2d):
        nn.init.normal_(module.weight, std=0.01)


class EpochTimer(Callback):
    """Seconds of training per epoch (d2l's timer: evaluation is not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: list[float] = []
        self._started = 0.0

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._started = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.seconds.append(time.perf_counter() - self._started)


def _first(dataset: Dataset, count: int | None, option: str) -> Dataset:
    if count is None:
        return dataset
    if count < 1:
        raise ValueError(f"{option} must be a positive number of images; received {count}.")
    return Subset(dataset, range(min(count, len(dataset))))


def main(argv: list[str] | None = None) -> dict[str, float | int]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", default=None)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=256, help="per process")
    parser.add_argument("--lr", type=float, default=None, help="default: 0.1 x number of processes")
    parser.add_argument(
        "--subset", type=int, default=None, help="train on the first N training images"
    )
    parser.add_argument(
        "--test-subset", type=int, default=None, help="evaluate on the first N test images"
    )
    parser.add_argument("--output", default=os.path.join("output", "resnet18_fashion"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)

    train_dataset = _first(FashionMNIST(root=args.data_root, mode="train"), args.subset, "--subset")
    test_dataset = _first(
        FashionMNIST(root=args.data_root, mode="test"), args.test_subset, "--test-subset"
    )

    network = resnet18(num_classes=10)
    network.apply(init_weights)
    model = Model(network)  # joins the process group when launched on several processes
    processes = world_size()
    lr = (
        args.lr if args.lr is not None else 0.1 * processes
    )  # linear scaling: global batch 256 x processes
    model.prepare(torch.optim.SGD(model.parameters(), lr=lr), nn.CrossEntropyLoss(), Accuracy())

    timer = EpochTimer()
    model.fit(train_dataset, epochs=args.epochs, batch_size=args.batch_size, callbacks=[timer])
    results = model.evaluate(test_dataset, batch_size=args.batch_size)
    model.save(
        os.path.join(args.output, "model"), training=False
    )  # every rank calls it; rank 0 writes
    # Counts stay ints, so the JSON line prints 512, not 512.0.
    results.update(
        seconds_per_epoch=sum(timer.seconds) / len(timer.seconds),
        lr=lr,
        global_batch=args.batch_size * processes,
        world_size=processes,
        train_images=len(train_dataset),
    )
    if is_main():
        print(json.dumps({name: round(value, 4) for name, value in results.items()}), flush=True)
    return results


if __name__ == "__main__":
    main()
