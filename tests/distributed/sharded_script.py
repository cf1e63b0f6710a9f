"""Sharded checkpoints across world sizes and strategies.

python sharded_script.py OUT_DIR NAME STRATEGY [LOAD_FROM] [SAVE_TO]
  without LOAD_FROM: trains fsdp_script's "adam" recipe under STRATEGY and saves
  it sharded to SAVE_TO; with LOAD_FROM: a freshly initialised model (another
  seed) loads it. Either way it then saves to SAVE_TO (when given), and rank 0
  writes OUT_DIR/NAME.json with the model's full weights and its optimizer
  state in torch's plain layout, as this run holds them.
"""

from __future__ import annotations

import json
import pathlib
import sys

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.append(str(pathlib.Path(__file__).resolve().parent))

import fsdp_script  # noqa: E402

import hapi  # noqa: E402


def loaded(strategy: str, source: str) -> hapi.Model:
    torch.manual_seed(123)  # other weights than the saved ones
    model = hapi.Model(fsdp_script.Blocks())
    model.prepare(
        # The saved run's settings: load() keeps those given to prepare() (here the same) and
        # takes the moments and step from the file, resharded.
        torch.optim.Adam(model.parameters(), lr=0.01),
        nn.CrossEntropyLoss(),
        strategy=strategy,
    )
    model.fit(
        fsdp_script.data(8), batch_size=4, verbose=0
    )  # shards the network under FSDP (and makes state)
    model.load(source)
    return model


def held(model: hapi.Model) -> dict:
    optimizer = model._strategy._full_optimizer_state(model.network, model.optimizer)
    return {
        "weights": fsdp_script.full_weights(model),
        "optimizer": {
            str(i): {k: v.flatten().tolist() if torch.is_tensor(v) else v for k, v in s.items()}
            for i, s in optimizer["state"].items()
        },
        "groups": [
            {k: v for k, v in g.items() if k in ("lr", "betas", "params")}
            for g in optimizer["param_groups"]
        ],
        "step": model.step,
    }


if __name__ == "__main__":
    out, name, strategy = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    load_from = sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] != "-" else None
    save_to = sys.argv[5] if len(sys.argv) > 5 else None
    if load_from is None:
        model = fsdp_script.train("adam", fsdp_script.PER_PROCESS_BATCH, strategy)
    else:
        model = loaded(strategy, load_from)
    if save_to:
        model.save(save_to, sharded=True)
    facts = held(model)
    if hapi.distributed.rank() == 0:
        (out / f"{name}.json").write_text(json.dumps(facts))
