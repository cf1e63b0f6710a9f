"""Map-style data that is no torch Dataset, and a list of dict samples, on several processes.

python map_style_script.py OUT_DIR BATCH: writes OUT_DIR/map_style.rank<R>.json (weights,
history, evaluations, predictions). The test runs it on one process at the global batch and
under torchrun: the shards are those of a Dataset, so the figures are the same.
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


class Rows:
    """Like a Hugging Face ``datasets.Dataset`` (torch format): rows are dicts; no torch Dataset."""

    def __init__(self, data: TokenData) -> None:
        self.columns = {"input_ids": data.ids, "attention_mask": data.mask, "labels": data.labels}

    def __len__(self) -> int:
        return len(self.columns["labels"])

    def __getitem__(self, key):
        return {name: column[key] for name, column in self.columns.items()}

    def __getitems__(self, keys: list) -> list:
        return [self[key] for key in keys]


def main(out: pathlib.Path, batch: int) -> None:
    held_out = TokenData(n=13, seed=1)
    as_list = [held_out[i] for i in range(len(held_out))]
    torch.manual_seed(0)
    model = Model(TinyClassifier())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.5), metrics=Accuracy())
    history = model.fit(
        Rows(TokenData()), eval_data=as_list, batch_size=(batch, 3), epochs=2, verbose=0
    )
    figures = {
        name: model.evaluate(data, batch_size=2, verbose=0)
        for name, data in (("rows", Rows(held_out)), ("list", as_list), ("dataset", held_out))
    }
    (logits,) = model.predict(as_list, batch_size=2, stack_outputs=True, verbose=0)
    rank = int(os.environ.get("RANK", 0))
    (out / f"map_style.rank{rank}.json").write_text(
        json.dumps(
            {
                "weights": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist(),
                "history": history.history,
                "evaluate": figures,
                "predict": logits.flatten().tolist(),
            }
        )
    )


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]), int(sys.argv[2]))
