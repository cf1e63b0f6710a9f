"""Training run on each of two hosts (tests/hosts.py), which a kill mid-epoch may interrupt.

python two_hosts_script.py OUT_DIR [KILL_AT_STEP]: a tiny MLP, SGD with momentum,
BackupAndRestore every 3 optimizer steps into OUT_DIR/backup. With KILL_AT_STEP, the
process with rank KILL_RANK (default 1) calls os._exit at that optimizer step, once per
job: it first creates the file KILL_MARKER (default OUT_DIR/killed). Each rank writes
OUT_DIR/result.rank<R>.json: its weights and history, its host, the Gloo interface
hapi chose, and what rank 0 published in the agents' store for the other ranks to join.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import socket
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))

from conftest import TinyNet, make_tiny_data  # noqa: E402
from resume_script import KillAt  # noqa: E402  (the same kill as the one-machine resume tests)

from callbacks import BackupAndRestore  # noqa: E402
from hapi import Model  # noqa: E402
from hapi.distributed import store  # noqa: E402
from hapi.metrics import Accuracy  # noqa: E402

SAMPLES, BATCH_PER_PROCESS, EPOCHS = 64, 8, 3


def train(
    out: pathlib.Path, batch_size: int, kill_at: int | None = None, kill_rank: int = 1
) -> dict:
    torch.manual_seed(0)
    model = Model(TinyNet())
    model.prepare(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), nn.CrossEntropyLoss(), Accuracy()
    )
    x, y = make_tiny_data(SAMPLES)
    callbacks = [BackupAndRestore(out / "backup", save_freq=3)]
    if kill_at is not None:
        callbacks.append(
            KillAt(kill_at, kill_rank, pathlib.Path(os.environ.get("KILL_MARKER", out / "killed")))
        )
    history = model.fit(
        (x, y),
        eval_data=(x[:24], y[:24]),
        batch_size=batch_size,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )
    return {
        "weights": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist(),
        "history": history.history,
        "step": model.step,
    }


def published() -> str:
    """What rank 0 published in the agents' store (the store this job's workers were given)."""
    agents = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=30),
    )
    return agents.get(store._PUBLISHED_KEY).decode()


if __name__ == "__main__":
    out_dir = pathlib.Path(sys.argv[1])
    kill = int(sys.argv[2]) if len(sys.argv) > 2 else None
    result = train(out_dir, BATCH_PER_PROCESS, kill, int(os.environ.get("KILL_RANK", "1")))
    result.update(
        host=socket.gethostname(),
        gloo_interface=os.environ.get("GLOO_SOCKET_IFNAME"),
        published=published(),
    )
    (out_dir / f"result.rank{os.environ['RANK']}.json").write_text(json.dumps(result))
