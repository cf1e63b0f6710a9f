"""Paddle's multi-GPU guide, basic API: your own training loop, and what torchrun makes you add.

The program of Paddle's single-machine multi-GPU guide, basic-API scene, in
plain PyTorch: a multilayer perceptron (flatten, linear 784->512, ReLU,
dropout 0.2, linear 512->10), Adam (lr 1e-3), batch 32, shuffled, 5 epochs,
a line every 1800 batches -- on Fashion-MNIST, followed by an evaluation on
the test set. Every line a user must add so that the same file also runs
under ``torchrun`` is marked ``# torchrun:``; ``examples/basic_model.py``, the
same program on ``hapi.Model``, needs none of them:

- join the process group (``init_process_group``) and leave it at the end;
- put each process on its own device (``cuda:LOCAL_RANK``);
- wrap the network in ``DistributedDataParallel``, which averages gradients;
- give each process its own shard of the training data
  (``DistributedSampler``) and reshuffle it every epoch (``set_epoch``);
- give each process its own slice of the test data, with no sample counted
  twice (``DistributedSampler`` would pad the last shard with repeats);
- add up every process's evaluation counts (``all_reduce``);
- print and write files on rank 0 only.

Launch (batch 32 is per process: two processes train at global batch 64)::

    python examples/basic_loop.py
    torchrun --standalone --nproc_per_node=2 examples/basic_loop.py

Options: ``--data-root DIR`` (the IDX files; default: hapi's search path,
e.g. ``/usr/share/datasets/fashion-mnist``), ``--epochs N`` (default 5, the
seed's), ``--num-iters N`` caps the training batches (for quick runs),
``--output DIR`` (default ``output/basic_loop``) receives ``model.pt``.
Prints one JSON line (test ``loss``, ``acc``, ``fit_seconds``) on rank 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch
import torch.distributed as dist  # torchrun: the collectives
from torch import nn
from torch.nn.parallel import DistributedDataParallel  # torchrun: gradient averaging
from torch.utils.data import DataLoader, DistributedSampler, Subset  # torchrun: DistributedSampler

from hapi.datasets import FashionMNIST

BATCH_SIZE = 32
LEARNING_RATE = 1e-3
PRINT_EVERY = 1800


def seed_network() -> nn.Module:
    """The seed's multilayer perceptron (Paddle's ``Flatten(1, -1)`` is torch's default)."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, 512),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Linear(512, 10),
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", default=None)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--num-iters", type=int, default=None)
    parser.add_argument("--output", default=os.path.join("output", "basic_loop"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("epochs", "num_iters"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(
                f"--{name.replace('_', '-')} must be a positive integer; received {value}."
            )
    return args


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    # torchrun: it starts one copy of this script per process and tells each which one it is.
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if distributed:  # torchrun: join the process group (NCCL between GPUs, Gloo between CPUs)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank() if distributed else 0
    world_size = dist.get_world_size() if distributed else 1
    torch.manual_seed(
        args.seed
    )  # the same initial weights everywhere (DDP also broadcasts rank 0's)

    train_dataset = FashionMNIST(root=args.data_root, mode="train")
    test_dataset = FashionMNIST(root=args.data_root, mode="test")

    network = seed_network().to(device)
    model = network
    if distributed:  # torchrun: DDP all-reduces the gradients during backward()
        model = DistributedDataParallel(
            network, device_ids=[local_rank] if device.type == "cuda" else None
        )

    # torchrun: each process reads its own shard of the shuffled training data.
    sampler = (
        DistributedSampler(train_dataset, shuffle=True, seed=args.seed) if distributed else None
    )
    train_loader = DataLoader(
        train_dataset, batch_size=BATCH_SIZE, shuffle=sampler is None, sampler=sampler
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    loss_fn = nn.CrossEntropyLoss()

    started = time.perf_counter()
    steps = 0
    for epoch in range(args.epochs):
        if sampler is not None:  # torchrun: a new shuffle every epoch, the same on every rank
            sampler.set_epoch(epoch)
        model.train()
        for batch_id, (x, y) in enumerate(train_loader):
            x, y = x.to(device), y.to(device)
            logits = model(x)
            loss = loss_fn(logits, y)
            loss.backward()
            if (batch_id + 1) % PRINT_EVERY == 0 and rank == 0:  # torchrun: print on rank 0 only
                acc = (logits.argmax(dim=1) == y).float().mean()
                print(
                    f"epoch: {epoch}, batch_id: {batch_id}, loss is: {loss.item():.4f}, "
                    f"acc is: {acc.item():.4f}",
                    flush=True,
                )
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
            if steps == args.num_iters:
                break
        if steps == args.num_iters:
            break
    fit_seconds = time.perf_counter() - started

    # torchrun: each process evaluates every world_size-th test image, so each
    # image counts exactly once; the counts are then summed over processes.
    shard = (
        Subset(test_dataset, range(rank, len(test_dataset), world_size))
        if distributed
        else test_dataset
    )
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, samples
    with torch.no_grad():
        for x, y in DataLoader(shard, batch_size=BATCH_SIZE):
            x, y = x.to(device), y.to(device)
            logits = network(x)  # the plain module: evaluation needs no gradient averaging
            totals += torch.stack(
                [
                    nn.functional.cross_entropy(logits, y, reduction="sum").double(),
                    (logits.argmax(dim=1) == y).sum().double(),
                    torch.tensor(float(len(y)), dtype=torch.float64, device=device),
                ]
            )
    if distributed:  # torchrun: add up the counts of every process
        dist.all_reduce(totals)
    results = {
        "loss": (totals[0] / totals[2]).item(),
        "acc": (totals[1] / totals[2]).item(),
        "fit_seconds": fit_seconds,
    }

    if rank == 0:  # torchrun: one process writes files and reports
        os.makedirs(args.output, exist_ok=True)
        torch.save(network.state_dict(), os.path.join(args.output, "model.pt"))
        print(json.dumps({name: round(value, 4) for name, value in results.items()}), flush=True)
    if distributed:  # torchrun: leave the process group together, then destroy it
        # DDP's reducer holds the group's pending work: freed after the group (when main
        # returns), Gloo can abort a finished run ("terminate called without an active
        # exception"). So it goes first; and no process destroys while another still writes.
        del model
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
