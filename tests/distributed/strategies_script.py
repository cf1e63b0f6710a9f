"""hapi.DDP's options on several processes (torchrun), or on one (the reference).

python strategies_script.py OUT_DIR: each rank writes OUT_DIR/strategies.rank<R>.json.
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

from conftest import make_tiny_data  # noqa: E402

import hapi  # noqa: E402


class WithUnusedBranch(nn.Module):
    """A head that the forward never uses (e.g. kept for a later fine-tuning)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 3)
        self.unused_head = nn.Linear(4, 3)

    def forward(self, x):
        return self.body(x)


def train(batch_size: int, strategy=None) -> hapi.Model:
    torch.manual_seed(0)
    model = hapi.Model(WithUnusedBranch())
    model.prepare(
        torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), strategy=strategy
    )
    model.fit(make_tiny_data(32), batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    return model


def weights(model: hapi.Model) -> list[float]:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def run() -> dict:
    results: dict = {}
    try:
        train(8)
        results["default"] = "trained"
    except RuntimeError as error:
        results["default"] = str(error)
    results["find_unused"] = weights(train(8, hapi.DDP(find_unused_parameters=True)))
    try:
        bn = hapi.Model(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)))
        bn.prepare(
            torch.optim.SGD(bn.parameters(), lr=0.1),
            nn.CrossEntropyLoss(),
            strategy=hapi.DDP(sync_batchnorm=True),
        )
        bn.fit(make_tiny_data(32), batch_size=8, verbose=0)
        results["sync_batchnorm"] = "trained"
    except Exception as error:  # noqa: BLE001 -- the test reads the message
        results["sync_batchnorm"] = f"{type(error).__name__}: {error}"
    try:  # a keyword DDP lacks: DDP's own error, naming the keyword
        train(8, hapi.DDP(device="cpu"))
        results["unknown_keyword"] = "trained"
    except TypeError as error:
        results["unknown_keyword"] = str(error)
    return results


if __name__ == "__main__":
    out = pathlib.Path(sys.argv[1])
    (out / f"strategies.rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(run()))
