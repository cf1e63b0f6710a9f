"""Paddle's WandbCallback test, translated (paddle.nn -> torch.nn, InputSpec -> counts).

Source: Paddle's test/legacy_test/test_callback_wandb.py (TestWandbCallbacks). MNIST
(cut to 512 samples by a ``__len__`` override) is replaced by 128 random images of its
shape: the test checks the mechanics, not accuracy, must not download, and 512 LeNet
samples each way cost seconds on a shared CPU. Paddle's
test only runs the fit; this one also reads the offline run back (wandb's own .wandb
file) and checks Paddle's names: ``train/<name>`` against ``train/step`` and
``eval/<name>`` against ``epoch``. Like every wandb test here it runs offline and fails
on any network attempt (tests/wandb_offline.py).
"""

from __future__ import annotations

import torch
from wandb_offline import wandb_offline_fixture  # noqa: F401  (the wandb_offline fixture)

from callbacks.wandb import WandbCallback
from hapi import Model
from hapi.metrics import Accuracy
from hapi.models import LeNet


def _mnist_like(n: int = 128, seed: int = 0):
    """Stand-in for MnistDataset (Paddle: 512 items) with Normalize([127.5], [127.5]): values in [-1, 1]."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.rand(n, 1, 28, 28, generator=generator) * 2 - 1
    return images, torch.randint(0, 10, (n,), generator=generator)


def test_wandb_callback(wandb_offline):
    """TestWandbCallbacks.test_wandb_callback: LeNet on MNIST, fit with WandbCallback(project=
    'random', dir=save_dir, anonymous='must', mode='offline'), batch_size=64."""
    torch.manual_seed(0)
    model = Model(LeNet())
    model.prepare(
        optimizer=torch.optim.Adam(model.parameters(), lr=0.001),
        loss=torch.nn.CrossEntropyLoss(),
        metrics=Accuracy(),
    )
    callback = WandbCallback(
        project="random", dir=str(wandb_offline.dir), anonymous="must", mode="offline"
    )
    history = model.fit(
        _mnist_like(), _mnist_like(seed=1), batch_size=64, verbose=0, callbacks=callback
    )

    (run,) = wandb_offline.runs()
    assert run.run.project == "random"
    assert run.exit_code == 0  # finished at the end of training
    assert run.metrics == {
        "train/step": "",
        "train/*": "train/step",
        "epoch": "",
        "eval/*": "epoch",
    }
    train = [row for row in run.history if "train/loss" in row]
    # 2 batches, fit's default log_freq (10): the figures come with the last batch only.
    assert [row["train/step"] for row in train] == [2]
    assert train[0]["train/loss"] == history.history["loss"][0]
    assert train[0]["train/acc"] == history.history["acc"][0]
    assert train[0]["train/lr"] == 0.001
    (evaluation,) = [row for row in run.history if "eval/loss" in row]
    assert evaluation["epoch"] == 0
    assert evaluation["eval/loss"] == history.history["val_loss"][0]
    assert evaluation["eval/acc"] == history.history["val_acc"][0]
