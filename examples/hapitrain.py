"""The hapitrain program (Paddle's high-level API walkthrough), the torch-hapi way.

LeNet on real Fashion-MNIST, Adam 1e-3, batch 64, top-1/top-2 accuracy,
``log_freq=400``, one epoch, then ``evaluate`` -- with VisualDL scalars and a
checkpoint. The same file runs unchanged on one process or many:

    python examples/hapitrain.py
    torchrun --nproc_per_node=2 examples/hapitrain.py

Options (for quick runs and tests): ``--data-root DIR`` reads the IDX files
from DIR, ``--epochs N``, ``--num-iters N`` caps the training batches,
``--output DIR`` (default ``output/hapitrain``) holds ``visualdl_log/`` and
``checkpoints/``. Each run writes its curves into a directory of its own,
``visualdl_log/version_<N>`` (printed at the end), so runs never hide each
other; open the dashboard on the parent, where VisualDL lists every
``version_<N>`` as a run:
``visualdl --logdir output/hapitrain/visualdl_log --host 127.0.0.1 --port 8040 --language en``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from callbacks import ModelCheckpoint, VisualDL
from hapi import Model
from hapi.datasets import FashionMNIST
from hapi.distributed import is_main
from hapi.metrics import Accuracy
from hapi.models import LeNet


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", default=None)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--num-iters", type=int, default=None)
    parser.add_argument("--output", default=os.path.join("output", "hapitrain"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)

    train_dataset = FashionMNIST(root=args.data_root, mode="train")
    test_dataset = FashionMNIST(root=args.data_root, mode="test")

    model = Model(LeNet())
    model.prepare(
        torch.optim.Adam(model.parameters(), lr=1e-3),
        torch.nn.CrossEntropyLoss(),
        Accuracy(topk=(1, 2)),
    )

    # One VisualDL callback for both calls: train/* scalars from fit, eval/*
    # from evaluate, in one record file, in this run's own visualdl_log/version_<N>.
    log_dir = os.path.join(args.output, "visualdl_log")
    visualdl = VisualDL(log_dir=log_dir)
    started = time.perf_counter()
    model.fit(
        train_dataset,
        epochs=args.epochs,
        batch_size=64,
        log_freq=400,
        num_iters=args.num_iters,
        callbacks=[visualdl, ModelCheckpoint(save_dir=os.path.join(args.output, "checkpoints"))],
    )
    fit_seconds = time.perf_counter() - started

    results = model.evaluate(test_dataset, log_freq=100, batch_size=64, callbacks=[visualdl])
    results["fit_seconds"] = fit_seconds
    if is_main():  # under torchrun every process runs this script; one report is enough
        print(f"VisualDL log: {visualdl.run_dir} (visualdl --logdir {log_dir} --language en)")
        print(json.dumps({name: round(value, 4) for name, value in results.items()}))
    return results


if __name__ == "__main__":
    main()
