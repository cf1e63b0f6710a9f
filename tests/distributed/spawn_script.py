"""The seeds' four spawn usages, run as a user would: `python spawn_script.py MODE OUT_DIR`.

Each rank writes OUT_DIR/<mode>.rank<R>.json with what it saw.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))

from conftest import TinyNet, make_tiny_data  # noqa: E402

import hapi  # noqa: E402


def train(out_dir: str = ".", tag: str = "plain") -> float:
    torch.manual_seed(0)
    model = hapi.Model(TinyNet())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    print(f"rank {os.environ['RANK']} says hello")
    history = model.fit(make_tiny_data(64), batch_size=8, epochs=1, verbose=0)
    record = {
        "rank": int(os.environ["RANK"]),
        "world_size": int(os.environ["WORLD_SIZE"]),
        "loss": history.history["loss"][-1],
        "threads": torch.get_num_threads(),
    }
    (pathlib.Path(out_dir) / f"{tag}.rank{record['rank']}.json").write_text(json.dumps(record))
    return record["loss"]


def print_then_die(out_dir: str) -> None:
    hapi.distributed.init()
    print(f"rank {os.environ['RANK']} prints before it dies", flush=True)
    if os.environ["RANK"] == "1":
        os._exit(3)  # no exception to report: only the exit code and the output tell
    # Rank 0 loses its peer here and raises ("Connection closed by peer"), its report no cause.
    torch.distributed.all_reduce(torch.ones(1))
    time.sleep(60)  # or is stopped by the launcher first


# A user's mistake: spawn called at import time, outside `if __name__ == "__main__":`
# (each child imports this script, so the call runs again there).
UNGUARDED = os.environ.get("SPAWN_SCRIPT_UNGUARDED")
if UNGUARDED:
    try:
        hapi.spawn(print_then_die, args=(UNGUARDED,), nprocs=2, log_dir=UNGUARDED)
    except hapi.launch.SpawnedProcessError as error:
        UNGUARDED = str(error)
    del os.environ["SPAWN_SCRIPT_UNGUARDED"]  # reached by the parent only: the children died


def train_then_fail(out_dir: str) -> None:
    model = hapi.Model(TinyNet())  # both ranks join the process group
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    if os.environ["RANK"] == "1":
        raise ValueError("boom in a spawned child")
    model.fit(make_tiny_data(64), batch_size=8, epochs=1, verbose=0)  # rank 0 waits for rank 1


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "usages":
        os.chdir(out)
        hapi.spawn(train)  # fn only: one process per CPU core here (2)
        results = hapi.spawn(  # with args, nprocs and log_dir
            train, args=(out, "nprocs"), nprocs=2, log_dir=os.path.join(out, "logs")
        )
        (pathlib.Path(out) / "returned.json").write_text(
            json.dumps({str(k): v for k, v in results.items()})
        )
    elif mode == "dies":  # two children that die, each with its own logs directory
        messages = {"unguarded": UNGUARDED}
        try:
            hapi.spawn(print_then_die, args=(out,), nprocs=2, log_dir=os.path.join(out, "exit"))
        except hapi.launch.SpawnedProcessError as error:
            messages["exit"] = str(error)

        def not_importable() -> None:  # defined under the guard: the children cannot find it
            print("never runs")

        try:
            hapi.spawn(not_importable, nprocs=2, log_dir=os.path.join(out, "hidden"))
        except hapi.launch.SpawnedProcessError as error:
            messages["hidden"] = str(error)
        (pathlib.Path(out) / "messages.json").write_text(json.dumps(messages))
    elif mode == "fail":
        hapi.spawn(train_then_fail, args=(out,), nprocs=2)
