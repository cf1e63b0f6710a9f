"""Data path: ``Model.fit`` on hapi's FashionMNIST (whole batches by index) against a
hand-written loop over a torchvision-style per-sample view of the same images
(``__getitem__`` through PIL and ``ToTensor``, then default collate), and against the
same loop over hapi's own cheaper per-sample ``__getitem__``, and against the limit of
any data path: the hand loop taking whole batches by index from the images in memory
(a fresh permutation each epoch, no DataLoader). Targets: ``Model.fit`` at most 0.80x the
torchvision-style hand loop's time, and within 3% of the index-batch limit.

    python benchmarks/bench_datapath.py [--repeats 5] [--samples 12800]
"""

from __future__ import annotations

import statistics

import torch
from common import (
    BATCH,
    PerSampleView,
    TorchvisionStyleView,
    hand_loop,
    index_batch,
    interleave,
    lenet_and_adam,
    setup,
    table,
    timed,
)
from torch import nn
from torch.utils.data import DataLoader

from hapi import Model
from hapi.data import make_loader

BASELINE = "hand loop, torchvision-style view"
LIMIT = "hand loop, whole batches by index (the limit)"
FIT = "Model.fit on hapi FashionMNIST"


def index_batches(data):
    """The data path's floor: each batch is one indexing of the uint8 images and one
    conversion to float, in a fresh random order each epoch."""

    def run():
        network, optimizer = lenet_and_adam()
        order = torch.randperm(len(data))
        hand_loop(network, optimizer, (index_batch(data, index) for index in order.split(BATCH)))

    return run


def main() -> None:
    repeats, data = setup()
    views = {
        BASELINE: TorchvisionStyleView(data),
        "hand loop, hapi per-sample __getitem__": PerSampleView(data),
    }

    def hand(view):
        def run():
            network, optimizer = lenet_and_adam()
            hand_loop(network, optimizer, DataLoader(view, batch_size=BATCH, shuffle=True))

        return run

    def fit():
        network, optimizer = lenet_and_adam()
        model = Model(network)
        model.prepare(optimizer, nn.CrossEntropyLoss())
        model.fit(data, batch_size=BATCH, epochs=1, verbose=0)

    contenders = {name: hand(view) for name, view in views.items()}
    contenders[LIMIT] = index_batches(data)
    contenders[FIT] = fit
    times = interleave(contenders, repeats)
    print(table(times, BASELINE, f"Data path: one epoch, {len(data)} images, batch {BATCH}"))
    to_limit = [fit / limit for fit, limit in zip(times[FIT], times[LIMIT])]
    print(
        f"\nModel.fit vs the index-batch limit, per repeat: median {statistics.median(to_limit):.3f}x "
        f"(target <= 1.03x; repeats {', '.join(f'{ratio:.3f}' for ratio in to_limit)})"
    )
    loading = {
        f"{name}, loading only".replace("hand loop, ", ""): (
            lambda view=view: [None for _ in DataLoader(view, batch_size=BATCH, shuffle=True)]
        )
        for name, view in views.items()
    }
    loading["hapi loader, loading only"] = lambda: [
        None for _ in make_loader(data, role="train_data", batch_size=BATCH, shuffle=True)
    ]
    print()
    print(
        table(
            {name: [timed(run) for _ in range(repeats)] for name, run in loading.items()},
            next(iter(loading)),
            "Loading alone (no training)",
        )
    )


if __name__ == "__main__":
    main()
