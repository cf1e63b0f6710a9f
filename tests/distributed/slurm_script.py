"""Started twice with Slurm's variables set, as `srun --ntasks=2 python slurm_script.py OUT` does.

Each process writes OUT/slurm.rank<SLURM_PROCID>.json: the rank and world size torch-hapi
formed, and the trained weights.
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

from hapi import Model, distributed  # noqa: E402


def train(batch_size: int) -> Model:
    torch.manual_seed(0)
    model = Model(TinyNet())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    model.fit(make_tiny_data(32), batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    return model


if __name__ == "__main__":
    out = pathlib.Path(sys.argv[1])
    model = train(8)
    result = {
        "rank": distributed.rank(),
        "world_size": distributed.world_size(),
        "local_world_size": os.environ.get("LOCAL_WORLD_SIZE"),
        "weights": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist(),
    }
    (out / f"slurm.rank{os.environ['SLURM_PROCID']}.json").write_text(json.dumps(result))
