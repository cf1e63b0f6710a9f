"""Paddle's spawn guide, the torch-hapi way: hapitrain on several processes by ``hapi.spawn``.

Paddle's walkthrough recommends ``paddle.distributed.spawn(train)`` over the
launcher: the training code goes into a function, and one call starts it on
every device. torch-hapi's ``hapi.spawn`` does the same on torch's elastic
launcher (the engine of ``torchrun``): ``train(args)`` below -- LeNet on
Fashion-MNIST, Adam 1e-3, batch 64 per process, top-1/top-2 accuracy, as in
``examples/hapitrain.py`` -- runs in each process and trains distributed with
no other change. Launch it with plain ``python``::

    python examples/spawn_train.py                       # 2 processes (CPU or the first 2 GPUs)
    python examples/spawn_train.py --nprocs -1           # one per visible GPU, else one per CPU core
    python examples/spawn_train.py --nprocs 2 --gpus 4,5 # Paddle's gpus='4,5'
    python examples/spawn_train.py --log-dir log         # log/workerlog.<rank>, like launch --log_dir

Each of the N processes gets ``cpu_count // N`` threads unless ``OMP_NUM_THREADS`` is set.

The seed's four usages map to ``hapi.spawn(train)``, ``hapi.spawn(train,
args=(...,))``, ``hapi.spawn(train, args=(...,), nprocs=2)`` and
``hapi.spawn(train, nprocs=2, gpus="4,5")``. ``train`` must be a module-level
function and the call must sit under ``if __name__ == "__main__":``, because
every child imports this file.

Options: ``--data-root DIR``, ``--epochs N``, ``--num-iters N`` caps the
training batches, ``--output DIR`` (default ``output/spawn_train``) receives
``checkpoints/``. The parent prints one JSON line: rank 0's evaluation
(``loss``, ``acc_top1``, ``acc_top2``), ``fit_seconds`` and ``world_size``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import hapi
from hapi.datasets import FashionMNIST
from hapi.distributed import world_size
from hapi.metrics import Accuracy
from hapi.models import LeNet


def train(args: argparse.Namespace) -> dict[str, float | int]:
    """The whole single-process program; ``hapi.spawn`` runs it once per process.

    Returns this process's evaluation figures, which are reduced over every
    process, so each rank returns the same numbers.
    """
    torch.manual_seed(args.seed)
    train_dataset = FashionMNIST(root=args.data_root, mode="train")
    test_dataset = FashionMNIST(root=args.data_root, mode="test")

    model = hapi.Model(LeNet())
    model.prepare(
        torch.optim.Adam(model.parameters(), lr=1e-3),
        torch.nn.CrossEntropyLoss(),
        Accuracy(topk=(1, 2)),
    )
    started = time.perf_counter()
    model.fit(
        train_dataset,
        epochs=args.epochs,
        batch_size=64,
        log_freq=400,
        num_iters=args.num_iters,
        save_dir=os.path.join(args.output, "checkpoints"),
    )
    fit_seconds = time.perf_counter() - started
    results = model.evaluate(test_dataset, batch_size=64, log_freq=100)
    # world_size is a count: an int, so the JSON line prints 2, not 2.0.
    return {**results, "fit_seconds": fit_seconds, "world_size": world_size()}


def main(argv: list[str] | None = None) -> dict[str, float | int]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", default=None)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--num-iters", type=int, default=None)
    parser.add_argument("--output", default=os.path.join("output", "spawn_train"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--nprocs",
        type=int,
        default=2,
        help="processes to start; -1: one per GPU in --gpus, else per visible GPU, else per CPU core",
    )
    parser.add_argument(
        "--gpus", default=None, help="device numbers to use, e.g. 4,5 (Paddle's gpus=)"
    )
    parser.add_argument(
        "--log-dir", default=None, help="keep each process's output in LOG_DIR/workerlog.<rank>"
    )
    args = parser.parse_args(argv)

    # The parent only launches: it never joins the process group itself.
    per_rank = hapi.spawn(
        train, args=(args,), nprocs=args.nprocs, gpus=args.gpus, log_dir=args.log_dir
    )
    results = per_rank[0]
    print(json.dumps({name: round(value, 4) for name, value in results.items()}), flush=True)
    return results


if __name__ == "__main__":
    main()
