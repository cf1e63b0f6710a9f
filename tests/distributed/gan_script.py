"""A GAN (train_step of its own, two optimizers) on several processes.

python gan_script.py OUT_DIR: writes OUT_DIR/gan.rank<R>.json (both networks' weights, history).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))

from own_step_models import gan_model, real_points  # noqa: E402


def main(out: pathlib.Path) -> None:
    rank = int(os.environ.get("RANK", 0))
    model = gan_model(seed=rank)  # each process starts elsewhere: rank 0's weights must win
    history = model.fit(real_points(64), batch_size=8, epochs=2, verbose=0)
    (out / f"gan.rank{rank}.json").write_text(
        json.dumps(
            {
                "generator": torch.cat(
                    [p.detach().flatten() for p in model.network.generator.parameters()]
                ).tolist(),
                "discriminator": torch.cat(
                    [p.detach().flatten() for p in model.network.discriminator.parameters()]
                ).tolist(),
                "history": history.history,
            }
        )
    )


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
