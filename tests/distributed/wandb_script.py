"""WandbCallback on several processes: python wandb_script.py OUT_DIR (under torchrun).

Trains TinyNet 2 epochs on 32 samples (per-process batch 8, evaluation each epoch) with
WandbCallback(mode="offline", dir=OUT_DIR). Each rank writes OUT_DIR/wandb.rank<R>.json:
whether this process imported wandb and whether the callback held a run, and the history.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))

from conftest import TinyNet, make_tiny_data  # noqa: E402

from callbacks.wandb import WandbCallback  # noqa: E402
from hapi import Model  # noqa: E402


class _SawRun(WandbCallback):
    """Notes whether this process held a run while training."""

    held_run = False

    def on_train_batch_end(self, step, logs=None):
        self.held_run = self.held_run or self.run is not None
        super().on_train_batch_end(step, logs)


if __name__ == "__main__":
    out = pathlib.Path(sys.argv[1])
    torch.manual_seed(0)
    model = Model(TinyNet())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    cb = _SawRun(project="hapi-test", dir=str(out), mode="offline")
    history = model.fit(
        make_tiny_data(32),
        eval_data=make_tiny_data(16, seed=1),
        batch_size=8,
        epochs=2,
        log_freq=1,
        verbose=0,
        callbacks=[cb],
    )
    result = {
        "imported_wandb": "wandb" in sys.modules,
        "held_run": cb.held_run,
        "history": history.history,
    }
    (out / f"wandb.rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(result))
