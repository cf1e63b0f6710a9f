"""N processes at batch b train like one process at batch N*b: see it on your machine.

A small classifier on a fixed, generated data set (no download), SGD, shuffled,
two epochs; then ``evaluate`` on held-out data. Run it once on one process at
the global batch and once on two processes at half of it::

    python examples/global_batch.py --batch-size 32
    torchrun --standalone --nproc_per_node=2 examples/global_batch.py --batch-size 16

Both print the same JSON line (the main process prints it): the evaluation's
figures and a checksum of the trained weights agree to about 1e-6, the last
bits of float32 sums added in another order. Nothing in the file knows how
many processes run it.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn

import hapi
from hapi.metrics import Accuracy


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Four features; the class is the index of the largest of the first three."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=generator)
    return x, x[:, :3].argmax(dim=1)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args(argv)

    hapi.seed_everything(0)  # the same network and shuffling on every process
    network = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    model = hapi.Model(network, device="cpu")
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), Accuracy())
    model.fit(make_data(256, seed=1), batch_size=args.batch_size, epochs=args.epochs, verbose=0)
    figures = model.evaluate(make_data(100, seed=2), batch_size=args.batch_size, verbose=0)

    weights = torch.cat([p.detach().flatten() for p in model.network.parameters()])
    results = {
        "processes": hapi.distributed.world_size(),
        "global_batch": args.batch_size * hapi.distributed.world_size(),
        **{name: round(value, 6) for name, value in figures.items()},
        "weights_sum": round(weights.sum().item(), 6),
        "weights_abs_sum": round(weights.abs().sum().item(), 6),
    }
    if hapi.distributed.is_main():
        print(json.dumps(results), flush=True)
    return results


if __name__ == "__main__":
    main()
