"""The loop's parity items on several processes: a frozen network, stops agreed, step weights.

Usage: torchrun --standalone --nproc_per_node=2 loop_items_script.py OUT_DIR. Each rank writes
OUT_DIR/loop_items.rank<R>.json; tests/distributed/test_loop_items_processes.py reads them.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import warnings

import torch
from torch import nn

# The repository first (tests/callbacks must not pass for the callbacks package), then tests/.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))

from conftest import TinyNet, make_tiny_data  # noqa: E402

from callbacks import Callback  # noqa: E402
from hapi import Model  # noqa: E402


class Seen(nn.Module):
    """Returns its input, and keeps every input it evaluated (the samples a pass saw)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.inputs: list[float] = []

    def forward(self, x):
        if not self.training:
            self.inputs += x.flatten().tolist()
        return x * self.scale


class StopOnRankZero(Callback):
    """Sets the flag after batch ``at`` on rank 0 only (as a callback gated on is_main would)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at
        self.eval_steps: list[int] = []
        self.predict_steps: list[int] = []

    def on_eval_batch_end(self, step, logs=None):
        self.eval_steps.append(step)
        if step == self.at and self.params["rank"] == 0:
            self.model.stop_evaluating = True

    def on_predict_batch_end(self, step, logs=None):
        self.predict_steps.append(step)
        if step == self.at and self.params["rank"] == 0:
            self.model.stop_predicting = True


class Tokens(Model):
    def train_step(self, batch):
        x, tokens = batch
        loss = (self.network(x) * 0).sum() + x.sum() / tokens.sum()
        self.backward(loss)
        self.optimizer_step()
        return {"loss": loss, "weight": tokens.sum()}

    def eval_step(self, batch):
        x, tokens = batch
        return {"loss": x.sum() / tokens.sum(), "weight": tokens.sum()}


def token_data():
    tokens = torch.arange(1, 41) % 7 + 1
    return torch.arange(40.0).reshape(40, 1) * tokens.reshape(40, 1), tokens


def main(out: pathlib.Path) -> None:
    rank = int(os.environ.get("RANK", 0))
    x, y = make_tiny_data(40)
    result: dict = {}

    # A frozen network: DDP refuses a module with nothing to train, so it is not wrapped.
    torch.manual_seed(0)
    frozen = TinyNet().requires_grad_(False)
    model = Model(frozen)
    model.prepare(torch.optim.SGD(frozen.parameters(), lr=0.1), nn.CrossEntropyLoss())
    before = [p.clone() for p in frozen.parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit((x, y), batch_size=4, epochs=2, verbose=0)
    result["frozen_warnings"] = [str(w.message) for w in caught if "gradient" in str(w.message)]
    result["frozen_unchanged"] = all(torch.equal(a, b) for a, b in zip(before, frozen.parameters()))
    result["frozen_loss"] = history.history["loss"]
    result["frozen_expected"] = nn.functional.cross_entropy(frozen(x), y).item()

    # Stops set on rank 0 only: every rank ends after the same batch.
    values = torch.arange(40.0).reshape(40, 1)
    for log_freq in (1, 2):
        network = Seen()
        model = Model(network, inputs=1, labels=0)
        model.prepare(loss=lambda out: out.mean())
        stop = StopOnRankZero(at=0)
        logs = model.evaluate(
            (values,), batch_size=4, log_freq=log_freq, verbose=0, callbacks=[stop]
        )
        result[f"eval_{log_freq}"] = {
            "steps": stop.eval_steps,
            "loss": logs["loss"],
            "seen": list(network.inputs),
        }
    stop = StopOnRankZero(at=1)
    rows = torch.arange(160.0).reshape(160, 1)  # 20 batches per rank
    outputs = model.predict((rows,), batch_size=4, verbose=0, callbacks=[stop], stack_outputs=True)
    result["predict"] = {"steps": stop.predict_steps, "rows": outputs[0].flatten().tolist()}

    # A step's weights, summed over the processes.
    x_tokens, tokens = token_data()
    model = Tokens(nn.Linear(1, 1))
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.0))
    history = model.fit((x_tokens, tokens), (x_tokens, tokens), batch_size=4, verbose=0)
    result["weighted"] = {
        "loss": history.history["loss"],
        "val_loss": history.history["val_loss"],
        "expected": (x_tokens.sum() / tokens.sum()).item(),
    }
    (out / f"loop_items.rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
