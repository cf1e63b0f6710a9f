"""FSDP with torch-hapi: each process holds 1/N of the weights, gradients and Adam's state.

A small residual MLP on a generated data set (no download), sharded block by
block with ``hapi.FSDP(wrap={Block})``, trained, evaluated and saved as a
sharded checkpoint (each process writes its own shards)::

    torchrun --standalone --nproc_per_node=2 examples/fsdp_train.py --save ckpt/fsdp

The checkpoint loads on any number of processes and under any strategy; on
one process, with no training, it evaluates to the same figures::

    python examples/fsdp_train.py --load ckpt/fsdp --epochs 0

Prints one JSON line on the main process: the number of processes, whether
the weights are sharded, the evaluation's figures and the parameter bytes
this process holds.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn

import hapi


class Block(nn.Module):
    """One residual block: the unit FSDP gathers and frees as a whole."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.linear(self.norm(x)))


def make_network(width: int = 64, depth: int = 4) -> nn.Module:
    return nn.Sequential(
        nn.Linear(8, width), *[Block(width) for _ in range(depth)], nn.Linear(width, 3)
    )


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=generator)
    return x, x[:, :3].argmax(dim=1)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--save", default=None, help="write a sharded checkpoint here")
    parser.add_argument("--load", default=None, help="load this checkpoint before training")
    args = parser.parse_args(argv)

    hapi.seed_everything(0)
    model = hapi.Model(make_network(), device="cpu")
    model.prepare(
        torch.optim.Adam(model.parameters(), lr=1e-3),
        nn.CrossEntropyLoss(),
        strategy=hapi.FSDP(wrap={Block}),  # on one process: plain training
    )
    if args.load:
        model.load(args.load)
    if args.epochs:
        model.fit(make_data(512, seed=1), batch_size=args.batch_size, epochs=args.epochs, verbose=0)
    figures = model.evaluate(make_data(128, seed=2), batch_size=args.batch_size, verbose=0)
    if args.save:
        model.save(args.save, sharded=True)

    # What this process holds: a shard of each parameter under FSDP on several processes.
    held = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
        for p in model.network.parameters()
    )
    results = {
        "processes": hapi.distributed.world_size(),
        "sharded": model.sharded,
        "loss": round(figures["loss"], 5),
        "parameter_bytes_here": held,
    }
    if hapi.distributed.is_main():
        print(json.dumps(results), flush=True)
    return results


if __name__ == "__main__":
    main()
