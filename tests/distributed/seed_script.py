"""hapi.seed_everything and hapi.distributed.rank() on several processes.

python seed_script.py OUT_DIR: writes OUT_DIR/seed.rank<R>.json with what the launcher's
rank looked like before any Model existed, and, for two runs seeded alike, the noise each
step drew, the weights training started from and ended with, and the samples each process read.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import hapi  # noqa: E402


class Noisy(hapi.Model):
    """A train_step of its own that draws noise, as a GAN's generator input does."""

    def train_step(self, batch):
        inputs, index = batch
        if self.start is None:
            self.start = _flat(self.network)
        noise = torch.randn(len(inputs), 2)
        self.noise.append(noise.flatten().tolist())
        self.seen.extend(index.tolist())
        loss = ((self.network(inputs + noise) - 1.0) ** 2).mean()
        self.backward(loss)
        self.optimizer_step()
        return {"loss": loss}


def _flat(network: nn.Module) -> list[float]:
    return torch.cat([p.detach().flatten() for p in network.parameters()]).tolist()


def _run() -> dict:
    hapi.seed_everything(7)
    made_after_seeding = torch.randn(4).tolist()  # synthetic data a script makes: alike everywhere
    network = nn.Sequential(nn.Linear(2, 8), nn.Dropout(0.5), nn.Linear(8, 1))
    model = Noisy(network)
    model.start, model.noise, model.seen = None, [], []
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    inputs = torch.arange(32, dtype=torch.float32).reshape(16, 2) / 32
    model.fit((inputs, torch.arange(16)), batch_size=4, epochs=1, shuffle=True, verbose=0)
    return {
        "noise": model.noise,
        "start": model.start,
        "end": _flat(model.network),
        "seen": model.seen,
        "made_after_seeding": made_after_seeding,
    }


def main(out: pathlib.Path) -> None:
    before = {
        "group_exists": dist.is_initialized(),
        "rank": hapi.distributed.rank(),
        "world_size": hapi.distributed.world_size(),
        "is_main": hapi.distributed.is_main(),
    }
    runs = [_run(), _run()]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # the same counts on every process: printed once
        summary = hapi.Model(nn.Linear(2, 1)).summary((1, 2))
        flops = hapi.Model(nn.Linear(2, 1)).flops((1, 2))
    rank = int(os.environ["RANK"])
    (out / f"seed.rank{rank}.json").write_text(
        json.dumps(
            {
                "before": before,
                "runs": runs,
                "printed": printed.getvalue(),
                "summary": summary,
                "flops": flops,
            }
        )
    )


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
