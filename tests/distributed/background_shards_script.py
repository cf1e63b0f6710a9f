"""Sharded saves in the background (``save(sharded=True, wait=False)``) on several processes.

python background_shards_script.py OUT_DIR: each rank writes what it finds to
OUT_DIR/background.rank<R>.json as it goes. DCP's file writer is slowed (every process's
shards are written 2 s late) and then made to fail on rank 1, so that what
``wait_for_saves`` promises can be seen:

* once it returns, every shard, DCP's metadata and the manifest are on disk,
  and the directory loads into a fresh model with the trained weights;
* a writer's error on one process is raised by ``wait_for_saves`` on every
  process, and the previous checkpoint in that directory still loads.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import fsdp_script  # noqa: E402

import hapi  # noqa: E402
from hapi import checkpoint, distributed  # noqa: E402

WRITE_DELAY_S = 2.0
RANK = int(os.environ.get("RANK", "0"))
_write_data = dcp.FileSystemWriter.write_data


def slow_write(self, plan, planner):
    time.sleep(WRITE_DELAY_S)  # in DCP's background thread, before any byte is written
    return _write_data(self, plan, planner)


def failing_write(self, plan, planner):
    if RANK == 1:
        raise OSError(28, "No space left on device (provoked by the test)")
    return _write_data(self, plan, planner)


def new_model() -> hapi.Model:
    torch.manual_seed(0)
    model = hapi.Model(fsdp_script.Blocks())
    model.prepare(
        torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9),
        nn.CrossEntropyLoss(),
        strategy="fsdp",
    )
    return model


def shard_files(directory: pathlib.Path) -> list[str]:
    return sorted(p.name for p in directory.glob("shards-*/*") if p.stat().st_size > 0)


def weights(model: hapi.Model) -> list[float]:
    return fsdp_script.full_weights(model)


def loaded(directory: pathlib.Path) -> list[float]:
    """A fresh model, sharded by a step of training at lr 0, loaded from ``directory``."""
    fresh = new_model()
    for group in fresh.optimizer.param_groups:
        group["lr"] = 0.0
    fresh.fit(fsdp_script.data(8), batch_size=4, epochs=1, verbose=0)
    with (
        warnings.catch_warnings()
    ):  # the file's lr (0.2) is not the one given (0.0): said, and meant
        warnings.simplefilter("ignore")
        fresh.load(directory)
    return weights(fresh)


class Results(dict):
    """What this rank found, rewritten to its file at each entry: a later crash keeps the rest."""

    def __init__(self, out: pathlib.Path) -> None:
        super().__init__()
        self.file = out / f"background.rank{RANK}.json"

    def __setitem__(self, key: str, value) -> None:
        super().__setitem__(key, value)
        self.file.write_text(json.dumps(self))


def outcome(action) -> tuple[list[float] | None, str | None]:
    try:
        return action(), None
    except Exception as error:  # noqa: BLE001 -- recorded for the test
        return None, f"{type(error).__name__}: {str(error)[:300]}"


def run(out: pathlib.Path) -> None:
    results = Results(out)
    model = new_model()
    model.fit(fsdp_script.data(), batch_size=4, epochs=1, verbose=0)
    results["sharded"] = model.sharded

    # 1. wait_for_saves returns once everything is written.
    target = out / "background"
    dcp.FileSystemWriter.write_data = slow_write
    try:
        model.save(target, sharded=True, wait=False)
        results["pending_after_save"] = shard_files(target)  # the writer is still asleep
        model.wait_for_saves()
        results["after_wait"] = shard_files(target)  # before any other collective
        results["manifest_after_wait"] = (target / checkpoint.MANIFEST).is_file()
        # The manifest names the shards: it must come after them (the writer's 2 s sleep
        # puts a manifest written without waiting for them 2 s earlier).
        results["manifest_lead_s"] = (
            max(p.stat().st_mtime for p in target.glob("shards-*/*"))
            - (target / checkpoint.MANIFEST).stat().st_mtime
        )
    finally:
        dcp.FileSystemWriter.write_data = _write_data
    results["trained"] = weights(model)
    results["loaded"], results["load_error"] = outcome(lambda: loaded(target))

    # 2. A writer's error reaches every process through wait_for_saves.
    previous = out / "failing"
    model.save(previous, sharded=True)
    results["previous"] = weights(model)
    model.fit(fsdp_script.data(), batch_size=4, epochs=1, verbose=0)  # new weights
    dcp.FileSystemWriter.write_data = failing_write
    try:
        model.save(previous, sharded=True, wait=False)
        try:
            model.wait_for_saves()
            results["error"] = None
        except Exception as error:  # noqa: BLE001 -- recorded for the test
            results["error"] = f"{type(error).__name__}: {error}"
    finally:
        dcp.FileSystemWriter.write_data = _write_data
    distributed.barrier()
    results["loaded_previous"], results["load_previous_error"] = outcome(lambda: loaded(previous))
    model.save(out / "after", sharded=True, wait=False)  # the processes still save together
    model.wait_for_saves()
    results["saved_after_error"] = shard_files(out / "after")


if __name__ == "__main__":
    run(pathlib.Path(sys.argv[1]))
