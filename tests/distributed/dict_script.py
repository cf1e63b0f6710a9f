"""Dict batches on several processes: a Hugging Face-shaped model trains on its own loss.

python dict_script.py OUT_DIR BATCH: writes OUT_DIR/dict.rank<R>.json (weights, history,
evaluation). The test runs it on one process at the global batch and under torchrun.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))

from dict_models import TinyClassifier, TokenData  # noqa: E402

from hapi import Model  # noqa: E402
from hapi.metrics import Accuracy  # noqa: E402


def main(out: pathlib.Path, batch: int) -> None:
    torch.manual_seed(0)
    model = Model(TinyClassifier())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.5), metrics=Accuracy())
    history = model.fit(
        TokenData(),
        eval_data=TokenData(n=13, seed=1),
        batch_size=batch,
        epochs=2,
        shuffle=False,
        verbose=0,
    )
    figures = model.evaluate(TokenData(n=13, seed=1), batch_size=batch, verbose=0)
    rank = int(os.environ.get("RANK", 0))
    (out / f"dict.rank{rank}.json").write_text(
        json.dumps(
            {
                "weights": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist(),
                "history": history.history,
                "evaluate": figures,
            }
        )
    )


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]), int(sys.argv[2]))
