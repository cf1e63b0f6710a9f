"""A script in pytorch/examples' order: the process group, a DistributedSampler, then the Model.

python launch_script.py OUT, started by any launcher (torchrun, mpirun, a Kubeflow-style
environment). Each process writes OUT/launch.rank<R>.json: its rank as asked before the group
existed, the torch.distributed variables torch-hapi formed, whether the main process's block
of main_process_first had finished when this one's ran, the trained weights and evaluate's
figures.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))

from conftest import TinyNet, make_tiny_data  # noqa: E402

from hapi import Model, distributed  # noqa: E402
from hapi.metrics import Accuracy  # noqa: E402

DATA = TensorDataset(*make_tiny_data(32))


def train(loader: DataLoader) -> tuple[Model, dict]:
    torch.manual_seed(0)
    model = Model(TinyNet())
    model.prepare(
        torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), metrics=Accuracy()
    )
    model.fit(loader, epochs=2, verbose=0)
    return model, model.evaluate(make_tiny_data(24, seed=1), batch_size=4, verbose=0)


if __name__ == "__main__":
    out = pathlib.Path(sys.argv[1])
    before = (distributed.rank(), distributed.world_size())
    distributed.init()
    distributed.init()  # a second call changes nothing
    with distributed.main_process_first():
        if distributed.rank() == 0:
            time.sleep(1)  # the others would overtake a main process that did not go first
            (out / "prepared").write_text("done")
        prepared_before_mine = (out / "prepared").exists()
    loader = DataLoader(DATA, batch_size=8, sampler=DistributedSampler(DATA, shuffle=False))
    model, figures = train(loader)
    distributed.barrier()
    result = {
        "before_init": before,
        "env": {
            name: os.environ.get(name)
            for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        },
        "prepared_before_mine": prepared_before_mine,
        "weights": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist(),
        "figures": figures,
    }
    (out / f"launch.rank{distributed.rank()}.json").write_text(json.dumps(result))
