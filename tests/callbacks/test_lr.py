"""LRScheduler and ReduceLROnPlateau: the learning rate in optimizer.param_groups
is what a user notices."""

import pytest
import torch
from stub import StubModel, attach

from callbacks.lr import LRScheduler, ReduceLROnPlateau


def lr_of(model, group=0):
    return model.optimizer.param_groups[group]["lr"]


# ---- LRScheduler -----------------------------------------------------------


def test_steps_once_per_epoch_by_default():
    model = StubModel(lr=0.1)
    cb = LRScheduler(torch.optim.lr_scheduler.StepLR(model.optimizer, step_size=1, gamma=0.5))
    attach(cb, model)
    cb.on_train_begin()
    for epoch in range(2):
        cb.on_epoch_begin(epoch)
        for step in range(3):
            model.optimizer_step()
            cb.on_train_batch_end(step, {"batch_size": 8})
        assert lr_of(model) == pytest.approx(0.1 * 0.5**epoch)  # batches do not move it
        cb.on_epoch_end(epoch, {"loss": 1.0})
        assert lr_of(model) == pytest.approx(0.1 * 0.5 ** (epoch + 1))


def test_by_step_follows_optimizer_steps_not_batches():
    model = StubModel(lr=0.1)
    cb = LRScheduler(
        torch.optim.lr_scheduler.StepLR(model.optimizer, step_size=1, gamma=0.5), by_step=True
    )
    attach(cb, model)
    cb.on_train_begin()
    cb.on_epoch_begin(0)
    for step in range(6):  # accumulate_grad_batches=2: the optimizer steps on odd batches
        if step % 2 == 1:
            model.optimizer_step()
        cb.on_train_batch_end(step, {"batch_size": 8})
    assert model.step == 3
    assert lr_of(model) == pytest.approx(0.1 * 0.5**3)
    cb.on_epoch_end(0, {"loss": 1.0})
    assert lr_of(model) == pytest.approx(0.1 * 0.5**3)  # by_step: the epoch end does not step


def test_by_step_counts_only_steps_taken_after_train_begin():
    model = StubModel(lr=0.1)
    model.step = 100  # a resumed run
    cb = LRScheduler(
        torch.optim.lr_scheduler.StepLR(model.optimizer, step_size=1, gamma=0.5), by_step=True
    )
    attach(cb, model)
    cb.on_train_begin()
    model.optimizer_step()
    cb.on_train_batch_end(0, {})
    assert lr_of(model) == pytest.approx(0.05)


def test_one_cycle_by_step_reaches_its_peak_mid_run():
    model = StubModel(lr=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        model.optimizer, max_lr=1.0, total_steps=10, pct_start=0.5
    )
    cb = LRScheduler(sched, by_step=True)
    attach(cb, model)
    cb.on_train_begin()
    seen = []
    for step in range(9):
        model.optimizer_step()
        cb.on_train_batch_end(step, {})
        seen.append(lr_of(model))
    assert max(seen) == pytest.approx(1.0)
    assert seen[-1] < 0.01


def test_torch_reduce_on_plateau_points_to_the_callback():
    model = StubModel()
    with pytest.raises(TypeError, match=r"Use callbacks\.ReduceLROnPlateau"):
        LRScheduler(torch.optim.lr_scheduler.ReduceLROnPlateau(model.optimizer))


def test_a_non_scheduler_is_a_type_error():
    model = StubModel()
    with pytest.raises(
        TypeError,
        match=r"needs a torch\.optim\.lr_scheduler\.LRScheduler instance.*; "
        r"received an object of type SGD",
    ):
        LRScheduler(model.optimizer)


# ---- ReduceLROnPlateau -----------------------------------------------------


def two_group_model(lr_a=0.1, lr_b=0.01):
    model = StubModel()
    model.optimizer = torch.optim.SGD(
        [
            {"params": [model.network.weight], "lr": lr_a},
            {"params": [model.network.bias], "lr": lr_b},
        ]
    )
    return model


def feed(cb, values, key="val_loss"):
    for epoch, value in enumerate(values):
        cb.on_epoch_begin(epoch)
        cb.on_epoch_end(epoch, {"loss": 1.0, key: value})


def test_plateau_multiplies_every_group_after_patience_epochs(capsys):
    model = two_group_model()
    cb = ReduceLROnPlateau(factor=0.5, patience=2)
    attach(cb, model)
    cb.on_train_begin()
    feed(cb, [1.0, 1.0])
    assert (lr_of(model, 0), lr_of(model, 1)) == (0.1, 0.01)
    cb.on_epoch_end(2, {"val_loss": 1.0})
    assert lr_of(model, 0) == pytest.approx(0.05) and lr_of(model, 1) == pytest.approx(0.005)
    assert cb.wait == 0
    expected = "Epoch 3: ReduceLROnPlateau reducing learning rate: 0.1 -> 0.05, 0.01 -> 0.005."
    assert expected in capsys.readouterr().out


def test_improvement_resets_the_wait():
    model = StubModel(lr=0.1)
    cb = ReduceLROnPlateau(factor=0.5, patience=2, verbose=0)
    attach(cb, model)
    cb.on_train_begin()
    feed(cb, [1.0, 1.0, 0.5, 0.5])
    assert lr_of(model) == 0.1
    cb.on_epoch_end(4, {"val_loss": 0.5})
    assert lr_of(model) == pytest.approx(0.05)


def test_min_lr_bounds_the_reduction_and_stops_it():
    model = StubModel(lr=0.1)
    cb = ReduceLROnPlateau(factor=0.1, patience=0, min_lr=0.05, verbose=0)
    attach(cb, model)
    cb.on_train_begin()
    feed(cb, [1.0, 1.0])
    assert lr_of(model) == pytest.approx(0.05)
    feed(cb, [1.0, 1.0])
    assert lr_of(model) == pytest.approx(0.05)


def test_cooldown_skips_epochs_after_a_reduction():
    model = StubModel(lr=1.0)
    cb = ReduceLROnPlateau(factor=0.5, patience=1, cooldown=2, verbose=0)
    attach(cb, model)
    cb.on_train_begin()
    history = []
    for epoch in range(7):
        cb.on_epoch_end(epoch, {"val_loss": 1.0})
        history.append(lr_of(model))
    # reduce at 1; cooldown epochs 2, 3; counting again from 4 -> reduce at 4; cooldown 5, 6
    assert history == [1.0, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25]


def test_accuracy_plateau_in_auto_mode():
    model = StubModel(lr=0.1)
    cb = ReduceLROnPlateau(monitor="val_acc", factor=0.5, patience=1, verbose=0)
    attach(cb, model)
    cb.on_train_begin()
    feed(cb, [0.5, 0.6, 0.7], key="val_acc")
    assert lr_of(model) == 0.1
    cb.on_epoch_end(3, {"val_acc": 0.6})
    assert lr_of(model) == pytest.approx(0.05)


def test_rank_1_reduces_silently(capsys):
    model = StubModel(lr=0.1)
    cb = ReduceLROnPlateau(factor=0.5, patience=0)
    attach(cb, model, rank=1)
    cb.on_train_begin()
    feed(cb, [1.0, 1.0])
    assert lr_of(model) == pytest.approx(0.05)
    assert capsys.readouterr().out == ""


def test_missing_monitor_warns_and_leaves_the_lr():
    model = StubModel(lr=0.1)
    cb = ReduceLROnPlateau(patience=0)
    attach(cb, model)
    cb.on_train_begin()
    with pytest.warns(UserWarning, match=r"Available keys: \['loss'\]"):
        for epoch in range(3):
            cb.on_epoch_end(epoch, {"loss": 1.0})
    assert lr_of(model) == 0.1


@pytest.mark.parametrize("factor", [0, 1.0, 1.5, -0.5])
def test_factor_must_be_between_0_and_1(factor):
    with pytest.raises(ValueError, match=r"factor must be in \(0, 1\).*received"):
        ReduceLROnPlateau(factor=factor)


def test_bad_patience_cooldown_and_min_lr_are_refused():
    with pytest.raises(ValueError, match=r"patience must be a non-negative int; received -1"):
        ReduceLROnPlateau(patience=-1)
    with pytest.raises(ValueError, match=r"cooldown must be a non-negative int; received 0.5"):
        ReduceLROnPlateau(cooldown=0.5)
    with pytest.raises(ValueError, match=r"min_lr must be a non-negative number; received -1"):
        ReduceLROnPlateau(min_lr=-1)


def test_no_optimizer_is_a_clear_error():
    model = StubModel()
    model.optimizer = None
    cb = ReduceLROnPlateau()
    attach(cb, model)
    with pytest.raises(RuntimeError, match=r"model\.prepare\(optimizer=\.\.\.\)"):
        cb.on_train_begin()
