"""Keras 3 and Paddle meanings users bring with them: EarlyStopping restores the best weights
at the end of every fit, a training-figure name that Paddle would read as the evaluation
figure warns, and LRScheduler sizes a schedule from the fit itself (a factory)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from conftest import make_tiny_data, tiny_model
from stub import StubModel, attach
from torch import nn
from torch.optim.lr_scheduler import OneCycleLR, StepLR

from callbacks import (
    BackupAndRestore,
    Callback,
    EarlyStopping,
    LRScheduler,
    ModelCheckpoint,
    ReduceLROnPlateau,
)
from callbacks.monitor import MonitorCallback, MonitorNameWarning
from hapi import Model

DATA = make_tiny_data(40)
EVAL = make_tiny_data(20, seed=1)


def _model(lr: float = 0.05) -> Model:
    return tiny_model(lr)


def _weights(network: nn.Module) -> list[torch.Tensor]:
    return [v.detach().clone() for v in network.state_dict().values()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


class Snapshots(Callback):
    """The network's weights at each epoch end (before EarlyStopping acts)."""

    def __init__(self) -> None:
        super().__init__()
        self.per_epoch: list[list[torch.Tensor]] = []

    def on_epoch_end(self, epoch, logs=None):
        self.per_epoch.append(_weights(self.model.network))


class LrPerUpdate(Callback):
    """The learning rate each optimizer update uses."""

    def __init__(self) -> None:
        super().__init__()
        self.lrs: list[float] = []

    def on_before_optimizer_step(self, step, logs=None):
        self.lrs.append(float(self.model.optimizer.param_groups[0]["lr"]))


class Interrupt(Exception):
    pass


class InterruptAt(Callback):
    """Raises at the start of epoch ``epoch`` (None: never), as a crash would."""

    def __init__(self, epoch: int | None) -> None:
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise Interrupt


def one_cycle_curve(total: int, max_lr: float = 0.5) -> list[float]:
    """OneCycleLR's rate for each of ``total`` updates, computed apart from any fit."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=max_lr)
    schedule = OneCycleLR(optimizer, max_lr=max_lr, total_steps=total)
    curve = []
    for _ in range(total):
        curve.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return curve


def one_cycle(max_lr: float = 0.5):
    return lambda optimizer, total: OneCycleLR(optimizer, max_lr=max_lr, total_steps=total)


# ---- 1. EarlyStopping(restore_best_weights=True): at the end of every fit ----------------


def test_best_weights_come_back_when_training_runs_all_its_epochs(capsys):
    model = _model()
    snaps = Snapshots()
    # mode="max" on a falling val_loss: epoch 0 is the best, and patience never runs out
    stopper = EarlyStopping(monitor="val_loss", mode="max", patience=10, restore_best_weights=True)
    history = model.fit(
        DATA, eval_data=EVAL, batch_size=10, epochs=3, verbose=0, callbacks=[snaps, stopper]
    )
    assert stopper.stopped_epoch is None and stopper.best_epoch == 0
    assert not _same(snaps.per_epoch[0], snaps.per_epoch[-1])
    assert _same(_weights(model.network), snaps.per_epoch[0])
    restored_loss = model.evaluate(EVAL, batch_size=10, verbose=0)["loss"]
    assert restored_loss == pytest.approx(history.history["val_loss"][0])
    out = capsys.readouterr().out
    assert "Restoring model weights from the end of the best epoch: 1." in out
    assert "early stopping" not in out


def test_stopping_early_restores_at_the_end_of_training_too(capsys):
    model = _model()
    snaps = Snapshots()
    stopper = EarlyStopping(monitor="val_loss", mode="max", patience=1, restore_best_weights=True)
    model.fit(DATA, eval_data=EVAL, batch_size=10, epochs=5, verbose=0, callbacks=[snaps, stopper])
    assert stopper.stopped_epoch == 1 and len(snaps.per_epoch) == 2
    assert _same(_weights(model.network), snaps.per_epoch[0])
    out = capsys.readouterr().out
    assert out.index("Epoch 2: early stopping") < out.index("the best epoch: 1.")


def test_without_the_monitored_figure_nothing_is_restored_and_it_says_so(capsys):
    model = _model()
    snaps = Snapshots()
    stopper = EarlyStopping(monitor="val_loss", restore_best_weights=True)
    with pytest.warns(UserWarning, match="'val_loss', which is not in the logs"):
        model.fit(
            DATA, batch_size=10, epochs=2, verbose=0, callbacks=[snaps, stopper]
        )  # no eval_data
    assert _same(_weights(model.network), snaps.per_epoch[-1])
    out = capsys.readouterr().out
    assert "no epoch logged 'val_loss', so the best weights were not restored" in out
    assert "Restoring" not in out


def test_a_baseline_never_beaten_still_restores_the_best_epoch_and_says_so(capsys):
    # Keras 3: the best of the watched epochs comes back even if none beat the baseline
    # (the old code kept the last weights: epoch 2's here).
    cb = EarlyStopping(baseline=0.1, patience=5, restore_best_weights=True)
    model = attach(cb)
    cb.on_train_begin()
    for epoch, value in enumerate([0.5, 0.3, 0.4]):
        with torch.no_grad():
            model.network.weight.fill_(epoch)
        cb.on_epoch_end(epoch, {"val_loss": value})
    cb.on_train_end()
    assert torch.equal(model.network.weight, torch.ones_like(model.network.weight))
    assert capsys.readouterr().out == (
        "Restoring model weights from the end of the best epoch: 2 "
        "(val_loss=0.3; no epoch beat the baseline 0.1).\n"
    )


def test_rank_1_restores_the_same_snapshot_silently(capsys):
    cb = EarlyStopping(patience=5, restore_best_weights=True)
    model = attach(cb, rank=1)
    cb.on_train_begin()
    for epoch, value in enumerate([0.5, 0.2, 0.9]):
        with torch.no_grad():
            model.network.weight.fill_(epoch)
        cb.on_epoch_end(epoch, {"val_loss": value})
    cb.on_train_end()
    assert torch.equal(model.network.weight, torch.ones_like(model.network.weight))
    assert capsys.readouterr().out == ""


def test_after_a_resume_the_best_weights_of_before_the_crash_come_back(tmp_path):
    def run(crash_at):
        model = _model()
        snaps = Snapshots()
        stopper = EarlyStopping(
            monitor="val_loss", mode="max", patience=10, restore_best_weights=True, verbose=0
        )
        model.fit(
            DATA,
            eval_data=EVAL,
            batch_size=10,
            epochs=4,
            verbose=0,
            callbacks=[snaps, stopper, InterruptAt(crash_at), BackupAndRestore(tmp_path)],
        )
        return model, snaps

    whole, whole_snaps = run(None)
    with pytest.raises(Interrupt):
        run(2)  # backups at the ends of epochs 0 and 1
    resumed, resumed_snaps = run(None)
    assert (
        len(resumed_snaps.per_epoch) == 2
    )  # epochs 2 and 3 only: the best (0) was before the crash
    assert _same(_weights(resumed.network), whole_snaps.per_epoch[0])
    assert _same(_weights(resumed.network), _weights(whole.network))


# ---- 2. Monitored names: Paddle's "loss" is the evaluation loss, here "val_loss" --------


def test_a_training_name_with_its_val_twin_warns_once_per_fit():
    cb = EarlyStopping(monitor="loss", patience=10)
    attach(cb)
    cb.on_train_begin()
    with pytest.warns(MonitorNameWarning) as caught:
        for epoch in range(3):
            cb.on_epoch_end(epoch, {"loss": 1.0 - epoch / 10, "val_loss": 1.0})
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "monitors 'loss', the training figure" in message
    assert "In Paddle's hapi 'loss' meant the evaluation figure" in message
    assert "monitor='val_loss'" in message and "MonitorNameWarning" in message
    assert cb.best == pytest.approx(0.8)  # it still watches what it was told to
    attach(cb)  # the next fit (set_params) warns again
    with pytest.warns(MonitorNameWarning):
        cb.on_epoch_end(0, {"loss": 1.0, "val_loss": 1.0})


@pytest.mark.parametrize(
    "monitor, logs",
    [
        ("val_loss", {"loss": 1.0, "val_loss": 1.0}),  # the evaluation figure, named as meant
        ("loss", {"loss": 1.0}),  # no evaluation: "loss" is the only loss
        ("acc", {"acc": 0.5, "loss": 1.0, "val_loss": 1.0}),  # no val_acc
    ],
)
def test_no_name_warning_without_an_ambiguity(monitor, logs):
    cb = MonitorCallback(monitor=monitor)
    attach(cb)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cb.get_monitor_value(logs)


def test_only_the_main_process_warns():
    cb = ReduceLROnPlateau(monitor="acc")
    attach(cb, rank=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cb.on_train_begin()
        cb.on_epoch_end(0, {"acc": 0.5, "val_acc": 0.4})


def test_the_three_monitor_callbacks_warn_in_a_real_fit(tmp_path):
    model = _model()
    callbacks = [
        EarlyStopping("loss", patience=10, verbose=0),
        ReduceLROnPlateau("loss", verbose=0),
        ModelCheckpoint(tmp_path, monitor="loss"),
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(DATA, eval_data=EVAL, batch_size=10, epochs=3, verbose=0, callbacks=callbacks)
    named = sorted(
        str(w.message).split(" ")[0] for w in caught if issubclass(w.category, MonitorNameWarning)
    )
    assert named == ["EarlyStopping", "ModelCheckpoint", "ReduceLROnPlateau"]


def test_the_warning_can_be_silenced_by_category():
    cb = EarlyStopping(monitor="loss")
    attach(cb)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=MonitorNameWarning)
        cb.on_train_begin()
        cb.on_epoch_end(0, {"loss": 1.0, "val_loss": 1.0})


# ---- 3. LRScheduler sized by the fit: a factory ------------------------------------------


class Factory:
    """Records each call and builds a StepLR."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __call__(self, optimizer, total):
        self.calls.append((optimizer, total))
        return StepLR(optimizer, step_size=1, gamma=0.5)


@pytest.mark.parametrize(
    "by_step, params, total",
    [
        (True, {"epochs": 3, "steps": 5}, 15),
        (True, {"epochs": 3, "steps": 5, "accumulate_grad_batches": 2}, 9),  # 3 updates per epoch
        (True, {"epochs": 3, "steps": 5, "accumulate_grad_batches": 5}, 3),
        (
            True,
            {"epochs": 3, "steps": 4, "num_iters": 11, "accumulate_grad_batches": 2},
            6,
        ),  # 2 + 2 + 2
        (False, {"epochs": 3, "steps": 5, "accumulate_grad_batches": 2}, 3),  # by epoch: the epochs
    ],
)
def test_the_factory_gets_the_optimizer_and_the_fits_length(by_step, params, total):
    factory = Factory()
    cb = LRScheduler(factory, by_step=by_step)
    model = attach(cb, **params)
    assert cb.scheduler is None
    cb.on_train_begin()
    assert factory.calls == [(model.optimizer, total)] and cb.total == total
    assert isinstance(cb.scheduler, StepLR) and cb.scheduler.optimizer is model.optimizer
    cb.on_train_begin()  # a second fit: a fresh scheduler
    assert len(factory.calls) == 2


def test_an_unknown_epoch_length_is_a_clear_error():
    cb = LRScheduler(one_cycle(), by_step=True)
    attach(cb, steps=None)
    with pytest.raises(ValueError, match=r"batches per epoch.*received steps=None.*num_iters"):
        cb.on_train_begin()


def test_a_scheduler_class_or_a_bad_factory_result_is_refused():
    with pytest.raises(TypeError, match=r"received the class OneCycleLR.*lambda optimizer, total"):
        LRScheduler(OneCycleLR, by_step=True)
    cb = LRScheduler(lambda optimizer, total: optimizer)
    attach(cb)
    with pytest.raises(TypeError, match=r"the factory returned an object of type SGD"):
        cb.on_train_begin()


def test_one_cycle_from_a_factory_runs_its_whole_course_in_a_fit():
    model = _model()
    lrs = LrPerUpdate()
    # 40 samples, batch 10: 4 updates per epoch, 3 epochs
    model.fit(
        DATA,
        batch_size=10,
        epochs=3,
        verbose=0,
        callbacks=[LRScheduler(one_cycle(), by_step=True), lrs],
    )
    assert lrs.lrs == pytest.approx(one_cycle_curve(12), rel=1e-9)
    end = 0.5 / 25 / 1e4  # OneCycleLR's end value: initial_lr / final_div_factor
    assert lrs.lrs[-1] == pytest.approx(end)
    assert model.optimizer.param_groups[0]["lr"] == pytest.approx(
        end
    )  # left at its end, not past it


def test_by_step_moves_once_per_optimizer_update_under_accumulation():
    model = _model()
    lrs = LrPerUpdate()
    # 4 batches per epoch, 2 per update: 2 updates per epoch, 3 epochs; a schedule sized by hand
    schedule = OneCycleLR(model.optimizer, max_lr=0.5, total_steps=6)
    model.fit(
        DATA,
        batch_size=10,
        epochs=3,
        verbose=0,
        accumulate_grad_batches=2,
        callbacks=[LRScheduler(schedule, by_step=True), lrs],
    )
    assert model.step == 6
    assert lrs.lrs == pytest.approx(one_cycle_curve(6), rel=1e-9)


def test_the_factory_counts_updates_under_accumulation():
    model = _model()
    lrs = LrPerUpdate()
    # 4 batches per epoch, 3 per update: groups of 3 and 1, so 2 updates per epoch
    model.fit(
        DATA,
        batch_size=10,
        epochs=3,
        verbose=0,
        accumulate_grad_batches=3,
        callbacks=[LRScheduler(one_cycle(), by_step=True), lrs],
    )
    if "accumulate_grad_batches" not in lrs.params:
        pytest.skip(
            "hapi.Model.fit does not put accumulate_grad_batches in the callbacks' params yet"
        )
    assert model.step == 6
    assert lrs.lrs == pytest.approx(one_cycle_curve(6), rel=1e-9)


def test_a_resumed_fit_continues_the_factory_made_schedule(tmp_path):
    def run(crash_at):
        model = _model()
        lrs = LrPerUpdate()
        model.fit(
            DATA,
            batch_size=10,
            epochs=3,
            verbose=0,
            callbacks=[
                LRScheduler(one_cycle(), by_step=True),
                lrs,
                InterruptAt(crash_at),
                BackupAndRestore(tmp_path),
            ],
        )
        return model, lrs.lrs

    whole, curve = run(None)
    with pytest.raises(Interrupt):
        run(2)
    resumed, tail = run(None)
    assert len(tail) == 4 and tail == pytest.approx(curve[8:], rel=1e-9)
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(0.5 / 25 / 1e4)
    assert _same(_weights(resumed.network), _weights(whole.network))


def test_a_state_loaded_before_the_factory_ran_waits_for_it():
    source = LRScheduler(one_cycle(), by_step=True)
    model = attach(source)
    source.on_train_begin()
    for _ in range(3):
        model.optimizer_step()
        source.on_train_batch_end(0, {})
    state = source.state_dict()

    target = LRScheduler(one_cycle(), by_step=True)
    other = attach(target, StubModel())
    other.step = 3
    target.load_state_dict(state)
    target.on_train_begin()
    assert target.scheduler.last_epoch == 3
    assert other.optimizer.param_groups[0]["lr"] == pytest.approx(
        model.optimizer.param_groups[0]["lr"]
    )
    assert math.isclose(other.optimizer.param_groups[0]["lr"], one_cycle_curve(12)[3])


# ---- 4. Paddle's EarlyStopping(save_best_model=True) in a real fit -----------------------


def test_save_best_model_writes_best_model_pt_into_fits_save_dir(tmp_path, capsys):
    model = _model()
    snaps = Snapshots()
    # mode="max" on a falling val_loss: only epoch 0 "improves", so best_model.pt is epoch 0's
    stopper = EarlyStopping(monitor="val_loss", mode="max", patience=10)
    model.fit(
        DATA,
        eval_data=EVAL,
        batch_size=10,
        epochs=3,
        verbose=0,
        save_dir=tmp_path,
        callbacks=[snaps, stopper],
    )
    # beside fit's own ModelCheckpoint files, which it leaves alone
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["0.pt", "1.pt", "2.pt", "best.pt", "best_model.pt", "final.pt"]
    assert stopper.best_model_path == str(tmp_path / "best_model.pt")
    best = _model()
    best.load(tmp_path / "best_model.pt")
    assert _same(_weights(best.network), snaps.per_epoch[0])
    assert not _same(_weights(model.network), snaps.per_epoch[0])  # the model keeps training
    assert f"is saved at {tmp_path / 'best_model.pt'}." in capsys.readouterr().out


def test_without_save_dir_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    stopper = EarlyStopping(monitor="val_loss", patience=10, save_best_model=True)
    _model().fit(DATA, eval_data=EVAL, batch_size=10, epochs=2, verbose=0, callbacks=[stopper])
    assert list(tmp_path.iterdir()) == [] and stopper.best_model_path is None


# ---- 5. Keras 3's TerminateOnNaN(raise_error=True) in a real fit -------------------------


class Ends(Callback):
    def __init__(self) -> None:
        super().__init__()
        self.ended = False

    def on_train_end(self, logs=None):
        self.ended = True


def nan_data():
    x, y = make_tiny_data(40)
    x[25] = math.nan  # the third batch of 10
    return x, y


def test_raise_error_ends_fit_with_the_error_and_no_on_train_end(tmp_path):
    from callbacks import TerminateOnNaN

    ends = Ends()
    with pytest.raises(RuntimeError, match=r"NaN or Inf loss encountered at epoch 1, step 3"):
        _model().fit(
            nan_data(),
            batch_size=10,
            epochs=3,
            log_freq=1,
            shuffle=False,
            verbose=0,
            save_dir=tmp_path,
            callbacks=[ends, TerminateOnNaN(raise_error=True)],
        )
    assert not ends.ended
    assert not (tmp_path / "final.pt").exists()  # nothing written at the end of training


def test_without_raise_error_the_fit_stops_and_ends_normally():
    from callbacks import TerminateOnNaN

    ends = Ends()
    history = _model().fit(
        nan_data(),
        batch_size=10,
        epochs=3,
        log_freq=1,
        shuffle=False,
        verbose=0,
        callbacks=[ends, TerminateOnNaN()],
    )
    assert ends.ended and history.epoch == [0] and math.isnan(history.history["loss"][0])


# ---- 6. Paddle's LRScheduler(by_epoch=...) in a real fit ---------------------------------


@pytest.mark.parametrize(
    "switches, per_update",
    [
        ({"by_epoch": False}, True),  # Paddle's default meaning: per step
        ({"by_step": True, "by_epoch": False}, True),
        ({"by_step": False, "by_epoch": True}, False),
        ({}, False),  # torch's convention stays the default
    ],
)
def test_paddles_by_epoch_in_a_fit(switches, per_update):
    model = _model(lr=0.1)
    lrs = LrPerUpdate()
    scheduler = StepLR(model.optimizer, step_size=1, gamma=0.5)
    model.fit(
        DATA,
        batch_size=10,
        epochs=2,
        verbose=0,
        callbacks=[LRScheduler(scheduler, **switches), lrs],
    )
    # 4 updates per epoch
    expected = [0.1 * 0.5**i for i in range(8)] if per_update else [0.1] * 4 + [0.05] * 4
    assert lrs.lrs == pytest.approx(expected)


# ---- 7. Two processes: every rank saves the best model and raises alike ----------------

TWO_PROCESS_SCRIPT = """
import json, math, os, sys
sys.path[:0] = [{root!r}, {tests!r}]
import torch
from torch import nn
from conftest import TinyNet, make_tiny_data
from callbacks import EarlyStopping, TerminateOnNaN
from hapi import Model

out = sys.argv[1]
rank = int(os.environ["RANK"])
torch.manual_seed(0)
model = Model(TinyNet())
model.prepare(torch.optim.SGD(model.parameters(), lr=0.05), nn.CrossEntropyLoss())
stopper = EarlyStopping(monitor="val_loss", mode="max", patience=10, verbose=0)
x, y = make_tiny_data(40)
model.fit((x, y), (x, y), batch_size=5, epochs=2, verbose=0, save_dir=out, callbacks=[stopper])
result = {{"best_model_path": stopper.best_model_path, "best_epoch": stopper.best_epoch}}
x[12] = math.nan
try:
    model.fit((x, y), batch_size=5, epochs=1, log_freq=1, shuffle=False, verbose=0,
              callbacks=[TerminateOnNaN(raise_error=True)])
except RuntimeError as error:
    result["raised"] = str(error)
with open(os.path.join(out, f"rank{{rank}}.json"), "w") as f:
    json.dump(result, f)
"""


def test_two_processes_save_the_best_model_and_raise_on_nan_together(tmp_path):
    import json
    import pathlib

    from dist_helpers import torchrun

    tests = pathlib.Path(__file__).resolve().parents[1]
    script = tmp_path / "two.py"
    script.write_text(TWO_PROCESS_SCRIPT.format(root=str(tests.parent), tests=str(tests)))
    out = tmp_path / "out"
    out.mkdir()
    torchrun(["--standalone", "--nproc_per_node=2", str(script), str(out)], timeout=180)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    # model.save ran on both ranks (a collective): no hang, one file written by rank 0
    assert ranks[0]["best_model_path"] == ranks[1]["best_model_path"] == str(out / "best_model.pt")
    assert ranks[0]["best_epoch"] == ranks[1]["best_epoch"] == 0
    assert (out / "best_model.pt").is_file()
    # the NaN sample lies in one rank's second batch; the logged loss is reduced across the
    # ranks, so both see it at step 2 and raise the same error
    for rank in ranks:
        assert rank["raised"].startswith("NaN or Inf loss encountered at epoch 1, step 2:")
