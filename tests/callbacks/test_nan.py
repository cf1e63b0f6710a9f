"""TerminateOnNaN: stop_training at the step whose logs show a non-finite loss."""

import math

import pytest
from stub import attach

from callbacks.nan import TerminateOnNaN


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_batch_loss_stops_at_that_step(bad, capsys):
    cb = TerminateOnNaN()
    model = attach(cb)
    cb.on_train_begin()
    cb.on_epoch_begin(0)
    cb.on_epoch_end(0, {"loss": 1.0})
    cb.on_epoch_begin(1)
    for step, loss in enumerate([0.5, 0.4, bad]):
        assert not model.stop_training
        cb.on_train_batch_end(step, {"batch_size": 8, "loss": loss})
    assert model.stop_training
    assert (
        capsys.readouterr().out
        == f"Epoch 2, step 3: loss is {bad}; stopping training (TerminateOnNaN).\n"
    )


def test_nan_in_the_epoch_logs_stops_too(capsys):
    cb = TerminateOnNaN()
    model = attach(cb)
    cb.on_train_begin()
    cb.on_epoch_begin(0)
    for step in range(4):
        cb.on_train_batch_end(step, {"batch_size": 8})  # log_freq > steps: no loss in batch logs
    assert not model.stop_training
    cb.on_epoch_end(0, {"loss": math.nan, "val_loss": 1.0})
    assert model.stop_training
    assert (
        "Epoch 1, step 4: loss is nan; stopping training (TerminateOnNaN)."
        in capsys.readouterr().out
    )


def test_reported_once_per_fit(capsys):
    cb = TerminateOnNaN()
    attach(cb)
    cb.on_train_begin()
    cb.on_epoch_begin(0)
    cb.on_train_batch_end(0, {"loss": math.nan})
    cb.on_epoch_end(0, {"loss": math.nan})
    assert capsys.readouterr().out.count("TerminateOnNaN") == 1


def test_finite_losses_and_missing_losses_do_not_stop(capsys):
    cb = TerminateOnNaN()
    model = attach(cb)
    cb.on_train_begin()
    cb.on_epoch_begin(0)
    cb.on_train_batch_end(0, {"batch_size": 8})
    cb.on_train_batch_end(
        1, {"batch_size": 8, "loss": 1e30, "acc": math.nan}
    )  # only the loss counts
    cb.on_epoch_end(0, {"loss": 0.0, "val_loss": math.nan})
    assert not model.stop_training
    assert capsys.readouterr().out == ""


def test_rank_1_stops_without_printing(capsys):
    cb = TerminateOnNaN()
    model = attach(cb, rank=1)
    cb.on_train_begin()
    cb.on_epoch_begin(0)
    cb.on_train_batch_end(0, {"loss": math.nan})
    assert model.stop_training
    assert capsys.readouterr().out == ""


# ---- raise_error (Keras 3) ------------------------------------------------------------


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_raise_error_raises_at_the_step_instead_of_stopping(bad, capsys):
    cb = TerminateOnNaN(raise_error=True)
    model = attach(cb, rank=1)  # every rank raises: the loss is the same everywhere
    cb.on_train_begin()
    cb.on_epoch_begin(1)
    cb.on_train_batch_end(0, {"loss": 0.5})
    with pytest.raises(
        RuntimeError,
        match=rf"NaN or Inf loss encountered at epoch 2, step 2: the logged training loss is "
        rf"{bad} \(TerminateOnNaN\(raise_error=True\) ends fit here, without on_train_end\)\. "
        r"Lower the learning rate",
    ):
        cb.on_train_batch_end(1, {"loss": bad})
    assert not model.stop_training
    assert capsys.readouterr().out == ""


def test_raise_error_at_the_epoch_end_too():
    cb = TerminateOnNaN(raise_error=True)
    attach(cb)
    cb.on_train_begin()
    cb.on_epoch_begin(0)
    with pytest.raises(RuntimeError, match=r"at epoch 1: the logged training loss is nan"):
        cb.on_epoch_end(0, {"loss": math.nan})


def test_raise_error_with_finite_losses_does_nothing():
    cb = TerminateOnNaN(raise_error=True)
    model = attach(cb)
    cb.on_train_begin()
    cb.on_epoch_begin(0)
    cb.on_train_batch_end(0, {"loss": 1.0})
    cb.on_epoch_end(0, {"loss": 1.0})
    assert not model.stop_training
