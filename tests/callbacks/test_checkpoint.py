"""ModelCheckpoint: which files appear, with which weights, and on which ranks save() is called."""

import os
import re
import warnings

import pytest
import torch
from stub import attach

from callbacks.checkpoint import ModelCheckpoint


def fit(cb, model, val_losses, key="val_loss"):
    cb.on_train_begin()
    for epoch, value in enumerate(val_losses):
        cb.on_epoch_begin(epoch)
        with torch.no_grad():
            model.network.weight.fill_(float(epoch))  # weights tell which epoch a file holds
        logs = {"loss": 1.0} if value is None else {"loss": 1.0, key: value}
        cb.on_epoch_end(epoch, logs)
    cb.on_train_end()


def weight_in(path):
    return torch.load(path, weights_only=True)["weight"].flatten()[0].item()


def test_periodic_best_and_final_files(tmp_path):
    save_dir = str(tmp_path / "ckpt")
    cb = ModelCheckpoint(save_dir, save_freq=2)
    model = attach(cb)
    fit(cb, model, [1.0, 0.8, 0.9, 0.7])
    assert sorted(os.listdir(save_dir)) == ["0.pt", "2.pt", "best.pt", "final.pt"]
    names = [os.path.relpath(p, save_dir) for p in model.saved]
    # best.pt first: the best is judged before any file of that epoch end is written.
    assert names == ["best", "0", "best", "2", "best", "final"]
    assert weight_in(os.path.join(save_dir, "0.pt")) == 0.0
    assert weight_in(os.path.join(save_dir, "2.pt")) == 2.0
    assert weight_in(os.path.join(save_dir, "best.pt")) == 3.0
    assert weight_in(os.path.join(save_dir, "final.pt")) == 3.0


def test_best_follows_the_monitor_and_mode(tmp_path):
    save_dir = tmp_path / "ckpt"
    cb = ModelCheckpoint(save_dir, monitor="val_acc", save_best_only=True)
    model = attach(cb)
    with pytest.warns(UserWarning, match="'val_acc'"):  # epoch 3 had no evaluation
        fit(cb, model, [0.5, 0.9, 0.7, None], key="val_acc")
    assert os.listdir(save_dir) == ["best.pt"]
    assert weight_in(save_dir / "best.pt") == 1.0
    assert [os.path.basename(p) for p in model.saved] == ["best", "best"]


def test_save_best_only_with_min_mode(tmp_path):
    cb = ModelCheckpoint(tmp_path, save_best_only=True, mode="min", monitor="val_error")
    model = attach(cb)
    fit(cb, model, [0.3, 0.2, 0.25], key="val_error")
    assert os.listdir(tmp_path) == ["best.pt"]
    assert weight_in(tmp_path / "best.pt") == 1.0


def test_without_evaluation_no_best_and_a_warning_that_says_so(tmp_path):
    cb = ModelCheckpoint(tmp_path / "ckpt")
    model = attach(cb)
    with pytest.warns(UserWarning, match=r"No best\.pt is written"):
        fit(cb, model, [None, None])
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["0.pt", "1.pt", "final.pt"]


def test_save_best_only_with_a_monitor_never_logged_warns_once_and_saves_as_keras(tmp_path):
    # Old: the warning, and no file at all (model.saved == []). Keras writes the file anyway.
    cb = ModelCheckpoint(tmp_path / "ckpt", save_best_only=True)
    model = attach(cb)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(cb, model, [None, None])
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1
    assert re.search(
        r"'val_loss', which is not in the logs\. Available keys: \['loss'\]\. Until it is "
        r"logged, best\.pt is written with the latest weights at every epoch end \(as Keras",
        messages[0],
    )
    assert [os.path.basename(p) for p in model.saved] == ["best", "best"]
    assert os.listdir(tmp_path / "ckpt") == ["best.pt"]
    assert weight_in(tmp_path / "ckpt" / "best.pt") == 1.0  # the latest epoch's weights
    assert cb.best == float("inf")  # nothing was judged


def test_once_the_monitor_was_judged_an_epoch_without_it_keeps_the_best(tmp_path):
    cb = ModelCheckpoint(tmp_path, save_best_only=True)
    model = attach(cb)
    with pytest.warns(UserWarning, match=r"'val_loss'.*best\.pt keeps the best so far"):
        fit(cb, model, [0.5, None, None])
    assert [os.path.basename(p) for p in model.saved] == ["best"]
    assert weight_in(tmp_path / "best.pt") == 0.0


@pytest.mark.parametrize(
    "save_best_only, val_losses, says",
    [
        (False, [None, None], r"No best\.pt is written until it is"),  # no eval_data
        (False, [0.5, None, 0.4], None),  # eval_freq=2: judged at its first epoch end
        (False, [0.5, 0.4], None),
        (True, [None, None], r"Until it is logged, best\.pt is written with the latest"),
        (True, [0.5, None], r"best\.pt keeps the best so far"),
    ],
)
def test_a_monitor_that_is_not_logged_is_said_once_whatever_save_best_only(
    tmp_path, save_best_only, val_losses, says
):
    # Old: without save_best_only, a fit with no eval_data wrote no best.pt and said nothing.
    cb = ModelCheckpoint(tmp_path, save_best_only=save_best_only)
    attach(cb)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(cb, cb.model, val_losses)
    messages = [str(w.message) for w in caught]
    assert len(messages) == (says is not None), messages
    if says is not None:
        assert re.search(r"'val_loss', which is not in the logs.*" + says, messages[0])


def test_verbose_says_why_best_is_written_without_the_monitor(tmp_path, capsys):
    cb = ModelCheckpoint(tmp_path, save_best_only=True, verbose=1)
    attach(cb)
    with pytest.warns(UserWarning):
        fit(cb, cb.model, [None])
    assert "Epoch 1: val_loss not logged yet, saving model to" in capsys.readouterr().out


def test_every_rank_calls_save_because_it_is_collective(tmp_path):
    calls = {}
    for rank in (0, 1):
        cb = ModelCheckpoint(tmp_path / f"rank{rank}", save_freq=1)
        model = attach(cb, rank=rank)
        fit(cb, model, [1.0, 0.5])
        calls[rank] = [os.path.basename(p) for p in model.saved]
    assert calls[0] == calls[1] == ["best", "0", "best", "1", "final"]


def test_verbose_reports_saves_on_main_only(tmp_path, capsys):
    cb = ModelCheckpoint(tmp_path, verbose=1)
    model = attach(cb)
    fit(cb, model, [0.5])
    out = capsys.readouterr().out
    assert f"Epoch 1: saving model to {os.path.join(str(tmp_path), '0')}.pt" in out
    assert "Epoch 1: val_loss improved from inf to 0.5, saving model to" in out
    cb = ModelCheckpoint(tmp_path, verbose=1)
    model = attach(cb, rank=1)
    fit(cb, model, [0.5])
    assert capsys.readouterr().out == ""


def test_paddle_positional_order_is_a_type_error():
    with pytest.raises(
        TypeError, match=r"first argument is save_dir.*received 1 .*ModelCheckpoint\(save_dir="
    ):
        ModelCheckpoint(1, "ckpt")


@pytest.mark.parametrize("save_freq", [0, -1, 1.5, "2"])
def test_save_freq_must_be_a_positive_int(save_freq, tmp_path):
    with pytest.raises(ValueError, match=r"save_freq must be a positive int; received"):
        ModelCheckpoint(tmp_path, save_freq=save_freq)
