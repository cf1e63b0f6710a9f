"""An epoch's figures are means over all of its samples, never the last batch's.

With ``lr=0`` the weights never change, so the training pass over the data must
report exactly what ``evaluate`` reports on the same data, and what the loss and
accuracy computed directly over every sample are. The data make the last
(short) batch very different from the rest, so a loop that logged the last
batch's figures would fail.
"""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "distributed"))
from figures_script import Logs, direct_figures, prepared  # noqa: E402  (one process here, N there)
from figures_script import problem as wrong_at_the_end  # noqa: E402

SAMPLES, BATCH = 10, 4  # batches of 4, 4 and 2
WRONG = 2  # the last two labels are wrong: the last batch is all mistakes


def problem(samples=SAMPLES, wrong=WRONG):
    """A fixed linear classifier (logits = 3 * x[:, :3]) that is right on every sample
    but the last ``wrong`` ones, where it is confidently wrong."""
    return wrong_at_the_end(samples, wrong)


def assert_figures(actual, expected):
    for name, value in expected.items():
        assert actual[name] == pytest.approx(value, rel=1e-6, abs=1e-6), name


def test_epoch_figures_are_means_over_every_batch_not_the_last():
    network, x, y = problem()
    everything = direct_figures(network, x, y)
    last_batch = direct_figures(network, x[8:], y[8:])
    # The data can tell the two apart: the last batch is all mistakes, with a high loss.
    assert everything["acc"] == 0.8 and last_batch["acc"] == 0.0
    assert last_batch["loss"] > everything["loss"] + 1.0

    model = prepared(network)
    logs = Logs()
    history = model.fit(
        (x, y),
        eval_data=(x, y),
        batch_size=BATCH,
        epochs=2,
        shuffle=False,
        log_freq=1,
        verbose=0,
        callbacks=[logs],
    )
    evaluated = model.evaluate((x, y), batch_size=BATCH, verbose=0)
    assert_figures(evaluated, everything)
    assert set(history.history) == {
        "loss",
        "acc",
        "multiclass_accuracy",
        "val_loss",
        "val_acc",
        "val_multiclass_accuracy",
        "lr",
    }
    for epoch in range(2):
        assert_figures({k: v[epoch] for k, v in history.history.items()}, everything)
        assert_figures(logs.epoch_end[epoch], everything)
        assert_figures(logs.epoch_end[epoch], {f"val_{k}": v for k, v in everything.items()})

    # Batch logs (log_freq=1) carry the running means over the epoch so far.
    first_epoch = logs.batch_end[:3]
    assert [b["samples"] for b in first_epoch] == [4, 8, 10]
    assert [b["batch_size"] for b in first_epoch] == [4, 4, 2]
    for batch_logs, end in zip(first_epoch, (4, 8, 10)):
        assert_figures(batch_logs, direct_figures(network, x[:end], y[:end]))
