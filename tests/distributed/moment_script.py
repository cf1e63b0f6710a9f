"""A background save, then a load, on every process: each must read what was saved.

python moment_script.py OUT_DIR
  Saves weights of 1.0, then 2.0 with wait=False (rank 0's write slowed down by
  a second), then loads on every process; rank R writes OUT_DIR/rankR.json
  with the weight it loaded.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import hapi  # noqa: E402
import hapi.checkpoint  # noqa: E402


def main(out: pathlib.Path) -> None:
    model = hapi.Model(nn.Linear(2, 1, bias=False))
    with torch.no_grad():
        model.network.weight.fill_(1.0)
    model.save(out / "ckpt", training=False)
    # The module whose write_file a save calls (hapi.checkpoint.state since the package).
    module = getattr(hapi.checkpoint, "state", hapi.checkpoint)
    real_write = module.write_file

    def slow_write(*args, **kwargs):
        time.sleep(1.0)
        real_write(*args, **kwargs)

    module.write_file = slow_write
    with torch.no_grad():
        model.network.weight.fill_(2.0)
    model.save(out / "ckpt", training=False, wait=False)
    with torch.no_grad():
        model.network.weight.fill_(0.0)
    model.load(out / "ckpt")
    rank = os.environ["RANK"]
    (out / f"rank{rank}.json").write_text(
        json.dumps({"loaded": model.network.weight.flatten().tolist()})
    )


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
