"""EMA on several processes: python ema_script.py OUT_DIR (under torchrun, or alone for one process).

Trains TinyNet with SGD on 64 samples, shuffle=False, 2 epochs at a per-process batch of
BATCH_SIZE (environment; default 8), with evaluation each epoch and an EMA kept to the end
(swap_at_end=False, so the training weights stay in the network). Each rank writes
OUT_DIR/ema.rank<R>.json: the average, the training weights and the history.
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

from callbacks.ema import EMA  # noqa: E402
from hapi import Model  # noqa: E402


def run(batch_size: int) -> dict:
    torch.manual_seed(0)
    model = Model(TinyNet())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.2), nn.CrossEntropyLoss())
    ema = EMA(decay=0.8, swap_at_end=False)
    history = model.fit(
        make_tiny_data(64),
        eval_data=make_tiny_data(21, seed=1),
        batch_size=batch_size,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[ema],
    )
    shadow = ema.state_dict()["shadow"]
    names = [name for name, _ in model.network.named_parameters()]
    return {
        "average": torch.cat([shadow[name].flatten() for name in names]).tolist(),
        "weights": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist(),
        "val_loss": history.history["val_loss"],
        "step": model.step,
    }


if __name__ == "__main__":
    result = run(int(os.environ.get("BATCH_SIZE", "8")))
    out = pathlib.Path(sys.argv[1])
    (out / f"ema.rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(result))
