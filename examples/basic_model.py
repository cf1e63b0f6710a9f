"""Paddle's multi-GPU guide, high-level API: examples/basic_loop.py's program on ``hapi.Model``.

The same multilayer perceptron (flatten, linear 784->512, ReLU, dropout 0.2,
linear 512->10), Adam (lr 1e-3), batch 32, shuffled, 5 epochs, a line every
1800 batches, then an evaluation on the Fashion-MNIST test set. Where
``basic_loop.py`` needs its ``# torchrun:`` lines (process group, device,
DistributedDataParallel, DistributedSampler + set_epoch, a test shard per
process, all-reduce of the counts, rank-0 printing), this file needs none:
``Model`` does each of them when it finds several processes. Launch it the
same two ways::

    python examples/basic_model.py
    torchrun --standalone --nproc_per_node=2 examples/basic_model.py

As in Paddle, ``batch_size`` is per process (two processes: global batch 64).
Options: ``--data-root DIR``, ``--epochs N`` (default 5, the seed's),
``--num-iters N`` caps the training batches, ``--output DIR`` (default
``output/basic_model``) receives ``model.pt``. Prints one JSON line (test
``loss``, ``acc``, ``fit_seconds``) on the main process.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch import nn

from hapi import Model
from hapi.datasets import FashionMNIST
from hapi.distributed import is_main
from hapi.metrics import Accuracy

BATCH_SIZE = 32
LEARNING_RATE = 1e-3
PRINT_EVERY = 1800


def seed_network() -> nn.Module:
    """The seed's multilayer perceptron, identical to basic_loop.py's."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, 512),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Linear(512, 10),
    )


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", default=None)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--num-iters", type=int, default=None)
    parser.add_argument("--output", default=os.path.join("output", "basic_model"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)

    train_dataset = FashionMNIST(root=args.data_root, mode="train")
    test_dataset = FashionMNIST(root=args.data_root, mode="test")

    model = Model(seed_network())
    model.prepare(
        torch.optim.Adam(model.parameters(), lr=LEARNING_RATE), nn.CrossEntropyLoss(), Accuracy()
    )
    started = time.perf_counter()
    model.fit(
        train_dataset,
        epochs=args.epochs,
        batch_size=BATCH_SIZE,
        shuffle=True,
        log_freq=PRINT_EVERY,
        num_iters=args.num_iters,
    )
    fit_seconds = time.perf_counter() - started

    results = model.evaluate(test_dataset, batch_size=BATCH_SIZE, log_freq=PRINT_EVERY)
    results["fit_seconds"] = fit_seconds
    model.save(
        os.path.join(args.output, "model"), training=False
    )  # every rank calls it; rank 0 writes
    if is_main():
        print(json.dumps({name: round(value, 4) for name, value in results.items()}), flush=True)
    return results


if __name__ == "__main__":
    main()
