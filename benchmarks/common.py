"""Shared pieces of the benchmarks: the LeNet setup of Paddle's high-level-API guide, real data, timing and tables.

Every benchmark runs its contenders interleaved in one process (A, B, A, B, ...)
and reports medians, so slow drifts of a noisy machine hit both alike.
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import sys
import time
from typing import Callable

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from hapi.datasets import FashionMNIST
from hapi.models import LeNet

BATCH = 64


def real_train_data(samples: int | None = 12_800) -> FashionMNIST:
    """Real Fashion-MNIST (apt-get install dataset-fashion-mnist), cut to ``samples``."""
    data = FashionMNIST(mode="train")
    if samples is not None:
        data.images, data.labels = data.images[:samples], data.labels[:samples]
    return data


class TorchvisionStyleView(Dataset):
    """The same images served as torchvision's ``FashionMNIST`` + ``ToTensor()`` serve them.

    What a hand-written loop gets from torchvision (not installable on this CPU
    machine): per ``__getitem__``, the uint8 image becomes a PIL image, then
    ``ToTensor`` copies it back to an array, makes a float tensor ``[1, 28, 28]``
    in [0, 1], and the label is a Python ``int``; the DataLoader's default
    collate then stacks 64 of them.
    """

    def __init__(self, data: FashionMNIST) -> None:
        self.images, self.labels = data.images, data.labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        from PIL import Image  # Pillow comes with visualdl

        picture = Image.fromarray(self.images[index].numpy(), mode="L")
        pixels = torch.from_numpy(np.array(picture, copy=True)).view(28, 28, 1)
        return pixels.permute(2, 0, 1).contiguous().to(torch.float32).div(255), int(
            self.labels[index]
        )


class PerSampleView(Dataset):
    """hapi's own ``__getitem__``, one sample at a time (no PIL round trip)."""

    def __init__(self, data: FashionMNIST) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        return self.data[index]


def setup(repeats: int = 5) -> tuple[int, FashionMNIST]:
    """The benchmarks' command line (``--repeats``, ``--samples``) and their data."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--samples", type=int, default=12_800)
    args = parser.parse_args()
    return args.repeats, real_train_data(args.samples)


def lenet_and_adam(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    network = LeNet()
    return network, torch.optim.Adam(network.parameters(), lr=1e-3)


def index_batch(data: FashionMNIST, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch at ``index`` taken the cheapest way a hand loop can: one indexing of the
    uint8 images, one conversion to float in [0, 1] (the floor of any data path)."""
    return data.images[index].unsqueeze(1).to(torch.float32).div_(255.0), data.labels[index]


def hand_loop(network: nn.Module, optimizer: torch.optim.Optimizer, loader) -> None:
    """The plain PyTorch loop a user writes by hand (loss only)."""
    loss_fn = nn.CrossEntropyLoss()
    network.train()
    for images, labels in loader:
        loss = loss_fn(network(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def timed(run: Callable[[], None]) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def interleave(contenders: dict[str, Callable[[], None]], repeats: int) -> dict[str, list[float]]:
    """Seconds per run of each contender, run in turns ``repeats`` times (after one warm-up round)."""
    for run in contenders.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, run in contenders.items():
            times[name].append(timed(run))
    return times


def table(times: dict[str, list[float]], baseline: str, title: str) -> str:
    """Medians and their ratio; also the best runs' ratio, which a noisy machine disturbs least."""
    base, base_best = statistics.median(times[baseline]), min(times[baseline])
    lines = [
        f"## {title}",
        "",
        f"machine: {machine()}",
        "",
        "| contender | median s | runs (s) | ratio of medians | ratio of best runs |",
        "|---|---|---|---|---|",
    ]
    for name, values in times.items():
        median = statistics.median(values)
        runs = ", ".join(f"{v:.2f}" for v in values)
        lines.append(
            f"| {name} | {median:.3f} | {runs} | {median / base:.3f} | {min(values) / base_best:.3f} |"
        )
    return "\n".join(lines)


def machine() -> str:
    return (
        f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, Python {sys.version.split()[0]}"
    )


@contextlib.contextmanager
def quiet_stdout():
    """Progress output goes to /dev/null: we time the work of producing it, not the terminal."""
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        yield


def wide_mlp(width: int) -> nn.Module:
    """The large-checkpoint benchmarks' network: 25.2 M parameters at width 4096 (1024 -> 10)."""
    return nn.Sequential(
        nn.Linear(1024, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, 1024),
        nn.ReLU(),
        nn.Linear(1024, 10),
    )
