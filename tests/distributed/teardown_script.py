"""A finished run whose ranks reach the exit at different times (rank 0 has more to do).

python teardown_script.py OUT_DIR: each rank writes OUT_DIR/teardown.rank<R>.json with the
time it finished its own work and the time it left the process group.
"""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import sys
import time

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from hapi import Model  # noqa: E402

out = pathlib.Path(sys.argv[1])
rank = os.environ.get("RANK", "0")
times: dict[str, float] = {}


def record_exit() -> None:  # registered first, so it runs after hapi's own exit handler
    times["left"] = time.time()
    (out / f"teardown.rank{rank}.json").write_text(json.dumps(times))


atexit.register(record_exit)
torch.manual_seed(0)
x = torch.randn(64, 8)
model = Model(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
model.prepare(torch.optim.SGD(model.parameters(), lr=0.01), nn.MSELoss())
model.fit((x, x.sum(1, keepdim=True)), batch_size=16, epochs=1, verbose=0)
if rank == "0":
    time.sleep(1.5)  # e.g. writing a report: rank 1 reaches the exit first
times["done"] = time.time()
