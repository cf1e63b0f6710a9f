"""A user's own ``callbacks`` module beside their script must not break torch-hapi (issue #16).

Python puts the script's directory first on ``sys.path``, so a ``callbacks.py`` there hides the
top-level ``callbacks`` package that torch-hapi installs. ``hapi`` then loads its own package from
where it is installed, as ``hapi.callbacks``, says so in one line, and leaves the user's module alone.
Each test runs a real script in a fresh interpreter, since the point is what ``sys.path`` does.
"""

from __future__ import annotations

import pathlib
import sys
import textwrap

from dist_helpers import child_env, run_bounded

NOTICE = "shadows torch-hapi's callbacks package"

# Trains one epoch with a hapi callback, a callback of the user's and ModelCheckpoint, then prints
# what the user would look at. Imports come in the order the user's files ask for them.
TRAIN = """
import torch
from torch import nn
from hapi import Model
import hapi.callbacks
from hapi.callbacks import BackupAndRestore, History, ModelCheckpoint
from hapi.callbacks.checkpoint import ModelCheckpoint as FromSubmodule

torch.manual_seed(0)
x = torch.randn(32, 4)
y = x[:, :3].argmax(dim=1)
model = Model(nn.Linear(4, 3))
model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
seen = Seen()
history = model.fit((x, y), batch_size=8, epochs=1, verbose=0,
                    callbacks=[seen, ModelCheckpoint(save_dir="ckpt")])
print("history:", isinstance(history, History), len(history.history["loss"]))
print("user callback epochs:", seen.epochs)
print("submodule same:", FromSubmodule is ModelCheckpoint)
print("restore is a Callback:", issubclass(BackupAndRestore, hapi.callbacks.Callback))
import os
print("checkpoint written:", os.path.isfile(os.path.join("ckpt", "final.pt")))
"""


def _run(directory: pathlib.Path, files: dict[str, str], **env: str):
    for name, text in files.items():
        (directory / name).write_text(textwrap.dedent(text))
    result = run_bounded(
        [sys.executable, "script.py"], timeout=60, env=child_env(**env), cwd=directory
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def test_a_users_callbacks_py_beside_the_script_does_not_break_hapi(tmp_path):
    users = "class MyCallback:\n    pass\n"
    script = (
        "from hapi import Model\nimport callbacks\n"
        "print('user module:', callbacks.MyCallback.__name__)\n"
        "from hapi.callbacks import Callback\n"
        "class Seen(Callback):\n    epochs = 0\n"
        "    def on_epoch_end(self, epoch, logs=None):\n        Seen.epochs += 1\n" + TRAIN
    )
    result = _run(tmp_path, {"callbacks.py": users, "script.py": script})
    assert "user module: MyCallback" in result.stdout
    assert "history: True 1" in result.stdout
    assert "user callback epochs: 1" in result.stdout
    assert "submodule same: True" in result.stdout
    assert "restore is a Callback: True" in result.stdout
    assert "checkpoint written: True" in result.stdout
    notices = [line for line in result.stderr.splitlines() if NOTICE in line]
    assert notices == [
        "torch-hapi: ./callbacks.py shadows torch-hapi's callbacks package; torch-hapi uses "
        "its own (importable as hapi.callbacks), and `import callbacks` gives yours."
    ], result.stderr


def test_a_users_callbacks_py_may_itself_build_on_hapi_callbacks(tmp_path):
    # The common layout: callbacks.py holds the project's own callbacks, subclassing hapi's, and the
    # script imports it before hapi. Run as rank 1 of a torchrun job, which stays quiet: every
    # process imports hapi, and one line per job is enough.
    users = """
        from hapi.callbacks import Callback

        class Seen(Callback):
            epochs = 0

            def on_epoch_end(self, epoch, logs=None):
                Seen.epochs += 1
        """
    script = "from callbacks import Seen\n" + TRAIN
    result = _run(tmp_path, {"callbacks.py": users, "script.py": script}, RANK="1")
    assert "user callback epochs: 1" in result.stdout
    assert "checkpoint written: True" in result.stdout
    assert NOTICE not in result.stderr


def test_without_shadowing_hapi_callbacks_is_the_callbacks_package():
    # This process has nothing in the way (tests run from the repository root).
    import callbacks
    import callbacks.checkpoint
    import callbacks.run
    import hapi
    import hapi.callbacks
    from hapi import _callbacks
    from hapi.callbacks.checkpoint import ModelCheckpoint
    from hapi.callbacks.run import callbacks_for_run

    assert hapi.callbacks is callbacks
    assert hapi.callbacks.EMA is callbacks.EMA and ModelCheckpoint is callbacks.ModelCheckpoint
    assert callbacks_for_run is callbacks.run.callbacks_for_run
    assert hapi.callbacks.checkpoint is callbacks.checkpoint
    assert _callbacks._is_ours(_callbacks._origin_of_callbacks())  # so no notice is printed


def test_processes_started_by_hapi_spawn_stay_quiet(monkeypatch):
    # hapi.spawn's children import the user's script, hence hapi, again while multiprocessing sets
    # them up (checked by hand: 2 processes print the notice once in all; a real spawn costs ~10 s).
    import multiprocessing

    from hapi import _callbacks

    monkeypatch.delenv("RANK", raising=False)
    assert _callbacks._first_process()
    monkeypatch.setattr(multiprocessing.current_process(), "_inheriting", True, raising=False)
    assert not _callbacks._first_process()
