"""A user's script type-checks against torch-hapi as installed (PEP 561: ``py.typed``).

mypy runs from a folder outside the repository, on a script that calls the public API, with
the environment's own search path: no MYPYPATH, no PYTHONPATH. It finds ``hapi`` and
``callbacks`` only the way a user's mypy would, through the install (``pip install -e .``
must leave a path that mypy can follow, not an import hook). A second script passes a wrong
type on purpose: mypy must flag it, which proves it read torch-hapi's annotations.
"""

from __future__ import annotations

import pathlib
import sys

import pytest
from dist_helpers import child_env, run_bounded

pytest.importorskip("mypy", reason="mypy is in the test extra: pip install -e '.[test]'")

ROOT = pathlib.Path(__file__).resolve().parents[1]

USER_SCRIPT = '''\
"""A user's training script."""

from __future__ import annotations

import torch
from torch import nn

import hapi
import hapi.distributed
from callbacks import EarlyStopping, History, ModelCheckpoint
from hapi import Model
from hapi.datasets import FashionMNIST
from hapi.metrics import Accuracy
from hapi.callbacks import CSVLogger  # the name to use where a callbacks.py of yours is in the way


def train(epochs: int) -> dict[str, float]:
    if hapi.distributed.rank() == 0:
        print("training on", hapi.distributed.world_size(), "processes")
    model = Model(nn.Sequential(nn.Flatten(), nn.Linear(784, 10)))
    model.prepare(
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
        loss=nn.CrossEntropyLoss(),
        metrics=Accuracy(topk=(1, 2)),
    )
    train_data = FashionMNIST(mode="train")
    test_data = FashionMNIST(mode="test")
    history: History = model.fit(
        train_data,
        eval_data=test_data,
        epochs=epochs,
        batch_size=64,
        verbose=0,
        callbacks=[EarlyStopping(monitor="val_loss", patience=2), ModelCheckpoint("ckpt"), CSVLogger("log.csv")],
    )
    print(history.history["loss"])
    logs: dict[str, float] = model.evaluate(test_data, batch_size=64, verbose=0)
    outputs = model.predict(test_data, batch_size=64, stack_outputs=True, verbose=0)
    print(len(outputs))
    model.save("ckpt/final")
    model.load("ckpt/final")
    return logs


if __name__ == "__main__":
    results = hapi.spawn(train, args=(1,), nprocs=2)
    print(results[0]["loss"])
'''

WRONG_SCRIPT = """\
from torch import nn

from hapi import Model

model = Model(nn.Linear(4, 2))
history = model.fit((None,), epochs="one")
reveal_type(history)
"""


def test_a_users_script_type_checks_against_the_installed_package(tmp_path):
    (tmp_path / "train.py").write_text(USER_SCRIPT)
    (tmp_path / "wrong.py").write_text(WRONG_SCRIPT)
    env = child_env()
    for name in ("PYTHONPATH", "MYPYPATH"):
        env.pop(name, None)
    located = run_bounded(
        [sys.executable, "-c", "import hapi, callbacks; print(hapi.__file__, callbacks.__file__)"],
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert located.returncode == 0, f"torch-hapi is not installed here:\n{located.stderr[-2000:]}"
    command = [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache")]
    command += ["--no-error-summary", "--hide-error-context", "train.py", "wrong.py"]
    done = run_bounded(command, timeout=600, env=env, cwd=tmp_path)
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert [line for line in errors if not line.startswith("wrong.py:")] == [], (
        f"mypy (hapi found at {located.stdout.strip()}):\n{done.stdout[-4000:]}{done.stderr[-2000:]}"
    )
    assert len(errors) == 1 and 'incompatible type "str"; expected "int"' in errors[0], (
        done.stdout[-4000:] + done.stderr[-2000:]
    )
    # fit's return type is read too, through hapi's own view of the callbacks package.
    assert 'Revealed type is "callbacks.history.History"' in done.stdout, done.stdout[-4000:]
