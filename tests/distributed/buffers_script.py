"""BatchNorm statistics and models that never trained under DDP, on several processes.

python buffers_script.py OUT_DIR: trains a BatchNorm network, then evaluates, predicts and
saves it; then evaluates a network that each rank initialised differently, without
training. Each rank writes OUT_DIR/buffers.rank<R>.json; rank 0 saves OUT_DIR/bn.pt and
OUT_DIR/untrained.pt, which the test scores on one process.
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

from hapi import Model  # noqa: E402
from hapi.metrics import Accuracy  # noqa: E402

EVAL_SAMPLES = 21  # 11 + 10 on two processes


def bn_net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def run(out: pathlib.Path) -> dict:
    rank = int(os.environ.get("RANK", "0"))
    x, y = make_tiny_data(64)
    torch.manual_seed(0)
    model = Model(bn_net())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), Accuracy())
    # Each rank's last batch differs, so each rank's running statistics differ after fit.
    model.fit((x, y), batch_size=8, epochs=2, verbose=0)
    local_mean = model.network[1].running_mean.tolist()
    x_eval, y_eval = make_tiny_data(EVAL_SAMPLES, seed=1)
    results = {
        "evaluate": model.evaluate((x_eval, y_eval), batch_size=4, verbose=0),
        "predict": model.predict((x_eval, y_eval), batch_size=4, stack_outputs=True, verbose=0)[
            0
        ].tolist(),
        "local_mean_before_evaluate": local_mean,
        "running_mean": model.network[1].running_mean.tolist(),
    }
    model.save(out / "bn")

    torch.manual_seed(100 + rank)  # every rank its own initial weights, and no fit
    scorer = Model(bn_net())
    scorer.prepare(loss=nn.CrossEntropyLoss(), metrics=Accuracy())
    results["untrained_evaluate"] = scorer.evaluate((x_eval, y_eval), batch_size=4, verbose=0)
    results["untrained_predict"] = scorer.predict(
        (x_eval, y_eval), batch_size=4, stack_outputs=True, verbose=0
    )[0].tolist()
    results["untrained_wrapped"] = scorer._wrapped is not None  # evaluate/predict build no DDP
    scorer.save(out / "untrained", training=False)
    return results


if __name__ == "__main__":
    out_dir = pathlib.Path(sys.argv[1])
    rank = os.environ.get("RANK", "0")
    (out_dir / f"buffers.rank{rank}.json").write_text(json.dumps(run(out_dir)))
