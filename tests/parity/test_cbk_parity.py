"""Upstream tests of the monitoring callbacks, translated from Paddle's hapi and Keras 3.

paddle.nn -> torch.nn, InputSpec -> counts, MNIST/LeNet -> a tiny separable problem (the
tests are about the callbacks, not the network), static-graph variants dropped. Each test's
docstring names the upstream test. Paddle's evaluation figures carry no prefix: its
``EarlyStopping("loss")`` is ``EarlyStopping("val_loss")`` here. Where torch-hapi
deliberately differs, the test asserts torch-hapi's behaviour and says why.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import TinyNet, make_tiny_data
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, MultiplicativeLR

from callbacks import (
    BackupAndRestore,
    Callback,
    EarlyStopping,
    LambdaCallback,
    LRScheduler,
    ReduceLROnPlateau,
    TerminateOnNaN,
)
from hapi import Model
from hapi.metrics import Accuracy

TRAIN = make_tiny_data(40)
VAL = make_tiny_data(20, seed=1)


def classifier(lr: float = 0.05, optimizer=torch.optim.SGD, metrics=True) -> Model:
    torch.manual_seed(0)
    model = Model(TinyNet())
    model.prepare(
        optimizer(model.parameters(), lr=lr),
        nn.CrossEntropyLoss(reduction="sum"),
        Accuracy() if metrics else None,
    )
    return model


def lr_of(model: Model) -> float:
    return float(model.optimizer.param_groups[0]["lr"])


class StubModel:
    """Keras' DummyModel for EarlyStopping: weights are a number (the epoch index)."""

    def __init__(self) -> None:
        self.network = nn.Linear(1, 1)
        self.stop_training = False

    def set_weight_to_epoch(self, epoch: int) -> None:
        with torch.no_grad():
            self.network.weight.fill_(float(epoch))

    def get_weights(self) -> dict:
        return {k: v.detach().clone() for k, v in self.network.state_dict().items()}

    def set_weights(self, weights: dict) -> None:
        self.network.load_state_dict(weights)

    def weight(self) -> float:  # Keras' DummyModel's get_weights(): the epoch set last
        return self.network.weight.item()


# ==== Paddle: test/legacy_test/test_callback_early_stop.py =================================


def test_paddle_earlystopping(tmp_path):
    """Paddle test_callback_early_stop.py::TestCallbacks::test_earlystopping.

    Four EarlyStoppings (Paddle's 'loss'/'acc' are the evaluation figures: 'val_loss'/'val_acc'
    here), save_best_model=True, fit with eval data and save_dir; then a fit without eval data.
    Upstream only checks that nothing fails; here also what each one does: mode='auto_' warns
    and means 'auto', a missing figure ('val_acc_') warns, best_model.pt lands in save_dir.
    """
    model = classifier()
    callbacks_0 = EarlyStopping(
        "val_loss", mode="min", patience=1, verbose=1, min_delta=0, save_best_model=True
    )
    callbacks_1 = EarlyStopping(
        "val_acc", mode="auto", patience=1, verbose=1, min_delta=0, baseline=0, save_best_model=True
    )
    with pytest.warns(UserWarning, match=r"EarlyStopping: mode 'auto_' is unknown; using 'auto'"):
        callbacks_2 = EarlyStopping(
            "val_loss", mode="auto_", patience=1, verbose=1, min_delta=0, save_best_model=True
        )
    callbacks_3 = EarlyStopping(
        "val_acc_", mode="max", patience=1, verbose=1, min_delta=0, baseline=0, save_best_model=True
    )
    assert (callbacks_1.mode, callbacks_2.mode) == ("max", "min")
    with pytest.warns(UserWarning, match=r"monitoring 'val_acc_', which is not in the logs"):
        model.fit(
            TRAIN,
            VAL,
            batch_size=8,
            save_freq=10,
            save_dir=tmp_path,
            epochs=4,
            verbose=0,
            callbacks=[callbacks_0, callbacks_1, callbacks_2, callbacks_3],
        )
    assert (tmp_path / "best_model.pt").is_file()
    assert callbacks_0.best_model_path == str(tmp_path / "best_model.pt")
    assert callbacks_3.best_model_path is None  # its figure never appeared: nothing to save
    # Test for no val_loader: the figure is missing, so it warns and never stops.
    with pytest.warns(UserWarning, match=r"'val_loss', which is not in the logs"):
        history = model.fit(
            TRAIN,
            batch_size=8,
            save_freq=10,
            save_dir=tmp_path,
            epochs=2,
            verbose=0,
            callbacks=[callbacks_0],
        )
    assert history.epoch == [0, 1]


# ==== Paddle: test/legacy_test/test_callback_reduce_lr_on_plateau.py =======================


def paddle_plateau_lrs(values, lr, factor, patience, cooldown, min_delta, min_lr=0.0):
    """Paddle's (and Keras') ReduceLROnPlateau rule, written out apart from the callback."""
    best, wait, counter, lrs = math.inf, 0, 0, []
    for current in values:
        if counter > 0:
            counter -= 1
            wait = 0
        if current < best - min_delta:
            best, wait = current, 0
        elif counter == 0:
            wait += 1
            if wait >= patience and lr > min_lr:
                lr, counter, wait = max(lr * factor, min_lr), cooldown, 0
        lrs.append(lr)
    return lrs


class LrAfterEpoch(Callback):
    def __init__(self) -> None:
        super().__init__()
        self.lrs: list[float] = []

    def on_epoch_end(self, epoch, logs=None):
        self.lrs.append(lr_of(self.model))


@pytest.mark.parametrize(
    "lr, cooldown",
    [
        (0.001, 1),  # upstream's settings: on this data val_loss falls every epoch
        (0.5, 2),  # a rate that overshoots: val_loss plateaus, so reductions and cooldowns
    ],
)
def test_paddle_reduce_lr_on_plateau(lr, cooldown):
    """Paddle test_callback_reduce_lr_on_plateau.py::TestReduceLROnPlateau::
    test_reduce_lr_on_plateau: ReduceLROnPlateau(patience=1, verbose=1, cooldown=1) over 10
    epochs with evaluation (Paddle watches the evaluation loss: 'val_loss' here). Upstream only
    runs it; here the learning rate after every epoch equals Paddle's rule replayed on the
    logged val_loss, also in a second run that plateaus (lr 0.5, cooldown 2)."""
    model = classifier(lr=lr, optimizer=torch.optim.Adam)
    seen = LrAfterEpoch()
    plateau = ReduceLROnPlateau(patience=1, verbose=1, cooldown=cooldown)
    history = model.fit(
        TRAIN, VAL, batch_size=20, log_freq=1, epochs=10, verbose=0, callbacks=[plateau, seen]
    )
    expected = paddle_plateau_lrs(
        history.history["val_loss"], lr, 0.1, patience=1, cooldown=cooldown, min_delta=1e-4
    )
    assert seen.lrs == pytest.approx(expected)
    if lr == 0.5:
        assert len(set(expected)) > 2  # several reductions: the rule was exercised


def test_paddle_reduce_lr_warn_or_error():
    """Paddle test_callback_reduce_lr_on_plateau.py::TestReduceLROnPlateau::test_warn_or_error.

    factor >= 1 is a ValueError; mode='1' warns (and means 'auto'); a monitor the logs lack
    ('miou') warns and changes nothing; monitor='acc' with mode='max' and cooldown=1 runs
    (Paddle's name 'MulticlassAccuracy' is 'val_acc' here). Paddle's third case, an optimizer
    whose learning rate is a Paddle LRScheduler object, has no torch counterpart (a torch
    optimizer's lr is always a number) and is dropped.
    """
    with pytest.raises(ValueError, match="factor must be in"):
        ReduceLROnPlateau(factor=2.0)
    with pytest.warns(UserWarning, match="ReduceLROnPlateau: mode '1' is unknown"):
        ReduceLROnPlateau(mode="1", patience=3, verbose=1)

    model = classifier(lr=0.001, optimizer=torch.optim.Adam)
    with pytest.warns(UserWarning, match="'miou', which is not in the logs"):
        model.fit(
            TRAIN,
            VAL,
            batch_size=8,
            log_freq=1,
            epochs=1,
            verbose=0,
            callbacks=[ReduceLROnPlateau(monitor="miou", patience=3, verbose=1)],
        )
    assert lr_of(model) == 0.001

    cb = ReduceLROnPlateau(monitor="val_acc", mode="max", patience=3, verbose=1, cooldown=1)
    model.fit(TRAIN, VAL, batch_size=8, log_freq=1, epochs=3, verbose=0, callbacks=[cb])
    assert cb.mode == "max" and lr_of(model) == 0.001  # 3 epochs, patience 3: no reduction


# ==== Paddle: test/legacy_test/test_model.py::TestModelWithLRScheduler =====================


def my_dataset():
    """Paddle's MyDataset: 40 samples of 20 features, labels in [0, 10) (as tensors)."""
    generator = torch.Generator().manual_seed(0)
    return torch.rand(40, 20, generator=generator), torch.randint(0, 10, (40,), generator=generator)


BASE_LR, BOUNDARIES = 1e-3, [5, 8]


def warmup_then_piecewise(warmup: int):
    """Paddle's LinearWarmup(PiecewiseDecay(boundaries, values), warmup, base/5 -> base) as a
    torch LambdaLR factor of the base learning rate."""

    def factor(step: int) -> float:
        if step < warmup:
            return 0.2 + 0.8 * step / warmup
        return 0.1 ** sum(step - warmup >= b for b in BOUNDARIES)

    return factor


def fit_with_schedule(epochs: int, batch_size: int, **switches) -> float:
    torch.manual_seed(0)
    model = Model(nn.Linear(20, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=BASE_LR, momentum=0.9, weight_decay=5e-4)
    model.prepare(optimizer, nn.CrossEntropyLoss(reduction="sum"))
    scheduler = LambdaLR(optimizer, warmup_then_piecewise(4))
    data = my_dataset()
    model.fit(
        data,
        data,
        batch_size=batch_size,
        epochs=epochs,
        verbose=0,
        callbacks=LRScheduler(scheduler, **switches),
    )
    return scheduler.get_last_lr()[0]


def test_paddle_fit_by_step():
    """Paddle test_model.py::TestModelWithLRScheduler::test_fit_by_step: stepped per step end
    past the warm-up (4) and both boundaries (5, 8): base_lr * 0.1**2. Paddle runs 10 epochs
    of 10 steps; 2 epochs (20 steps > 4 + 8) reach the same end, faster. Paddle adds this
    per-step LRScheduler itself when none is given; torch-hapi's scheduler is a torch object
    the user builds, so it is passed explicitly, with Paddle's keyword (by_epoch=False)."""
    lr = fit_with_schedule(epochs=2, batch_size=4, by_epoch=False)
    assert lr == pytest.approx(BASE_LR * 0.1 ** len(BOUNDARIES))


def test_paddle_fit_by_epoch():
    """Paddle test_model.py::TestModelWithLRScheduler::test_fit_by_epoch:
    LRScheduler(by_step=False, by_epoch=True) over 10 epochs, warm-up 4: only the boundary 5
    is passed (5 + 4 <= 10), so base_lr * 0.1. (Batches of 20 instead of 4: the number of
    steps per epoch does not matter here.) torch-hapi's own default, LRScheduler(scheduler),
    is per epoch too, unlike Paddle's."""
    epochs, warmup = 10, 4
    cnt = sum(b + warmup <= epochs for b in BOUNDARIES)
    lr = fit_with_schedule(epochs=epochs, batch_size=20, by_step=False, by_epoch=True)
    assert lr == pytest.approx(BASE_LR * 0.1**cnt)


def test_paddle_lr_scheduler_mutually_exclusive():
    """Paddle callbacks.py LRScheduler: by_step and by_epoch both True is a ValueError."""
    scheduler = LambdaLR(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0), lambda e: 1.0)
    with pytest.raises(ValueError, match="by_step=True and by_epoch=True"):
        LRScheduler(scheduler, by_step=True, by_epoch=True)


# ==== Keras 3: keras/src/callbacks/early_stopping_test.py ==================================


@pytest.mark.parametrize(
    "mode, monitor, expected",
    [
        ("max", "val_mse", "max"),
        ("min", "val_loss", "min"),
        ("auto", "val_mse", "min"),
        ("auto", "loss", "min"),
        ("auto", "acc", "max"),
        ("auto", "val_accuracy", "max"),
        ("auto", "hinge", "min"),
        ("auto", "f1_score", "max"),
    ],
)
def test_keras_early_stopping_direction(mode, monitor, expected):
    """Keras early_stopping_test.py::test_early_stopping: the direction each (mode, monitor)
    resolves to. Keras reads it from the compiled metric; torch-hapi from the name."""
    assert EarlyStopping(patience=0, monitor=monitor, mode=mode).mode == expected


def test_keras_early_stopping_unknown_monitor():
    """Keras early_stopping_test.py::test_early_stopping, its last case: monitor='unknown'.
    Keras raises ValueError because it cannot tell the direction from a compiled metric;
    torch-hapi reads the direction from the name ('unknown' -> min) and, the figure being
    absent, warns naming the logged keys and never stops -- the same as for Paddle's missing
    monitor, and the figure may only appear on later epochs (eval_freq)."""
    model = classifier()
    stopper = EarlyStopping(patience=0, monitor="unknown")
    with pytest.warns(UserWarning, match=r"'unknown', which is not in the logs. Available keys"):
        history = model.fit(TRAIN, VAL, batch_size=5, epochs=2, verbose=0, callbacks=[stopper])
    assert history.epoch == [0, 1]


@pytest.mark.parametrize("patience", [0, 1, 2, 3])
def test_keras_early_stopping_patience(patience):
    """Keras early_stopping_test.py::test_early_stopping_patience."""
    losses = [10.0, 9.0, 8.0, 9.0, 8.9, 8.8, 8.7, 8.6, 8.5]
    stopper = EarlyStopping(monitor="loss", patience=patience)
    stopper.set_model(StubModel())
    stopper.on_train_begin()
    for epoch, loss in enumerate(losses):
        stopper.on_epoch_end(epoch=epoch, logs={"loss": loss})
        if stopper.model.stop_training:
            break
    assert stopper.stopped_epoch == max(patience, 1) + 2


def test_keras_early_stopping_reuse():
    """Keras early_stopping_test.py::test_early_stopping_reuse: one EarlyStopping, two fits."""
    patience = 2
    model = classifier(metrics=False)
    stopper = EarlyStopping(monitor="loss", patience=patience, verbose=0)
    history1 = model.fit(TRAIN, callbacks=[stopper], verbose=0, epochs=4, batch_size=20)
    assert len(history1.epoch) >= patience
    history2 = model.fit(TRAIN, callbacks=[stopper], verbose=0, epochs=4, batch_size=20)
    assert len(history2.epoch) >= patience


def test_keras_early_stopping_reuse_across_models():
    """Keras early_stopping_test.py::test_early_stopping_reuse_across_models (keras#20256): a
    fresh model's first loss, worse than the previous model's best, must not count as no
    improvement -- each fit resets ``best``."""
    patience = 2
    stopper = EarlyStopping(monitor="loss", patience=patience, verbose=0)
    for lr in (0.05, 0.01, 0.001):  # a new model each time, learning more slowly each time
        history = classifier(lr=lr, metrics=False).fit(
            TRAIN, callbacks=[stopper], verbose=0, epochs=4, batch_size=20
        )
        assert len(history.epoch) > patience


def test_keras_early_stopping_with_baseline():
    """Keras early_stopping_test.py::test_early_stopping_with_baseline (mse -> the loss)."""
    patience = 3
    stopper = EarlyStopping(monitor="loss", patience=patience, baseline=0.6, verbose=0)
    hist = classifier(metrics=False).fit(
        TRAIN, callbacks=[stopper], verbose=0, epochs=4, batch_size=20
    )
    assert len(hist.epoch) >= patience


def run_dummy(early_stop, losses, stop_at=None):
    early_stop.set_model(StubModel())
    epochs_trained = 0
    early_stop.on_train_begin()
    for epoch in range(len(losses)):
        epochs_trained += 1
        early_stop.model.set_weight_to_epoch(epoch=epoch)
        early_stop.on_epoch_end(epoch, logs={"val_loss": losses[epoch]})
        if epoch == stop_at:
            early_stop.model.stop_training = True
        if early_stop.model.stop_training:
            break
    early_stop.on_train_end()
    return epochs_trained, early_stop.model.weight()


def test_keras_early_stopping_final_weights_when_restoring_model_weights():
    """Keras early_stopping_test.py::
    test_early_stopping_final_weights_when_restoring_model_weights (its three cases)."""
    # The best configuration is in epoch 2 (loss = 0.1); patience 2 stops at epoch 4.
    early_stop = EarlyStopping(monitor="val_loss", patience=2, restore_best_weights=True)
    assert run_dummy(early_stop, [0.2, 0.15, 0.1, 0.11, 0.12])[1] == 2
    # No epoch beats the baseline: 5 epochs, then the best of them (epoch 2) comes back.
    early_stop = EarlyStopping(
        monitor="val_loss", patience=5, baseline=0.5, restore_best_weights=True
    )
    assert run_dummy(early_stop, [0.9, 0.8, 0.7, 0.71, 0.72, 0.73]) == (5, 2)
    # Another callback requests the stop at epoch 3: epoch 2 comes back.
    early_stop = EarlyStopping(
        monitor="val_loss", patience=5, baseline=0.5, restore_best_weights=True
    )
    assert run_dummy(early_stop, [0.9, 0.8, 0.7, 0.71, 0.72, 0.73], stop_at=3) == (4, 2)


def test_keras_early_stopping_with_start_from_epoch():
    """Keras early_stopping_test.py::test_early_stopping_with_start_from_epoch."""
    start_from_epoch, patience = 2, 1
    stopper = EarlyStopping(
        monitor="loss", patience=patience, start_from_epoch=start_from_epoch, verbose=0
    )
    history = classifier(metrics=False).fit(
        TRAIN, callbacks=[stopper], verbose=0, epochs=4, batch_size=20
    )
    assert len(history.epoch) >= patience + start_from_epoch
    # Test for boundary condition when 'patience' = 0.
    stopper = EarlyStopping(monitor="loss", patience=0, start_from_epoch=start_from_epoch)
    history = classifier(metrics=False).fit(
        TRAIN, callbacks=[stopper], verbose=0, epochs=4, batch_size=20
    )
    assert len(history.epoch) >= start_from_epoch


# ==== Keras 3: keras/src/callbacks/reduce_lr_on_plateau_test.py ============================


def regression(lr: float = 0.1) -> Model:
    """Keras' setUp: Dense(5) -> Dense(2), mse, Adam(0.1)."""
    torch.manual_seed(0)
    model = Model(nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2)))
    model.prepare(torch.optim.Adam(model.parameters(), lr=lr), nn.MSELoss())
    return model


def regression_data(seed: int):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(10, 3, generator=generator), torch.randn(10, 2, generator=generator)


def plateau_fit(epochs, **kwargs) -> Model:
    model = regression()
    reduce_lr = ReduceLROnPlateau(patience=1, factor=0.1, monitor="val_loss", **kwargs)
    model.fit(
        regression_data(0),
        regression_data(1),
        callbacks=[reduce_lr],
        epochs=epochs,
        verbose=0,
        batch_size=5,
    )
    return model


def test_keras_reduces_lr_with_model_fit():
    """Keras reduce_lr_on_plateau_test.py::test_reduces_lr_with_model_fit."""
    assert lr_of(plateau_fit(2, min_delta=100, verbose=0)) == pytest.approx(0.01)


def test_keras_verbose_logging(capsys):
    """Keras reduce_lr_on_plateau_test.py::test_verbose_logging; torch-hapi prints old -> new."""
    plateau_fit(2, min_delta=100, verbose=1)
    assert "Epoch 2: ReduceLROnPlateau reducing learning rate: 0.1 -> 0.01." in (
        capsys.readouterr().out
    )


def test_keras_honors_min_lr():
    """Keras reduce_lr_on_plateau_test.py::test_honors_min_lr."""
    assert lr_of(plateau_fit(4, min_delta=10, min_lr=0.005, verbose=0)) == pytest.approx(0.005)


def test_keras_cooldown():
    """Keras reduce_lr_on_plateau_test.py::test_cooldown: with a cooldown of 2 epochs the lr is
    reduced every other epoch, so 2 times in 4 epochs (the old count: once, 0.01)."""
    assert lr_of(plateau_fit(4, min_delta=100, cooldown=2, verbose=0)) == pytest.approx(0.001)


def test_keras_state_reset_across_fit_calls():
    """Keras reduce_lr_on_plateau_test.py::test_state_reset_across_fit_calls. Keras' reset best
    is None (the first value always improves); torch-hapi's is +inf, with the same effect."""
    model = regression()
    reduce_lr = ReduceLROnPlateau(patience=1, factor=0.1, monitor="loss", min_delta=0, cooldown=2)
    reduce_lr.set_model(model)
    reduce_lr.on_train_begin()
    reduce_lr.best, reduce_lr.wait, reduce_lr.cooldown_counter = 0.5, 3, 2
    reduce_lr.on_train_begin()
    assert (reduce_lr.best, reduce_lr.wait, reduce_lr.cooldown_counter) == (math.inf, 0, 0)


# ==== Keras 3: keras/src/callbacks/lambda_callback_test.py =================================


def small_regression():
    torch.manual_seed(0)
    model = Model(nn.Linear(2, 1))
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.01), nn.MSELoss())
    generator = torch.Generator().manual_seed(0)
    return model, torch.randn(16, 2, generator=generator), torch.randn(16, 1, generator=generator)


def test_keras_lambda_callback():
    """Keras lambda_callback_test.py::test_lambda_callback (validation_split=0.2 -> the last
    20% as eval_data)."""
    model, x, y = small_regression()
    logged = []
    cb = LambdaCallback(
        on_train_begin=lambda logs: logged.append("on_train_begin"),
        on_epoch_begin=lambda epoch, logs: logged.append("on_epoch_begin"),
        on_epoch_end=lambda epoch, logs: logged.append("on_epoch_end"),
        on_train_end=lambda logs: logged.append("on_train_end"),
    )
    model.fit((x[:12], y[:12]), (x[12:], y[12:]), batch_size=4, epochs=5, verbose=0, callbacks=[cb])
    for hook in ("on_train_begin", "on_epoch_begin", "on_epoch_end", "on_train_end"):
        assert hook in logged


def test_keras_lambda_callback_with_batches():
    """Keras lambda_callback_test.py::test_lambda_callback_with_batches."""
    model, x, y = small_regression()
    logged = []
    cb = LambdaCallback(
        on_train_batch_begin=lambda batch, logs: logged.append("on_train_batch_begin"),
        on_train_batch_end=lambda batch, logs: logged.append("on_train_batch_end"),
    )
    model.fit((x[:12], y[:12]), (x[12:], y[12:]), batch_size=4, epochs=5, verbose=0, callbacks=[cb])
    assert "on_train_batch_begin" in logged and "on_train_batch_end" in logged


def test_keras_lambda_callback_with_kwargs():
    """Keras lambda_callback_test.py::test_lambda_callback_with_kwargs: Keras' on_test_begin is
    torch-hapi's on_eval_begin; both names are accepted."""
    model, x, y = small_regression()
    model.fit((x, y), batch_size=4, epochs=1, verbose=0)
    logged = []
    cb = LambdaCallback(on_test_begin=lambda logs: logged.append("custom_on_test_begin_executed"))
    model.evaluate((x, y), batch_size=4, callbacks=[cb], verbose=0)
    assert logged == ["custom_on_test_begin_executed"]


def test_keras_lambda_callback_no_args():
    """Keras lambda_callback_test.py::test_lambda_callback_no_args."""
    assert isinstance(LambdaCallback(), LambdaCallback)


def test_keras_lambda_callback_with_additional_kwargs():
    """Keras lambda_callback_test.py::test_lambda_callback_with_additional_kwargs."""

    def custom_callback(logs):
        pass

    assert hasattr(LambdaCallback(custom_method=custom_callback), "custom_method")


def test_keras_lambda_callback_during_prediction():
    """Keras lambda_callback_test.py::test_lambda_callback_during_prediction."""
    model, x, _ = small_regression()
    logged = []
    cb = LambdaCallback(on_predict_begin=lambda logs: logged.append("on_predict_begin_executed"))
    model.predict((x,), batch_size=4, callbacks=[cb], verbose=0)
    assert logged == ["on_predict_begin_executed"]


# ==== Keras 3: keras/src/callbacks/terminate_on_nan_test.py ================================


def test_keras_terminate_on_nan():
    """Keras terminate_on_nan_test.py::test_TerminateOnNaN: weights of 1e5 in 5 ReLU layers
    overflow at once; one epoch is logged, its loss NaN or inf."""
    torch.manual_seed(0)
    layers = []
    for i in range(5):
        layer = nn.Linear(3 if i == 0 else 2, 2)
        nn.init.constant_(layer.weight, 1e5)
        layers += [layer, nn.ReLU()]
    model = Model(nn.Sequential(*layers, nn.Linear(2, 2)))
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.01), nn.MSELoss())
    generator = torch.Generator().manual_seed(1337)
    x, y = torch.rand(10, 3, generator=generator), torch.rand(10, 2, generator=generator)
    history = model.fit(
        (x, y), (x, y), batch_size=4, epochs=20, verbose=0, callbacks=[TerminateOnNaN()]
    )
    loss = history.history["loss"]
    assert len(loss) == 1 and not math.isfinite(loss[0])


def inf_targets(y_second=math.inf):
    torch.manual_seed(0)
    model = Model(nn.Linear(1, 1))
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.01), nn.MSELoss())
    return model, torch.tensor([[1.0], [2.0]]), torch.tensor([[math.inf], [y_second]])


def test_keras_terminate_on_nan_graceful_stop():
    """Keras terminate_on_nan_test.py::test_terminate_on_nan_graceful_stop."""
    model, x, y = inf_targets()
    history = model.fit(
        (x, y),
        epochs=2,
        batch_size=1,
        log_freq=1,
        verbose=0,
        callbacks=[TerminateOnNaN(raise_error=False)],
    )
    assert len(history.history["loss"]) < 4


def test_keras_terminate_on_nan_raise_error_raises_error():
    """Keras terminate_on_nan_test.py::test_terminate_on_nan_raise_error_raises_error."""
    model, x, y = inf_targets()
    with pytest.raises(RuntimeError, match="NaN or Inf loss encountered"):
        model.fit(
            (x, y),
            epochs=1,
            batch_size=1,
            log_freq=1,
            verbose=0,
            callbacks=[TerminateOnNaN(raise_error=True)],
        )


def test_keras_raise_error_terminate_does_not_trigger_on_train_end():
    """Keras terminate_on_nan_test.py::test_raise_error_terminate_does_not_trigger_on_train_end."""

    class TrackingCallback(Callback):
        def __init__(self):
            super().__init__()
            self.train_end_called = False

        def on_train_end(self, logs=None):
            self.train_end_called = True

    model, x, y = inf_targets()
    tracking = TrackingCallback()
    with pytest.raises(RuntimeError):
        model.fit(
            (x[:1], y[:1]),
            epochs=1,
            verbose=0,
            callbacks=[tracking, TerminateOnNaN(raise_error=True)],
        )
    assert not tracking.train_end_called


def test_keras_raise_error_terminate_preserves_backup(tmp_path):
    """Keras terminate_on_nan_test.py::test_raise_error_terminate_preserves_backup. Keras
    patches BackupAndRestore.on_train_end away; here no on_train_end runs after the error, so
    the backup directory and what lies in it stay untouched as they are."""
    backup_dir = tmp_path / "backups"
    backup_dir.mkdir()
    fake_file = backup_dir / "checkpoint.txt"
    fake_file.write_text("dummy checkpoint")
    model, x, y = inf_targets()
    with pytest.raises(RuntimeError):
        model.fit(
            (x[:1], y[:1]),
            epochs=1,
            verbose=0,
            callbacks=[BackupAndRestore(backup_dir), TerminateOnNaN(raise_error=True)],
        )
    assert backup_dir.exists() and fake_file.read_text() == "dummy checkpoint"


def test_keras_normal_training_does_not_raise():
    """Keras terminate_on_nan_test.py::test_normal_training_does_not_raise."""
    for raise_error in [False, True]:
        model, x, _ = inf_targets()
        history = model.fit(
            (x, x.clone()), epochs=2, verbose=0, callbacks=[TerminateOnNaN(raise_error=raise_error)]
        )
        assert len(history.history["loss"]) == 2


def test_keras_raise_error_terminate_stops_on_later_batch():
    """Keras terminate_on_nan_test.py::test_raise_error_terminate_stops_on_later_batch. Keras
    names the 0-based batch ('batch 1'); torch-hapi the 1-based step, as its stop message does
    ('step 2')."""
    model, x, _ = inf_targets()
    y = torch.tensor([[1.0], [math.inf]])  # the second batch only
    with pytest.raises(RuntimeError) as exc:
        model.fit(
            (x, y),
            epochs=1,
            batch_size=1,
            log_freq=1,
            shuffle=False,
            verbose=0,
            callbacks=[TerminateOnNaN(raise_error=True)],
        )
    assert "epoch 1, step 2" in str(exc.value)


# ==== Keras 3: keras/src/callbacks/learning_rate_scheduler_test.py =========================


class LrPerBatch(Callback):
    def __init__(self) -> None:
        super().__init__()
        self.lrs: list[float] = []

    def on_train_batch_begin(self, step, logs=None):
        self.lrs.append(lr_of(self.model))


def test_keras_updates_learning_rate():
    """Keras learning_rate_scheduler_test.py::test_updates_learning_rate: schedule 1/(2+epoch)
    -> 0.5 during epoch 0. Keras' LearningRateScheduler (a function of the epoch, set at each
    epoch's start) is a torch LambdaLR driven per epoch here; the rate epoch 0 trains with is
    the same. (torch steps the schedule at the epoch's end, so after fit the optimizer holds
    epoch 1's rate, where Keras leaves epoch 0's.)"""
    model = regression(lr=1.0)
    seen = LrPerBatch()
    scheduler = LambdaLR(model.optimizer, lambda epoch: 1.0 / (2.0 + epoch))
    model.fit(
        regression_data(0),
        batch_size=5,
        epochs=1,
        verbose=0,
        callbacks=[LRScheduler(scheduler), seen],
    )
    assert seen.lrs == pytest.approx([0.5, 0.5])


def test_keras_schedule_dependent_on_previous_learning_rate():
    """Keras learning_rate_scheduler_test.py::test_schedule_dependent_on_previous_learning_rate:
    lr / 2 each epoch, 2 epochs -> initial_lr / 4 (torch: MultiplicativeLR)."""
    initial_lr = 0.03
    model = regression(lr=initial_lr)
    scheduler = MultiplicativeLR(model.optimizer, lambda epoch: 0.5)
    model.fit(
        regression_data(0), batch_size=5, epochs=2, verbose=0, callbacks=[LRScheduler(scheduler)]
    )
    assert lr_of(model) == pytest.approx(initial_lr / 4.0)
