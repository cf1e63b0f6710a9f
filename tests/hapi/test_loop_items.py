"""The loop's Paddle/Keras parity items: a network's own loss with no labels, frozen networks,
stop_evaluating / stop_predicting, a step's figure weights, learning rates in History."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import TinyNet, make_tiny_data
from torch import nn
from torch.utils.data import IterableDataset

from callbacks import Callback, ModelCheckpoint
from hapi import Model


# -- Model(labels=0): a network that returns (logits, loss) ------------------------------------
class WithOwnLoss(nn.Module):
    """Takes (x, y) and returns (logits, loss), as nanoGPT's model does."""

    def __init__(self) -> None:
        super().__init__()
        self.net = TinyNet()

    def forward(self, x, y):
        logits = self.net(x)
        return logits, nn.functional.cross_entropy(logits, y)


def own_loss_model(seed: int = 0) -> Model:
    torch.manual_seed(seed)
    model = Model(WithOwnLoss(), inputs=2, labels=0)
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), loss=lambda logits, loss: loss)
    return model


def mean_loss(network: nn.Module, x, y, batch: int) -> float:
    """The evaluation loss by hand: the batches' losses weighted by their length."""
    network.eval()
    with torch.no_grad():
        total = sum(
            network(x[i : i + batch], y[i : i + batch])[1].item() * len(x[i : i + batch])
            for i in range(0, len(x), batch)
        )
    return total / len(x)


def test_a_network_loss_with_no_labels_is_evaluated_as_trained():
    x, y = make_tiny_data(40)
    model = own_loss_model()
    history = model.fit((x, y), (x, y), batch_size=16, epochs=2, shuffle=False, verbose=0)
    # Old code: val_loss 0.0 every epoch and evaluate() {'loss': 0.0} (the loss needed labels).
    assert history.history["val_loss"][-1] == pytest.approx(
        mean_loss(model.network, x, y, 16), rel=1e-5
    )
    assert history.history["val_loss"][0] > history.history["val_loss"][1] > 0
    assert model.evaluate((x, y), batch_size=7, verbose=0)["loss"] == pytest.approx(
        mean_loss(model.network, x, y, 7), rel=1e-5
    )
    assert model.eval_batch([x[:5], y[:5]])["loss"] == pytest.approx(
        mean_loss(model.network, x[:5], y[:5], 5), rel=1e-5
    )


def test_best_checkpoint_follows_the_network_loss(tmp_path):
    x, y = make_tiny_data(40)
    model = own_loss_model()
    best = ModelCheckpoint(str(tmp_path), save_best_only=True, monitor="val_loss")
    model.fit((x, y), (x, y), batch_size=16, epochs=3, verbose=0, callbacks=[best])
    # With val_loss 0.0 every epoch the first epoch stayed "best" forever.
    assert best.best == pytest.approx(mean_loss(model.network, x, y, 16), rel=1e-5)


# -- a frozen network --------------------------------------------------------------------------
def frozen_model(seed: int = 0) -> Model:
    torch.manual_seed(seed)
    network = TinyNet()
    for parameter in network.parameters():
        parameter.requires_grad_(False)
    model = Model(network)
    model.prepare(torch.optim.SGD(network.parameters(), lr=0.1), nn.CrossEntropyLoss())
    return model


def test_a_frozen_network_trains_without_updates_and_warns_once():
    x, y = make_tiny_data(40)
    model = frozen_model()
    before = [p.clone() for p in model.parameters()]
    with pytest.warns(UserWarning, match=r"no parameter of TinyNet requires a gradient") as seen:
        history = model.fit((x, y), batch_size=8, epochs=2, verbose=0)
    assert len([w for w in seen if "requires a gradient" in str(w.message)]) == 1
    for old, new in zip(before, model.parameters()):
        assert torch.equal(old, new)
    expected = nn.functional.cross_entropy(model.network(x), y).item()
    assert history.history["loss"] == [pytest.approx(expected, rel=1e-5)] * 2
    assert model.step == 10  # steps are counted (schedules move on), as Keras counts iterations


def test_only_a_wholly_frozen_network_skips_its_updates():
    x, y = make_tiny_data(40)
    with pytest.warns(UserWarning, match="requires a gradient"):
        frozen_model().fit((x, y), batch_size=8, verbose=0)  # old code: torch's error here
    torch.manual_seed(0)
    network = TinyNet()
    network.hidden.requires_grad_(False)
    model = Model(network)
    model.prepare(torch.optim.SGD(network.out.parameters(), lr=0.1), nn.CrossEntropyLoss())
    before = network.out.weight.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # partly frozen: trained as ever, no warning
        model.fit((x, y), batch_size=8, verbose=0)
    assert not torch.equal(before, network.out.weight)

    class Detached(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 3)

        def forward(self, x):
            return self.layer(x).detach()

    model = Model(Detached())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    with pytest.raises(RuntimeError, match="does not require grad"):  # a bug of the user's
        model.fit((x, y), verbose=0)


# -- stop_evaluating / stop_predicting ---------------------------------------------------------
class StopAfter(Callback):
    """Sets model.stop_evaluating / stop_predicting after batch ``at``; counts batches seen."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at
        self.eval_batches = self.predict_batches = 0

    def on_eval_batch_end(self, step, logs=None):
        self.eval_batches += 1
        if step == self.at:
            self.model.stop_evaluating = True

    def on_predict_batch_end(self, step, logs=None):
        self.predict_batches += 1
        if step == self.at:
            self.model.stop_predicting = True


def evaluated_model() -> Model:
    torch.manual_seed(0)
    model = Model(TinyNet())
    model.prepare(loss=nn.CrossEntropyLoss())
    return model


def test_stop_evaluating_ends_after_that_batch_with_figures_of_the_batches_seen():
    x, y = make_tiny_data(40)
    model = evaluated_model()
    stop = StopAfter(1)
    logs = model.evaluate((x, y), batch_size=8, verbose=0, log_freq=1, callbacks=[stop])
    assert stop.eval_batches == 2
    seen = nn.functional.cross_entropy(model.network(x[:16]), y[:16]).item()
    assert logs["loss"] == pytest.approx(seen, rel=1e-5)
    assert model.stop_evaluating  # set until the next evaluation resets it (as in Keras)
    assert len(model.evaluate((x, y), batch_size=8, verbose=0)) == 1  # a fresh evaluation
    assert not model.stop_evaluating


def test_stop_predicting_ends_after_that_batch():
    x, _ = make_tiny_data(40)
    model = evaluated_model()
    stop = StopAfter(2)
    (outputs,) = model.predict((x,), batch_size=8, verbose=0, callbacks=[stop], stack_outputs=True)
    assert stop.predict_batches == 3 and len(outputs) == 24
    torch.testing.assert_close(outputs, model.network(x[:24]).detach())
    assert len(model.predict((x,), batch_size=8, verbose=0, stack_outputs=True)[0]) == 40


def test_stop_evaluating_in_fit_ends_that_evaluation_only():
    x, y = make_tiny_data(40)
    torch.manual_seed(0)
    model = Model(TinyNet())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    stop = StopAfter(0)
    history = model.fit((x, y), (x, y), batch_size=8, epochs=2, verbose=0, callbacks=[stop])
    assert stop.eval_batches == 2 and history.epoch == [0, 1]  # one batch per evaluation


class Endless(IterableDataset):
    """A stream of unknown length (long enough that only a stop ends a pass early)."""

    def __iter__(self):
        for _ in range(400):
            yield torch.ones(4), torch.tensor(0)


def test_stop_ends_a_stream_s_evaluation_and_prediction():
    model = evaluated_model()
    stop = StopAfter(4)
    model.evaluate(Endless(), batch_size=2, verbose=0, callbacks=[stop])
    model.predict(Endless(), batch_size=2, verbose=0, callbacks=[stop])
    assert stop.eval_batches == 5 and stop.predict_batches == 5


# -- a step's figure weights -------------------------------------------------------------------
class TokenModel(Model):
    """A language-model-like step: the loss is a mean over a batch's (variable) tokens."""

    def train_step(self, batch):
        x, tokens = batch
        loss = (self.network(x).sum() * 0 + x.sum()) / tokens.sum()  # a per-token mean
        self.backward(loss)
        self.optimizer_step()
        return {"loss": loss, "double": 2 * loss, "weight": tokens.sum()}

    def eval_step(self, batch):
        x, tokens = batch
        return {"loss": x.sum() / tokens.sum(), "weight": tokens.sum()}


def token_data():
    tokens = torch.tensor([1, 5, 2, 8, 3, 1])
    x = torch.arange(6.0).reshape(6, 1) * tokens.reshape(6, 1)
    return x, tokens


def test_figures_of_a_step_are_weighted_by_the_weight_it_returns():
    x, tokens = token_data()
    model = TokenModel(nn.Linear(1, 1))
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.0))
    history = model.fit((x, tokens), (x, tokens), batch_size=2, shuffle=False, verbose=0)
    per_token = (x.sum() / tokens.sum()).item()  # sum of losses * tokens / all tokens
    by_batch = sum((x[i : i + 2].sum() / tokens[i : i + 2].sum()).item() * 2 for i in (0, 2, 4)) / 6
    assert history.history["loss"] == [pytest.approx(per_token, rel=1e-6)]
    assert history.history["double"] == [pytest.approx(2 * per_token, rel=1e-6)]
    assert history.history["val_loss"] == [pytest.approx(per_token, rel=1e-6)]
    assert "weight" not in history.history and abs(by_batch - per_token) > 0.1  # old result


def test_a_step_weight_must_be_one_non_negative_number():
    class Bad(TokenModel):
        def eval_step(self, batch):
            return {"loss": batch[0].sum(), "weight": batch[1]}

    x, tokens = token_data()
    model = Bad(nn.Linear(1, 1))
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.0))
    with pytest.raises(ValueError, match=r"'weight' must be one number .*token count"):
        model.evaluate((x, tokens), batch_size=2, verbose=0)
    Bad.eval_step = lambda self, batch: {"loss": batch[0].sum(), "weight": -1}
    with pytest.raises(ValueError, match=r"must not be negative; received -1"):
        model.evaluate((x, tokens), batch_size=2, verbose=0)


def test_weighted_sums_travel_in_the_state_dict():
    x, tokens = token_data()
    model = TokenModel(nn.Linear(1, 1))
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.0))
    metrics = model._metrics
    metrics.reset()
    metrics.update_logs({"loss": 1.0, "weight": 3}, 2)
    state = metrics.state_dict()
    metrics.reset()
    metrics.load_state_dict(state)
    metrics.update_logs({"loss": 5.0}, 1)  # no weight: its sample count
    assert metrics.compute(sync=False)["loss"] == pytest.approx((1.0 * 3 + 5.0 * 1) / 4)
    assert metrics.counted == 3  # samples, not weights


# -- learning rates in History -----------------------------------------------------------------
def test_history_records_each_epoch_s_learning_rate():
    from callbacks import LRScheduler

    x, y = make_tiny_data(32)
    torch.manual_seed(0)
    model = Model(TinyNet())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.prepare(optimizer, nn.CrossEntropyLoss())
    schedule = LRScheduler(torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5))
    history = model.fit((x, y), batch_size=16, epochs=3, verbose=0, callbacks=[schedule])
    assert history.history["lr"] == pytest.approx([0.1, 0.05, 0.025])  # the rate each trained with


def test_history_names_the_rates_of_several_optimizers():
    from own_step_models import gan_model, real_points

    model = gan_model()
    history = model.fit(real_points(16), batch_size=8, epochs=2, verbose=0)
    assert history.history["lr_0"] == [1e-3, 1e-3] and history.history["lr_1"] == [0.05, 0.05]
