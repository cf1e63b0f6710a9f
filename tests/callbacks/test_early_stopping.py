"""EarlyStopping, driven hook by hook with fake logs (Keras style)."""

import warnings

import pytest
import torch
from stub import attach

from callbacks.early_stopping import EarlyStopping


def run_epochs(cb, model, values, key="val_loss", weights=None):
    """Feed one monitored value per epoch; return the epoch at which training stopped."""
    cb.on_train_begin()
    for epoch, value in enumerate(values):
        cb.on_epoch_begin(epoch)
        if weights is not None:
            with torch.no_grad():
                model.network.weight.fill_(weights[epoch])
        cb.on_epoch_end(epoch, {"loss": 1.0, key: value})
        if model.stop_training:
            cb.on_train_end({"loss": 1.0, key: value})
            return epoch
    cb.on_train_end()
    return None


def test_flat_val_loss_with_patience_2_stops_after_the_third_epoch(capsys):
    cb = EarlyStopping(patience=2)
    model = attach(cb)
    assert run_epochs(cb, model, [1.0] * 10) == 2
    assert cb.stopped_epoch == 2
    assert "Epoch 3: early stopping" in capsys.readouterr().out


def test_patience_0_stops_at_the_first_epoch_without_improvement():
    cb = EarlyStopping(patience=0)
    model = attach(cb)
    assert run_epochs(cb, model, [1.0, 0.9, 0.95, 0.5]) == 2


def test_an_improvement_restarts_the_count():
    cb = EarlyStopping(patience=2)
    model = attach(cb)
    # improvements at epochs 0, 1, 3; epochs 4 and 5 do not improve
    assert run_epochs(cb, model, [1.0, 0.9, 0.95, 0.8, 0.85, 0.86, 0.1]) == 5
    assert cb.best == 0.8 and cb.best_epoch == 3


def test_min_delta_ignores_tiny_improvements():
    cb = EarlyStopping(patience=1, min_delta=0.1)
    model = attach(cb)
    assert run_epochs(cb, model, [1.0, 0.95, 0.91, 0.5]) == 1


def test_accuracy_is_maximised_in_auto_mode():
    cb = EarlyStopping(monitor="val_acc", patience=1)
    model = attach(cb)
    assert run_epochs(cb, model, [0.5, 0.6, 0.7, 0.65, 0.9], key="val_acc") == 3


def test_baseline_must_be_beaten_from_the_start():
    cb = EarlyStopping(patience=2, baseline=0.5)
    model = attach(cb)
    assert run_epochs(cb, model, [0.6, 0.6, 0.6, 0.6]) == 1


def test_restore_best_weights_loads_the_best_epoch_weights():
    cb = EarlyStopping(patience=2, restore_best_weights=True, verbose=0)
    model = attach(cb)
    stopped = run_epochs(cb, model, [1.0, 0.5, 0.7, 0.8, 0.9], weights=[1.0, 2.0, 3.0, 4.0, 5.0])
    assert stopped == 3
    assert torch.equal(model.network.weight, torch.full_like(model.network.weight, 2.0))


def test_best_weights_are_a_copy_not_a_view():
    cb = EarlyStopping(patience=0, restore_best_weights=True, verbose=0)
    model = attach(cb)
    cb.on_train_begin()
    with torch.no_grad():
        model.network.weight.fill_(7.0)
    cb.on_epoch_end(0, {"val_loss": 0.1})
    with torch.no_grad():
        model.network.weight.fill_(-1.0)  # an in-place optimizer update
    cb.on_epoch_end(1, {"val_loss": 0.2})
    assert model.stop_training
    cb.on_train_end()  # Keras 3: the weights come back when training ends
    assert torch.equal(model.network.weight, torch.full_like(model.network.weight, 7.0))


def test_without_restore_the_last_weights_stay():
    cb = EarlyStopping(patience=1, verbose=0)
    model = attach(cb)
    assert run_epochs(cb, model, [0.5, 0.7], weights=[1.0, 2.0]) == 1
    assert torch.equal(model.network.weight, torch.full_like(model.network.weight, 2.0))


def test_missing_monitor_warns_and_never_stops():
    cb = EarlyStopping(patience=0)
    model = attach(cb)
    with pytest.warns(UserWarning, match=r"'val_loss'.*Available keys: \['acc', 'loss'\]"):
        cb.on_train_begin()
        for epoch in range(3):
            cb.on_epoch_end(epoch, {"loss": 1.0, "acc": 0.5})
    assert not model.stop_training


def test_on_train_begin_resets_the_state_for_a_second_fit():
    cb = EarlyStopping(patience=1, verbose=0)
    model = attach(cb)
    assert run_epochs(cb, model, [0.5, 0.6]) == 1
    model.stop_training = False
    # the new fit starts from scratch: 0.9 is an improvement over +inf, not worse than 0.5
    assert run_epochs(cb, model, [0.9, 0.8, 0.7]) is None
    assert cb.stopped_epoch is None and cb.wait == 0


def test_rank_1_stops_too_but_prints_nothing(capsys):
    cb = EarlyStopping(patience=0, restore_best_weights=True)
    model = attach(cb, rank=1)
    assert run_epochs(cb, model, [0.5, 0.6], weights=[1.0, 2.0]) == 1
    assert torch.equal(model.network.weight, torch.full_like(model.network.weight, 1.0))
    assert capsys.readouterr().out == ""


def test_verbose_0_prints_nothing(capsys):
    cb = EarlyStopping(patience=0, verbose=0)
    model = attach(cb)
    assert run_epochs(cb, model, [0.5, 0.6]) == 1
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("patience", [-1, 1.5, "2", True])
def test_patience_must_be_a_non_negative_int(patience):
    with pytest.raises(ValueError, match=r"patience must be a non-negative int; received"):
        EarlyStopping(patience=patience)


def test_an_unknown_mode_warns_and_means_auto():
    with pytest.warns(UserWarning, match=r"EarlyStopping: mode 'biggest' is unknown; using 'auto'"):
        cb = EarlyStopping(monitor="val_acc", mode="biggest")
    assert cb.mode == "max"


# ---- start_from_epoch (Keras 3) ------------------------------------------------------


def test_start_from_epoch_ignores_the_warm_up_epochs():
    # Without it, patience 1 stops at epoch 1 (0.9 is worse than 0.5).
    plain = EarlyStopping(patience=1)
    assert run_epochs(plain, attach(plain), [0.1, 0.2, 0.9]) == 1
    cb = EarlyStopping(patience=1, start_from_epoch=2, restore_best_weights=True, verbose=0)
    model = attach(cb)
    values = [0.1, 0.2, 0.9, 0.8, 0.85, 0.86]
    assert run_epochs(cb, model, values, weights=[0, 1, 2, 3, 4, 5]) == 4
    # epochs 0 and 1 (better than anything after) are not watched: best and weights from 3
    assert (cb.best, cb.best_epoch) == (0.8, 3)
    assert torch.equal(model.network.weight, torch.full_like(model.network.weight, 3.0))


def test_start_from_epoch_with_patience_0_never_stops_in_the_warm_up():
    cb = EarlyStopping(patience=0, start_from_epoch=3)
    model = attach(cb)
    assert run_epochs(cb, model, [0.5, 0.6, 0.7, 0.8, 0.9]) == 4


def test_start_from_epoch_beyond_the_fit_restores_nothing_and_says_why(capsys):
    cb = EarlyStopping(start_from_epoch=5, restore_best_weights=True)
    model = attach(cb)
    assert run_epochs(cb, model, [0.5, 0.6], weights=[1.0, 2.0]) is None
    assert torch.equal(model.network.weight, torch.full_like(model.network.weight, 2.0))
    assert "no epoch logged 'val_loss' from epoch 6 on" in capsys.readouterr().out


@pytest.mark.parametrize("start", [-1, 0.5, "1"])
def test_start_from_epoch_must_be_a_non_negative_int(start):
    with pytest.raises(ValueError, match=r"start_from_epoch must be a non-negative int; received"):
        EarlyStopping(start_from_epoch=start)


# ---- restore_best_weights: Keras 3's choice of epoch ----------------------------------


def test_a_baseline_never_beaten_restores_the_best_epoch_keras_3():
    """Keras 3's early_stopping_test: 6 epochs never below baseline 0.5 stop after 5 and bring
    back epoch 2 (0.7); the old code kept epoch 4's weights."""
    cb = EarlyStopping(patience=5, baseline=0.5, restore_best_weights=True, verbose=0)
    model = attach(cb)
    losses = [0.9, 0.8, 0.7, 0.71, 0.72, 0.73]
    assert run_epochs(cb, model, losses, weights=list(range(6))) == 4
    assert torch.equal(model.network.weight, torch.full_like(model.network.weight, 2.0))


def test_all_nan_restores_the_first_watched_epoch_and_says_so(capsys):
    cb = EarlyStopping(patience=1, start_from_epoch=1, restore_best_weights=True)
    model = attach(cb)
    assert run_epochs(cb, model, [0.1, float("nan"), float("nan")], weights=[0, 1, 2]) == 1
    assert torch.equal(model.network.weight, torch.full_like(model.network.weight, 1.0))
    assert (
        "Restoring model weights from the end of the first monitored epoch: 2 "
        "(no value of 'val_loss' was a finite number)." in capsys.readouterr().out
    )


# ---- save_best_model (Paddle) -----------------------------------------------------------


def test_save_best_model_saves_at_each_improvement_into_fits_save_dir(tmp_path, capsys):
    cb = EarlyStopping(patience=2)
    model = attach(cb, save_dir=str(tmp_path))
    assert run_epochs(cb, model, [1.0, 0.5, 0.7, 0.4, 0.6, 0.9]) == 5
    best = str(tmp_path / "best_model")
    assert model.saved == [best, best, best]  # epochs 0, 1 and 3 improved
    assert cb.best_model_path == best + ".pt"
    out = capsys.readouterr().out
    assert f"the best model (val_loss=0.4) is saved at {best}.pt." in out


def test_save_best_model_only_when_the_baseline_is_beaten(tmp_path):
    cb = EarlyStopping(patience=3, baseline=0.6, verbose=0)
    model = attach(cb, save_dir=str(tmp_path))
    run_epochs(cb, model, [0.9, 0.7, 0.5, 0.55, 0.4])
    assert len(model.saved) == 2  # epochs 2 and 4; 0.9 and 0.7 do not beat 0.6


def test_nothing_is_saved_without_fits_save_dir_or_when_switched_off(tmp_path):
    cb = EarlyStopping(patience=2)
    model = attach(cb)  # params without save_dir: fit(save_dir=None)
    run_epochs(cb, model, [1.0, 0.5, 0.4])
    assert model.saved == [] and cb.best_model_path is None
    cb = EarlyStopping(patience=2, save_best_model=False)
    model = attach(cb, save_dir=str(tmp_path))
    run_epochs(cb, model, [1.0, 0.5, 0.4])
    assert model.saved == [] and list(tmp_path.iterdir()) == []


def test_rank_1_saves_too_because_saving_is_collective(tmp_path, capsys):
    cb = EarlyStopping(patience=2)
    model = attach(cb, rank=1, save_dir=str(tmp_path))
    run_epochs(cb, model, [1.0, 0.5])
    assert len(model.saved) == 2  # model.save runs on every rank; rank 0 alone writes
    assert capsys.readouterr().out == ""


def test_no_warning_when_the_monitor_is_present():
    cb = EarlyStopping(patience=0)
    attach(cb)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cb.on_train_begin()
        cb.on_epoch_end(0, {"val_loss": 1.0})


def test_arguments_after_patience_are_keywords_so_paddle_and_keras_orders_cannot_misbind():
    """Paddle's order is (monitor, mode, patience, verbose, min_delta, ...), ours puts min_delta
    fourth: a Paddle call with five positional arguments would take verbose for min_delta."""
    with pytest.raises(TypeError, match="positional"):
        EarlyStopping("loss", "min", 3, 1, 0.01)
    stopper = EarlyStopping("val_loss", "min", 3, min_delta=0.01, verbose=0)
    assert (stopper.patience, stopper.min_delta) == (3, 0.01)
