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

import hapi  # noqa: E402


class Wrapped(hapi.Model):
    """Keras' pattern: a train_step of one's own around the built-in one."""

    def train_step(self, batch):
        return super().train_step(batch)


def wrapped_weights(rank: int) -> list[float]:
    """The built-in step called by an override: its network is not DDP's, yet every process's
    copy must stay the same (each reads its own shard of the data)."""
    torch.manual_seed(rank)
    model = Wrapped(torch.nn.Linear(4, 3), device="cpu")
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.5), torch.nn.CrossEntropyLoss())
    data = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 4, generator=data), torch.randint(0, 3, (64,), generator=data)
    model.fit((x, y), batch_size=8, epochs=2, verbose=0)
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


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
                "wrapped": wrapped_weights(rank),
            }
        )
    )


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
