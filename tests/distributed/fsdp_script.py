"""Training under hapi.FSDP on several processes (torchrun), or the same recipes on one.

python fsdp_script.py OUT_DIR: each rank writes OUT_DIR/fsdp.rank<R>.json with
the weights after each recipe, figures of evaluate/predict and what each
process holds. One process at batch N*b runs the same recipes for the test.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))

from torchmetrics import Accuracy  # noqa: E402

import hapi  # noqa: E402
from callbacks import BackupAndRestore, Callback  # noqa: E402
from hapi.distributed.fsdp import local_bytes  # noqa: E402

PER_PROCESS_BATCH = 4


class Blocks(nn.Module):
    """An MLP of three parameterised children (FSDP's default units), one with a LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(6, 24), nn.LayerNorm(24), nn.ReLU())
        self.middle = nn.Sequential(nn.Linear(24, 17), nn.Tanh())
        self.head = nn.Linear(17, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.middle(self.stem(x)))


def data(n: int = 48) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(n, 6, generator=generator)
    return x, x[:, :3].argmax(dim=1)


RECIPES = {
    "sgd": {"optimizer": "sgd"},
    "adam": {"optimizer": "adam"},
    "accumulate": {"optimizer": "adam", "accumulate_grad_batches": 2},
    "clip": {"optimizer": "sgd", "clip_grad_norm": 0.05},
    "bf16": {"optimizer": "adam", "amp": "bf16"},
    "fp16": {"optimizer": "sgd", "amp": "fp16"},
    # FSDP's own options (one process ignores them, as every strategy)
    "options": {
        "optimizer": "adam",
        "fsdp": {"reshard_after_forward": False, "cpu_offload": True, "wrap": {nn.Linear}},
    },
}


class Interrupted(Exception):
    pass


class InterruptAt(Callback):
    """Stops a fit by an exception after optimizer step ``step`` (after that step's backup, if any)."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step

    def on_train_batch_end(self, step, logs=None):
        if self.model.step == self.step:
            raise Interrupted


class EpochLogs(Callback):
    def __init__(self) -> None:
        super().__init__()
        self.logs: list[dict] = []

    def on_epoch_end(self, epoch, logs=None):
        self.logs.append(dict(logs or {}))


def train(
    recipe: str, batch_size: int, strategy=None, epochs: int = 2, callbacks=None
) -> hapi.Model:
    options = dict(RECIPES[recipe])
    torch.manual_seed(0)
    model = hapi.Model(Blocks())
    optimizer = (
        torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        if options.pop("optimizer") == "sgd"
        else torch.optim.Adam(model.parameters(), lr=0.01)
    )
    accumulate = options.pop("accumulate_grad_batches", 1)
    fsdp_options = options.pop("fsdp", None)
    if fsdp_options is not None and strategy == "fsdp":
        strategy = hapi.FSDP(**fsdp_options)
    model.prepare(
        optimizer,
        nn.CrossEntropyLoss(),
        Accuracy(task="multiclass", num_classes=3),
        strategy=strategy,
        **options,
    )
    model.epoch_logs = EpochLogs()
    model.fit(
        data(),
        batch_size=batch_size,
        epochs=epochs,
        shuffle=True,
        verbose=0,
        accumulate_grad_batches=accumulate,
        callbacks=[*(callbacks or []), model.epoch_logs],
    )
    return model


def resumed(backup_dir: pathlib.Path, strategy, batch_size: int = PER_PROCESS_BATCH) -> hapi.Model:
    """The "adam" recipe interrupted after step 5 (backups every 3 steps), then run again."""
    try:
        train(
            "adam",
            batch_size,
            strategy,
            callbacks=[BackupAndRestore(backup_dir, save_freq=3), InterruptAt(5)],
        )
    except Interrupted:
        pass
    resumed.sharded_backup = sorted(
        p.name for p in (backup_dir / "backup").glob("shards-*/*.distcp")
    )
    return train(
        "adam", batch_size, strategy, callbacks=[BackupAndRestore(backup_dir, save_freq=3)]
    )


def full_weights(model: hapi.Model) -> list[float]:
    """Every weight and buffer, gathered on every process (a collective under FSDP)."""
    state = get_model_state_dict(model.network, options=StateDictOptions(full_state_dict=True))
    return torch.cat([v.detach().float().flatten() for v in state.values()]).tolist()


def run(out: pathlib.Path) -> dict:
    results: dict = {}
    for recipe in RECIPES:
        model = train(recipe, PER_PROCESS_BATCH, "fsdp")
        results[recipe] = full_weights(model)
        results[f"{recipe}_logs"] = model.epoch_logs.logs
        if recipe == "sgd":
            results["is_users_module"] = isinstance(model.network, Blocks)
            results["parameter_bytes"] = local_bytes(model.network.parameters())
            results["optimizer_bytes"] = local_bytes(
                v for s in model.optimizer.state.values() for v in s.values() if torch.is_tensor(v)
            )
            results["evaluate"] = model.evaluate(data(13), batch_size=2, verbose=0)
            results["predict"] = model.predict(
                data(13), batch_size=2, stack_outputs=True, verbose=0
            )[0].tolist()
            results["summary"] = model.summary()
            model.save(out / "fsdp_final")
    for recipe in ("bf16", "fp16"):  # mixed precision: FSDP's policy gives DDP's training exactly
        results[f"{recipe}_ddp"] = full_weights(train(recipe, PER_PROCESS_BATCH, "ddp"))
    results["resumed"] = full_weights(resumed(out / "backup", "fsdp"))
    results["sharded_backup"] = resumed.sharded_backup
    return results


if __name__ == "__main__":
    out_dir = pathlib.Path(sys.argv[1])
    outcome = run(out_dir)
    (out_dir / f"fsdp.rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(outcome))
