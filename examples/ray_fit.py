"""Model.fit under Ray Train: examples/global_batch.py's training on two Ray workers.

Ray Train's ``TorchTrainer`` starts the workers, makes their process group and
runs ``train_loop_per_worker`` in each; ``Model.fit`` uses that group as it
would torchrun's. ``callbacks.RayTrainReport`` reports each epoch's figures with
the model's checkpoint, so ``trainer.fit()`` returns them::

    pip install "ray[train]"
    python examples/ray_fit.py

It prints the result's figures (the last epoch's, evaluation included) and the
trained weights' checksum, read back from Ray's checkpoint. They equal what
``torchrun --standalone --nproc_per_node=2 examples/global_batch.py --batch-size 16``
prints as ``loss``, ``acc`` and ``weights_sum``. Run it again with the same
``--storage-path`` and more ``--epochs``, or let Ray restart a failed worker:
the run continues from the last checkpoint, exactly.
"""

from __future__ import annotations

import argparse
import json
import os

import ray.train
import torch
from ray.train.torch import TorchTrainer
from torch import nn

import hapi
from callbacks import RayTrainReport
from hapi.metrics import Accuracy


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Four features; the class is the index of the largest of the first three."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=generator)
    return x, x[:, :3].argmax(dim=1)


def make_model() -> hapi.Model:
    hapi.seed_everything(0)  # the same network and shuffling on every worker
    network = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    model = hapi.Model(network, device="cpu")
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), Accuracy())
    return model


def train_loop_per_worker(config: dict) -> None:
    """Runs in every Ray worker: the training of one process, unchanged."""
    model = make_model()
    resume_from = None
    checkpoint = ray.train.get_checkpoint()  # the last one reported, when Ray restores the run
    if checkpoint is not None:
        resume_from = os.path.join(checkpoint.to_directory(), RayTrainReport.FILE)
    model.fit(
        make_data(256, seed=1),
        eval_data=make_data(100, seed=2),
        batch_size=config["batch_size"],
        epochs=config["epochs"],
        verbose=0,
        callbacks=[RayTrainReport()],
        resume_from=resume_from,
    )


def make_trainer(epochs: int = 2, storage_path: str | None = None) -> TorchTrainer:
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"batch_size": 16, "epochs": epochs},  # per worker: global batch 32
        scaling_config=ray.train.ScalingConfig(num_workers=2, use_gpu=False),
        run_config=ray.train.RunConfig(
            name="ray_fit",
            storage_path=storage_path,
            failure_config=ray.train.FailureConfig(max_failures=2),
        ),
    )


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--storage-path", default=None, help="Ray's default: ~/ray_results")
    args = parser.parse_args(argv)

    result = make_trainer(args.epochs, args.storage_path).fit()
    model = make_model()
    with result.checkpoint.as_directory() as directory:
        model.load(os.path.join(directory, RayTrainReport.FILE))
    weights = torch.cat([p.detach().flatten() for p in model.network.parameters()])
    report = {**result.metrics, "weights_sum": round(weights.sum().item(), 6)}
    print(json.dumps(report), flush=True)
    return report


if __name__ == "__main__":
    main()
