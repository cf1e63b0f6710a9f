"""A train_step of the user's own: two optimizers, two losses, state carried between batches."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_data
from own_step_models import Pair, gan_model, real_points
from torch import nn

from callbacks import BackupAndRestore, Callback
from hapi import Model


def _weights(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 16)
        self.classes = nn.Linear(16, 3)
        self.size = nn.Linear(16, 1)

    def forward(self, x):
        hidden = torch.relu(self.body(x))
        return self.classes(hidden), self.size(hidden)


class MultiTask(Model):
    def train_step(self, batch):
        x, y = batch
        classes, size = self.network(x)
        loss_class = nn.functional.cross_entropy(classes, y)
        loss_size = nn.functional.mse_loss(size.squeeze(1), x.norm(dim=1))
        loss = loss_class + 0.5 * loss_size
        self.backward(loss)
        self.optimizer_step()
        return {"loss": loss, "loss_class": loss_class, "loss_size": loss_size}

    def eval_step(self, batch):
        x, y = batch
        classes, _ = self.network(x)
        return {"acc": (classes.argmax(1) == y).float().mean()}


def test_two_losses_train_like_a_hand_loop_and_log_their_epoch_means():
    x, y = make_tiny_data(50)
    torch.manual_seed(0)
    model = MultiTask(TwoHeads())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    history = model.fit((x, y), eval_data=(x, y), batch_size=20, epochs=2, shuffle=False, verbose=0)

    torch.manual_seed(0)
    network = TwoHeads()
    optimizer = torch.optim.SGD(network.parameters(), lr=0.1)
    for _ in range(2):
        sums, seen = {"loss_class": 0.0, "loss_size": 0.0}, 0
        for xb, yb in zip(x.split(20), y.split(20)):
            classes, size = network(xb)
            loss_class = nn.functional.cross_entropy(classes, yb)
            loss_size = nn.functional.mse_loss(size.squeeze(1), xb.norm(dim=1))
            (loss_class + 0.5 * loss_size).backward()
            optimizer.step()
            optimizer.zero_grad()
            sums["loss_class"] += loss_class.item() * len(xb)
            sums["loss_size"] += loss_size.item() * len(xb)
            seen += len(xb)
    torch.testing.assert_close(_weights(model.network), _weights(network), atol=1e-6, rtol=0)
    assert history.history["loss_class"][-1] == pytest.approx(sums["loss_class"] / seen, rel=1e-5)
    assert history.history["loss_size"][-1] == pytest.approx(sums["loss_size"] / seen, rel=1e-5)
    accuracy = (network(x)[0].argmax(1) == y).float().mean().item()
    assert history.history["val_acc"][-1] == pytest.approx(accuracy)
    assert model.step == 6


class LanguageModel(nn.Module):
    """pytorch/examples' word_language_model in small: forward(x, hidden) -> (scores, hidden)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.rnn = nn.GRU(8, 12, batch_first=True)
        self.out = nn.Linear(12, 11)

    def forward(self, tokens, hidden=None):
        states, hidden = self.rnn(self.embed(tokens), hidden)
        return self.out(states), hidden


class Truncated(Model):
    """Truncated backpropagation through time: the hidden state goes on, its history does not."""

    hidden = None

    def train_step(self, batch):
        tokens, targets = batch
        if self.epoch_step == 0:
            self.hidden = None
        scores, hidden = self.network(tokens, self.hidden)
        self.hidden = hidden.detach()
        loss = nn.functional.cross_entropy(scores.reshape(-1, 11), targets.reshape(-1))
        self.backward(loss)
        self.optimizer_step()
        return {"loss": loss}


def test_a_language_model_carries_its_hidden_state_between_batches():
    stream = torch.randint(0, 11, (1, 4 * 5 * 7 + 1), generator=torch.Generator().manual_seed(0))
    tokens = stream[:, :-1].reshape(4 * 5, 7)  # consecutive chunks, kept in order (shuffle=False)
    targets = stream[:, 1:].reshape(4 * 5, 7)
    torch.manual_seed(0)
    model = Truncated(LanguageModel())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.5), clip_grad_norm=0.25)
    model.fit((tokens, targets), batch_size=1, epochs=1, shuffle=False, verbose=0)

    torch.manual_seed(0)
    network = LanguageModel()
    optimizer = torch.optim.SGD(network.parameters(), lr=0.5)
    hidden = None
    for index in range(len(tokens)):
        scores, hidden = network(tokens[index : index + 1], hidden)
        hidden = hidden.detach()
        nn.functional.cross_entropy(scores.reshape(-1, 11), targets[index]).backward()
        torch.nn.utils.clip_grad_norm_(network.parameters(), 0.25)
        optimizer.step()
        optimizer.zero_grad()
    torch.testing.assert_close(_weights(model.network), _weights(network), atol=1e-6, rtol=0)


def test_a_gan_saves_both_optimizers_and_resumes_exactly(tmp_path):
    data = real_points(64)
    uninterrupted = gan_model()
    history = uninterrupted.fit(data, batch_size=16, epochs=2, verbose=0)
    assert set(history.history) == {"d_loss", "g_loss", "lr_0", "lr_1"}

    class Crash(Callback):
        def on_train_batch_end(self, step, logs=None):
            if self.model.step == 6:
                raise KeyboardInterrupt  # dies in epoch 2 (4 steps an epoch); the last backup: step 3

    with pytest.raises(KeyboardInterrupt):
        gan_model().fit(
            data,
            batch_size=16,
            epochs=2,
            verbose=0,
            callbacks=[BackupAndRestore(tmp_path, save_freq=3), Crash()],
        )
    resumed = gan_model(seed=5)
    resumed.fit(
        data,
        batch_size=16,
        epochs=2,
        verbose=0,
        callbacks=[BackupAndRestore(tmp_path, save_freq=3)],
    )
    assert torch.equal(_weights(resumed.network), _weights(uninterrupted.network))

    file = uninterrupted.save(tmp_path / "gan")
    state = torch.load(file, weights_only=True)
    assert sorted(state["optimizers"]) == ["0", "1"] and state["optimizer_types"] == {
        "0": "Adam",
        "1": "SGD",
    }
    loaded = gan_model(seed=7)
    loaded.load(file)
    for mine, theirs in zip(loaded.optimizers, uninterrupted.optimizers):
        assert str(mine.state_dict()) == str(theirs.state_dict())


def test_own_step_errors_name_the_fix():
    model = Model(Pair())
    model.prepare(
        [torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)],
        nn.MSELoss(),
    )
    with pytest.raises(RuntimeError, match=r"2 optimizers.*Override train_step"):
        model.fit(real_points(8), verbose=0)
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=2.*GAN"):
        gan_model().fit(real_points(8), accumulate_grad_batches=2, verbose=0)
    with pytest.raises(
        TypeError, match=r"optimizer must be a torch.optim.Optimizer, or a list or dict"
    ):
        Model(Pair()).prepare(["sgd"])


class EveryOtherBatch(Model):
    """A step that updates on every other batch only (a discriminator trained half as often)."""

    def train_step(self, batch):
        x, y = batch
        with self.autocast():
            loss = nn.functional.cross_entropy(self.network(x), y)
        self.backward(loss)
        if self.epoch_step % 2 == 1:
            self.optimizer_step()
        return {"loss": loss}


def test_an_fp16_step_of_ones_own_may_skip_its_update_on_some_batches():
    """The gradient scale moves after the steps that stepped it only; moving it after a step
    with no update raised torch's 'No inf checks were recorded prior to update'."""
    x, y = make_tiny_data(64)
    torch.manual_seed(0)
    model = EveryOtherBatch(nn.Linear(4, 3), device="cpu")
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), amp="fp16")
    before = _weights(model.network)
    history = model.fit((x, y), batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert len(history.history["loss"]) == 2
    assert not torch.equal(_weights(model.network), before)  # the odd batches updated


class Wrapped(Model):
    """Keras' pattern: an override that does something around the built-in step."""

    calls = 0

    def train_step(self, batch):
        Wrapped.calls += 1
        return super().train_step(batch)


def test_an_override_calling_the_built_in_step_keeps_the_prepared_metrics():
    """The metrics of prepare() were dropped when an override called super().train_step."""
    torchmetrics = pytest.importorskip("torchmetrics")
    x, y = make_tiny_data(64)
    results = {}
    for kind in (Model, Wrapped):
        torch.manual_seed(0)
        model = kind(nn.Linear(4, 3), device="cpu")
        model.prepare(
            torch.optim.SGD(model.parameters(), lr=0.1),
            nn.CrossEntropyLoss(),
            {"acc": torchmetrics.classification.MulticlassAccuracy(3, average="micro")},
        )
        history = model.fit((x, y), eval_data=(x, y), batch_size=16, epochs=2, verbose=0)
        results[kind] = (history.history, _weights(model.network))
    assert Wrapped.calls == 8
    assert results[Wrapped][0] == results[Model][0]  # loss, acc, val_loss, val_acc alike
    assert torch.equal(results[Wrapped][1], results[Model][1])
