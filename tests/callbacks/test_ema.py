"""EMA: the average of the weights over optimizer steps, what evaluation and fit's end use, and resume."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import TinyNet, make_tiny_data
from stub import StubModel, attach
from torch import nn

from callbacks import BackupAndRestore, Callback
from callbacks.ema import EMA
from hapi import Model


def sgd_model(seed: int = 0, momentum: float = 0.0) -> Model:
    torch.manual_seed(seed)
    model = Model(TinyNet())
    model.prepare(
        torch.optim.SGD(model.parameters(), lr=0.2, momentum=momentum), nn.CrossEntropyLoss()
    )
    return model


def weights(network: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in network.named_parameters()}


class WeightsPerStep(Callback):
    """The weights at the start and after each optimizer step (not after accumulated batches)."""

    def __init__(self) -> None:
        super().__init__()
        self.history: list[dict[str, torch.Tensor]] = []
        self.batches = 0

    def on_train_begin(self, logs=None):
        self.history, self._step = [weights(self.model.network)], self.model.step

    def on_train_batch_end(self, step, logs=None):
        self.batches += 1
        if self.model.step != self._step:
            self._step = self.model.step
            self.history.append(weights(self.model.network))


def hand_average(history: list[dict[str, torch.Tensor]], decay: float, every: int = 1) -> dict:
    """The average by its definition, in float64: shadow = decay * shadow + (1 - decay) * weights."""
    shadow = {name: t.double() for name, t in history[0].items()}
    for step, snapshot in enumerate(history[1:], start=1):
        if step % every == 0:
            shadow = {
                name: decay * shadow[name] + (1 - decay) * snapshot[name].double()
                for name in shadow
            }
    return shadow


def assert_matches(shadow: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(shadow) == sorted(expected)
    for name in expected:
        torch.testing.assert_close(shadow[name].double(), expected[name], atol=1e-6, rtol=1e-6)


DATA = make_tiny_data(96)
EVAL = make_tiny_data(30, seed=1)


@pytest.mark.parametrize("accumulate, every", [(1, 1), (2, 1), (1, 3)])
def test_the_average_is_the_definition_over_each_optimizer_steps_weights(accumulate, every):
    model, ema, steps = (
        sgd_model(),
        EMA(decay=0.8, every_n_steps=every, swap_at_end=False),
        WeightsPerStep(),
    )
    model.fit(
        DATA,
        eval_data=EVAL,
        batch_size=16,
        epochs=2,
        verbose=0,
        accumulate_grad_batches=accumulate,
        callbacks=[ema, steps],
    )
    assert steps.batches == 12 and len(steps.history) == 1 + 12 // accumulate
    assert model.step == 12 // accumulate
    assert_matches(ema.state_dict()["shadow"], hand_average(steps.history, 0.8, every))
    # swap_at_end=False: the network keeps the last training weights
    assert all(torch.equal(p, steps.history[-1][n]) for n, p in weights(model.network).items())


def test_training_is_unchanged_by_the_evaluation_swap():
    """The training weights go back after each evaluation: the run trains as one without EMA."""
    with_ema = sgd_model(momentum=0.9)  # each model seeds torch, which also picks the data order
    with_ema.fit(
        DATA,
        eval_data=EVAL,
        batch_size=16,
        epochs=3,
        verbose=0,
        callbacks=[EMA(decay=0.9, swap_at_end=False)],
    )
    plain = sgd_model(momentum=0.9)
    plain.fit(DATA, eval_data=EVAL, batch_size=16, epochs=3, verbose=0)
    for name, p in weights(with_ema.network).items():
        assert torch.equal(p, weights(plain.network)[name]), name


def test_evaluation_during_fit_scores_the_average():
    model, ema = sgd_model(), EMA(decay=0.9, swap_at_end=False)
    history = model.fit(DATA, eval_data=EVAL, batch_size=16, epochs=1, verbose=0, callbacks=[ema])
    val_loss = history.history["val_loss"][0]
    # Outside fit, evaluate() uses what the network holds -- the training weights, here --
    # even when given the EMA callback.
    raw = model.evaluate(EVAL, batch_size=16, verbose=0, callbacks=[ema])["loss"]
    assert raw == pytest.approx(model.evaluate(EVAL, batch_size=16, verbose=0)["loss"], abs=0)
    assert abs(raw - val_loss) > 1e-4
    model.network.load_state_dict(ema.state_dict()["shadow"], strict=False)
    assert model.evaluate(EVAL, batch_size=16, verbose=0)["loss"] == pytest.approx(
        val_loss, abs=1e-6
    )


def test_the_network_ends_with_the_average_and_saves_it(tmp_path):
    model, ema = sgd_model(), EMA(decay=0.9)
    history = model.fit(
        DATA,
        eval_data=EVAL,
        batch_size=16,
        epochs=2,
        verbose=0,
        callbacks=[ema],
        save_dir=str(tmp_path),
    )
    shadow = ema.state_dict()["shadow"]
    for name, p in weights(model.network).items():
        assert torch.equal(p, shadow[name]), name
    # The last evaluation scored these weights, and fit(save_dir=...)'s final.pt holds them.
    assert model.evaluate(EVAL, batch_size=16, verbose=0)["loss"] == pytest.approx(
        history.history["val_loss"][-1], abs=1e-6
    )
    final = torch.load(tmp_path / "final.pt", weights_only=True)["network"]
    assert all(torch.equal(final[name], shadow[name]) for name in shadow)
    # ...while the epoch checkpoints hold the training weights.
    epoch_file = torch.load(tmp_path / "1.pt", weights_only=True)["network"]
    assert not all(torch.equal(epoch_file[name], shadow[name]) for name in shadow)


def test_decay_zero_is_the_current_weights():
    model, ema = sgd_model(), EMA(decay=0.0, swap_at_end=False)
    model.fit(DATA, batch_size=16, epochs=1, verbose=0, callbacks=[ema])
    shadow = ema.state_dict()["shadow"]
    assert all(torch.equal(p, shadow[n]) for n, p in weights(model.network).items())


class CrashAtStep(Callback):
    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step

    def on_train_batch_end(self, step, logs=None):
        if self.model.step == self.step:
            raise KeyboardInterrupt  # the run dies two steps after the backup at step 15


def test_a_killed_run_resumes_with_exactly_the_uninterrupted_average(tmp_path, capsys):
    def run(callbacks, model=None):
        model = model or sgd_model(momentum=0.9)
        history = model.fit(
            DATA, eval_data=EVAL, batch_size=8, epochs=2, verbose=0, callbacks=callbacks
        )
        return model, history

    reference_ema = EMA(decay=0.9)
    reference, reference_history = run([reference_ema])
    crashed = sgd_model(momentum=0.9)
    with pytest.raises(KeyboardInterrupt):
        run([EMA(decay=0.9), BackupAndRestore(tmp_path, save_freq=5), CrashAtStep(17)], crashed)
    crashed.wait_for_saves()  # the backup is written in the background
    backup = torch.load(tmp_path / "backup.pt", weights_only=True)
    saved = dict(backup["fit"]["callbacks"])["EMA"]
    assert saved["step"] == 15 and all(t.device.type == "cpu" for t in saved["shadow"].values())

    resumed_ema = EMA(decay=0.9)
    resumed, resumed_history = run(
        [resumed_ema, BackupAndRestore(tmp_path, save_freq=5), CrashAtStep(-1)]
    )
    assert "(optimizer step 15)" in capsys.readouterr().out
    expected = reference_ema.state_dict()["shadow"]
    for name, tensor in resumed_ema.state_dict()["shadow"].items():
        assert torch.equal(tensor, expected[name]), name
    assert all(
        torch.equal(p, weights(reference.network)[n]) for n, p in weights(resumed.network).items()
    )
    assert resumed_history.history["val_loss"][-1] == reference_history.history["val_loss"][-1]


def test_state_round_trip_and_mismatch():
    ema, model = EMA(decay=0.5), StubModel()
    attach(ema, model)
    ema.on_train_begin()
    with torch.no_grad():
        model.network.weight.fill_(1.0)
    model.step = 1
    ema.on_train_batch_end(0)
    state = ema.state_dict()
    assert state["step"] == 1 and torch.allclose(
        state["shadow"]["weight"], 0.5 * weights(StubModel().network)["weight"] + 0.5
    )
    state["shadow"]["weight"] += 1  # a copy: the callback's average is not changed through it
    assert not torch.equal(ema.state_dict()["shadow"]["weight"], state["shadow"]["weight"])

    other = EMA()
    other.load_state_dict(state)  # before training: kept, and used by on_train_begin
    attach(other, StubModel())
    other.on_train_begin()
    assert torch.equal(other.state_dict()["shadow"]["weight"], state["shadow"]["weight"])

    wrong = {"step": 1, "shadow": {"weight": torch.zeros(3, 2), "bias": torch.zeros(1)}}
    with pytest.raises(
        ValueError, match=r"shapes differ.*weight: saved \(3, 2\), network \(1, 2\)"
    ):
        ema.load_state_dict(wrong)
    with pytest.raises(ValueError, match=r"missing: \['bias'\], unexpected: \['other'\]"):
        ema.load_state_dict(
            {"step": 1, "shadow": {"weight": torch.zeros(1, 2), "other": torch.zeros(1)}}
        )
    with pytest.raises(ValueError, match=r"expects what EMA.state_dict\(\) returns"):
        ema.load_state_dict({"shadow": [1, 2]})


def test_sharded_weights_are_refused():
    model = StubModel()
    model.sharded = True
    ema = EMA()
    attach(ema, model)
    with pytest.raises(RuntimeError, match=r"does not support weights sharded.*strategy='ddp'"):
        ema.on_train_begin()


@pytest.mark.parametrize("decay", [-0.1, 1.0, 1, 2.5, True, "0.9", None, math.nan])
def test_decay_must_be_in_zero_one(decay):
    with pytest.raises(ValueError, match=r"decay must be a number in \[0, 1\); received"):
        EMA(decay=decay)


@pytest.mark.parametrize("every", [0, -1, 1.5, True])
def test_every_n_steps_must_be_a_positive_int(every):
    with pytest.raises(ValueError, match=r"every_n_steps must be a positive int; received"):
        EMA(every_n_steps=every)
