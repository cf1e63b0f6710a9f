"""An explicit ``mode`` wins over the monitored name, in each of the three monitor callbacks.

Every case watches a name that makes ``mode="auto"`` pick the opposite direction
(``val_acc`` with ``mode="min"``, ``val_loss`` with ``mode="max"``), so a callback
that ignored ``mode`` would act on other epochs. Each test also runs the same
values with ``mode="auto"`` and checks that the outcome differs: the values tell
the two directions apart, so the test can fail.
"""

import os

import pytest
import torch
from stub import StubModel, attach

from callbacks.checkpoint import ModelCheckpoint
from callbacks.early_stopping import EarlyStopping
from callbacks.lr import ReduceLROnPlateau

# (monitor, explicit mode opposite to what "auto" picks for that name)
OPPOSITES = [("val_acc", "min"), ("val_loss", "max")]


def oriented(values, mode):
    """``values`` written for mode="min"; mirrored (1 - v) for mode="max", so the same
    epochs improve in either direction."""
    return values if mode == "min" else [1.0 - v for v in values]


def run(cb, model, monitor, values):
    """Drive fit's hooks, one monitored value per epoch; the network's weight holds the
    epoch index, so a file or restored state says which epoch it came from.
    Returns the learning rate after each epoch and the epoch training stopped at."""
    cb.on_train_begin()
    lrs, stopped = [], None
    for epoch, value in enumerate(values):
        cb.on_epoch_begin(epoch)
        with torch.no_grad():
            model.network.weight.fill_(float(epoch))
        cb.on_epoch_end(epoch, {"loss": 1.0, monitor: value})
        lrs.append(model.optimizer.param_groups[0]["lr"])
        if model.stop_training:
            stopped = epoch
            break
    cb.on_train_end()
    return lrs, stopped


def weight_of(model):
    return model.network.weight.flatten()[0].item()


# ---- ModelCheckpoint --------------------------------------------------------


def checkpoint_run(tmp_path, monitor, mode, values):
    save_dir = tmp_path / mode
    cb = ModelCheckpoint(save_dir, monitor=monitor, mode=mode, save_best_only=True)
    model = attach(cb)
    run(cb, model, monitor, values)
    best = torch.load(save_dir / "best.pt", weights_only=True)["weight"].flatten()[0].item()
    return len(model.saved), best


@pytest.mark.parametrize("monitor,mode", OPPOSITES)
def test_checkpoint_saves_best_in_the_explicit_direction(tmp_path, monitor, mode):
    # In `mode`'s direction epochs 0, 2 and 4 improve; in the opposite one, 0 and 1.
    values = oriented([0.5, 0.7, 0.4, 0.6, 0.3], mode)
    saves, best_epoch = checkpoint_run(tmp_path, monitor, mode, values)
    assert (saves, best_epoch) == (3, 4.0)
    assert os.listdir(tmp_path / mode) == ["best.pt"]
    assert checkpoint_run(tmp_path, monitor, "auto", values) == (2, 1.0)


# ---- EarlyStopping ----------------------------------------------------------


def early_stopping_run(monitor, mode, values):
    cb = EarlyStopping(monitor=monitor, mode=mode, patience=1, restore_best_weights=True, verbose=0)
    model = attach(cb)
    _, stopped = run(cb, model, monitor, values)
    return stopped, cb.best_epoch, weight_of(model)


@pytest.mark.parametrize("monitor,mode", OPPOSITES)
def test_early_stopping_stops_and_restores_in_the_explicit_direction(monitor, mode):
    # In `mode`'s direction epochs 0 and 1 improve and 2 does not: stop at epoch 2
    # with epoch 1's weights. The opposite direction stops at epoch 1, keeping epoch 0's.
    values = oriented([0.5, 0.4, 0.45, 0.3, 0.2], mode)
    assert early_stopping_run(monitor, mode, values) == (2, 1, 1.0)
    assert early_stopping_run(monitor, "auto", values) == (1, 0, 0.0)


# ---- ReduceLROnPlateau ------------------------------------------------------


def plateau_lrs(monitor, mode, values):
    model = StubModel(lr=0.1)
    cb = ReduceLROnPlateau(
        monitor=monitor, mode=mode, factor=0.5, patience=1, min_delta=0.0, verbose=0
    )
    attach(cb, model)
    lrs, _ = run(cb, model, monitor, values)
    return lrs


@pytest.mark.parametrize("monitor,mode", OPPOSITES)
def test_plateau_lowers_the_lr_in_the_explicit_direction(monitor, mode):
    # In `mode`'s direction epochs 2, 4 and 5 do not improve: the lr halves after each.
    values = oriented([0.5, 0.4, 0.45, 0.3, 0.35, 0.36], mode)
    assert plateau_lrs(monitor, mode, values) == pytest.approx(
        [0.1, 0.1, 0.05, 0.05, 0.025, 0.0125]
    )
    # The opposite direction sees no improvement after epoch 0: the lr halves every epoch.
    assert plateau_lrs(monitor, "auto", values) == pytest.approx([0.1 * 0.5**e for e in range(6)])


# ---- an unknown mode: a warning, then "auto" (Paddle and Keras) ---------------------------


def test_an_unknown_mode_acts_as_auto_in_each_of_the_three(tmp_path):
    """The old code raised ValueError for each of these; now each warns once and behaves
    exactly as with mode="auto"."""
    values = [0.5, 0.4, 0.45, 0.3, 0.35, 0.36]
    with pytest.warns(UserWarning, match=r"ModelCheckpoint: mode 'x' is unknown"):
        unknown = checkpoint_run(tmp_path / "x", "val_acc", "x", values)
    assert unknown == checkpoint_run(tmp_path / "auto", "val_acc", "auto", values)
    with pytest.warns(UserWarning, match=r"EarlyStopping: mode 'auto_' is unknown"):
        unknown = early_stopping_run("val_acc", "auto_", values)
    assert unknown == early_stopping_run("val_acc", "auto", values)
    with pytest.warns(UserWarning, match=r"ReduceLROnPlateau: mode '1' is unknown"):
        unknown = plateau_lrs("val_loss", "1", values)
    assert unknown == plateau_lrs("val_loss", "auto", values)
