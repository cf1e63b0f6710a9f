"""Exact figures under torchrun: training figures, evaluation shards, VisualDL's writer.

Usage: torchrun --standalone --nproc_per_node=N figures_script.py OUT_DIR. Each rank
writes OUT_DIR/figures.rank<R>.json; tests/distributed/test_exact_figures.py compares
them with one process and with figures computed directly from the data.

The network is a fixed linear classifier (logits = 3 * x[:, :3]) trained with lr=0,
so its weights never change and every figure is known in advance: it is right on
every sample except the last few, where it is confidently wrong.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import torch
import torchmetrics
from torch import nn

# The repository first, so that the folder tests/callbacks (no __init__.py)
# cannot pass for the callbacks package; then tests/ for the shared fixtures.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))

from conftest import make_tiny_data  # noqa: E402

import callbacks  # noqa: E402
import hapi  # noqa: E402
from callbacks import Callback, VisualDL  # noqa: E402
from hapi import Model  # noqa: E402
from hapi.metrics import Accuracy  # noqa: E402

PER_PROCESS_BATCH = 2
TRAIN_PER_PROCESS = 5  # per-process batches of 2, 2 and 1: the last global batch is short
# Evaluation data of 10 and 13 samples: on 3 processes, shards 4/3/3 and 5/4/4
# (len % 3 == 1), and batch sizes that divide none of the first shards.
EVAL_CASES = [(10, 3), (13, 2)]


def problem(samples: int, wrong: int):
    """The fixed network and ``samples`` samples, the last ``wrong`` of them mislabelled."""
    x, y = make_tiny_data(samples)
    y[samples - wrong :] = (y[samples - wrong :] + 1) % 3
    network = nn.Linear(4, 3)
    with torch.no_grad():
        network.weight.copy_(3.0 * torch.eye(3, 4))
        network.bias.zero_()
    return network, x, y


def direct_figures(network, x, y) -> dict[str, float]:
    """Loss and accuracy over the given samples, computed without hapi (in float64)."""
    with torch.no_grad():
        logits = nn.functional.linear(x.double(), network.weight.double(), network.bias.double())
    acc = (logits.argmax(dim=1) == y).double().mean().item()
    return {
        "loss": nn.functional.cross_entropy(logits, y).item(),
        "acc": acc,
        "multiclass_accuracy": acc,
    }


def prepared(network) -> Model:
    model = Model(network)
    model.prepare(
        torch.optim.SGD(model.parameters(), lr=0.0),
        nn.CrossEntropyLoss(),
        [
            Accuracy(),
            torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="micro"),
        ],
    )
    return model


class Logs(Callback):
    def __init__(self):
        super().__init__()
        self.epoch_end, self.batch_end = [], []

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_end.append(dict(logs))

    def on_train_batch_end(self, step, logs=None):
        self.batch_end.append(dict(logs))


def count_log_writers() -> list[int]:
    """Make every visualdl.LogWriter built from now on add 1 to the returned counter."""
    import visualdl

    opened = [0]

    class CountingLogWriter(visualdl.LogWriter):
        def __init__(self, *args, **kwargs):
            opened[0] += 1
            super().__init__(*args, **kwargs)

    visualdl.LogWriter = CountingLogWriter  # the callback imports it on its first write
    return opened


def main(out: pathlib.Path) -> None:
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    results = {"hapi_file": hapi.__file__, "callbacks_file": callbacks.__file__}

    # Training: the last global batch holds exactly the `world` mislabelled samples.
    network, x, y = problem(TRAIN_PER_PROCESS * world, wrong=world)
    model = prepared(network)
    logs = Logs()
    writers = count_log_writers()
    history = model.fit(
        (x, y),
        eval_data=(x, y),
        batch_size=PER_PROCESS_BATCH,
        epochs=2,
        shuffle=False,
        log_freq=1,
        verbose=0,
        callbacks=[logs, VisualDL(out / "vdl")],
    )
    results.update(
        history=history.history,
        epoch_end=logs.epoch_end,
        batch_end=logs.batch_end,
        log_writers_opened=writers[0],
        evaluate_train=model.evaluate((x, y), batch_size=PER_PROCESS_BATCH, verbose=0),
    )

    for samples, batch_size in EVAL_CASES:
        network, x, y = problem(samples, wrong=3)
        model = prepared(network)
        results[f"evaluate_{samples}"] = model.evaluate((x, y), batch_size=batch_size, verbose=0)
        predictions = model.predict((x, y), batch_size=batch_size, stack_outputs=True, verbose=0)
        results[f"predict_{samples}"] = predictions[0].tolist()
    (out / f"figures.rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
