"""LRScheduler and ReduceLROnPlateau: the learning rate in optimizer.param_groups
is what a user notices."""

import pytest
import torch
from stub import StubModel, attach

from callbacks import Callback
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


def steps_taken(**switches):
    """(lr after 3 optimizer steps in epoch 0, lr after its end) for LRScheduler(**switches)."""
    model = StubModel(lr=0.1)
    cb = LRScheduler(
        torch.optim.lr_scheduler.StepLR(model.optimizer, step_size=1, gamma=0.5), **switches
    )
    attach(cb, model)
    cb.on_train_begin()
    cb.on_epoch_begin(0)
    for step in range(3):
        model.optimizer_step()
        cb.on_train_batch_end(step, {"batch_size": 8})
    after_batches = lr_of(model)
    cb.on_epoch_end(0, {"loss": 1.0})
    return cb, after_batches, lr_of(model)


PER_EPOCH, PER_STEP = (0.1, 0.05), (0.1 * 0.5**3, 0.1 * 0.5**3)


@pytest.mark.parametrize(
    "switches, expected",
    [
        ({}, PER_EPOCH),  # torch's convention: the default stays per epoch
        ({"by_step": False}, PER_EPOCH),
        ({"by_step": True}, PER_STEP),
        ({"by_epoch": True}, PER_EPOCH),  # Paddle's keyword
        ({"by_epoch": False}, PER_STEP),  # Paddle: by_epoch=False with by_step unset -> per step
        ({"by_step": True, "by_epoch": False}, PER_STEP),  # Paddle's defaults, spelt out
        ({"by_step": False, "by_epoch": True}, PER_EPOCH),  # Paddle's per-epoch example
    ],
)
def test_by_step_and_paddles_by_epoch_combine(switches, expected):
    cb, after_batches, after_epoch = steps_taken(**switches)
    assert (after_batches, after_epoch) == pytest.approx(expected)
    assert cb.by_step == (expected is PER_STEP)
    # per epoch, the loop makes no per-batch call at all (callbacks.base)
    assert ("on_train_batch_end" in getattr(cb, "unused_hooks", ())) == (expected is PER_EPOCH)


@pytest.mark.parametrize(
    "by_step, by_epoch, says",
    [(True, True, "both per step and per epoch"), (False, False, "never")],
)
def test_contradicting_switches_are_a_clear_error(by_step, by_epoch, says):
    model = StubModel()
    sched = torch.optim.lr_scheduler.StepLR(model.optimizer, step_size=1)
    with pytest.raises(
        ValueError,
        match=rf"received by_step={by_step} and by_epoch={by_epoch}: the scheduler would step "
        rf"{says}\. Pass one of them: by_step=True .* or by_epoch=True",
    ):
        LRScheduler(sched, by_step=by_step, by_epoch=by_epoch)


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


def flat_lrs(cooldown, patience=1, epochs=7):
    model = StubModel(lr=1.0)
    cb = ReduceLROnPlateau(factor=0.5, patience=patience, cooldown=cooldown, verbose=0)
    attach(cb, model)
    cb.on_train_begin()
    history = []
    for epoch in range(epochs):
        cb.on_epoch_end(epoch, {"val_loss": 1.0})
        history.append(lr_of(model))
    return history


def test_cooldown_counts_as_keras_and_paddle():
    # reduce at 1; epoch 2 is the cooldown; epoch 3 (the cooldown-th after) counts -> reduce
    # at 3, then 5. The old count skipped epoch 3 too: [1, .5, .5, .5, .25, .25, .25].
    assert flat_lrs(cooldown=2) == [1.0, 0.5, 0.5, 0.25, 0.25, 0.125, 0.125]
    # patience 2: reduce at 2; epoch 3 cooldown; 4 and 5 count -> reduce at 5
    assert flat_lrs(cooldown=2, patience=2) == [1.0, 1.0, 0.5, 0.5, 0.5, 0.25, 0.25]


def test_cooldown_1_is_the_same_as_0():
    assert flat_lrs(cooldown=1) == flat_lrs(cooldown=0) == [1.0, *(0.5**e for e in range(1, 7))]


def test_an_improvement_during_the_cooldown_sets_the_best():
    model = StubModel(lr=1.0)
    cb = ReduceLROnPlateau(factor=0.5, patience=1, cooldown=3, verbose=0)
    attach(cb, model)
    cb.on_train_begin()
    for epoch, value in enumerate([1.0, 1.0, 0.5, 0.6, 0.6]):
        cb.on_epoch_end(epoch, {"val_loss": value})
    # reduced at 1; 0.5 at epoch 2 (cooldown) is the new best; epoch 4 counts again -> reduce
    assert (cb.best, lr_of(model)) == (0.5, 0.25)


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
    # fit refuses a model without optimizer before any callback's hook runs (the one check).
    from hapi import Model

    model = Model(torch.nn.Linear(2, 1), device="cpu")
    model.prepare(loss=torch.nn.MSELoss())
    data = torch.utils.data.TensorDataset(torch.zeros(4, 2), torch.zeros(4, 1))
    with pytest.raises(RuntimeError, match=r"model\.prepare\(optimizer="):
        model.fit(data, batch_size=2, epochs=1, verbose=0, callbacks=[ReduceLROnPlateau()])


@pytest.mark.parametrize("params", [{}, {"epochs": None, "steps": 5}])
def test_a_factory_driven_outside_fit_says_it_needs_fit(params):
    from hapi import Model

    model = Model(torch.nn.Linear(2, 1), device="cpu")
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.MSELoss())
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR
    callback = LRScheduler(lambda optimizer, total: schedule(optimizer, T_max=total))
    callback.set_model(model)
    callback.set_params(params)
    with pytest.raises(RuntimeError, match=r"epochs=None\. A scheduler factory works only inside"):
        callback.on_train_begin()


# -- a factory's schedule across a resume ----------------------------------------------------


class _ResumeByCallback(Callback):
    """A user's own resume, listed before the LRScheduler, the way BackupAndRestore resumes:
    fit asks every callback's ``restore_backup`` once all ran ``on_train_begin``."""

    def __init__(self, path) -> None:
        super().__init__()
        self.path = path

    def restore_backup(self):
        if self.path is not None:
            self.model.load(self.path, resume=True)


class _Rates(Callback):
    def __init__(self) -> None:
        super().__init__()
        self.rates: list[float] = []

    def on_before_optimizer_step(self, step, logs=None):
        self.rates.append(float(self.model.optimizer.param_groups[0]["lr"]))


FACTORIES = {
    "StepLR per epoch": (lambda opt, total: torch.optim.lr_scheduler.StepLR(opt, 1, 0.5), False),
    "OneCycleLR per step": (
        lambda opt, total: torch.optim.lr_scheduler.OneCycleLR(opt, 0.1, total_steps=total),
        True,
    ),
}


def _rates(
    save_dir, schedule, batch_size=8, resume_from=None, by_callback=None, epochs=3
) -> list[float]:
    from conftest import TinyNet, make_tiny_data
    from torch import nn

    from callbacks import ModelCheckpoint
    from hapi import Model

    torch.manual_seed(0)
    model = Model(TinyNet())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), nn.CrossEntropyLoss())
    rates = _Rates()
    factory, by_step = FACTORIES[schedule]
    model.fit(
        make_tiny_data(32),
        batch_size=batch_size,
        epochs=epochs,
        verbose=0,
        resume_from=resume_from,
        callbacks=[
            _ResumeByCallback(by_callback),
            LRScheduler(factory, by_step=by_step),
            rates,
            ModelCheckpoint(save_dir, save_steps=6, resumable=True),
        ],
    )
    return rates.rates


@pytest.mark.parametrize("schedule", sorted(FACTORIES))
def test_a_resumed_factory_schedule_continues_the_uninterrupted_one(tmp_path, schedule, capsys):
    """Resumed by fit(resume_from=) or by a callback listed before the LRScheduler, the rates
    are the uninterrupted run's from the file on."""
    whole = _rates(tmp_path / "whole", schedule)
    step_6 = tmp_path / "whole" / "step-6.pt"  # epoch 1, batch 2 of 4
    for how in ("resume_from", "by_callback"):
        resumed = _rates(tmp_path / how, schedule, **{how: step_6})
        assert resumed == pytest.approx(whole[6:], rel=1e-12), how
    # A run of another length (batches of 4: 24 updates, not 12) goes on from the same point
    # of the schedule's course (update 12 of 24) and ends it with its last update (the old
    # code kept the file's total_steps=12 and failed: "Tried to step 13 times").
    longer = _rates(tmp_path / "longer", schedule, batch_size=4, resume_from=step_6)
    assert len(longer) == 12  # the epoch's other 16 samples, then 8 batches
    if schedule == "OneCycleLR per step":
        assert longer[-1] == pytest.approx(whole[-1])
    # A fit given more epochs than the one saved: the same number of updates per epoch, so the
    # schedule (rebuilt for 5 epochs) goes on from update 6, as a 5-epoch run from the start.
    more_epochs = _rates(tmp_path / "more", schedule, resume_from=step_6, epochs=5)
    assert more_epochs == pytest.approx(_rates(tmp_path / "five", schedule, epochs=5)[6:])
