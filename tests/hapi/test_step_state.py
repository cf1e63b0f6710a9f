"""State a train_step of the user's own carries between batches, kept in resumable checkpoints."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from callbacks import BackupAndRestore, Callback
from hapi import Model

VOCAB, LENGTH, BATCHES = 11, 5, 10


class LanguageModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 6)
        self.rnn = nn.GRU(6, 8, batch_first=True)
        self.out = nn.Linear(8, VOCAB)

    def forward(self, tokens, hidden=None):
        states, hidden = self.rnn(self.embed(tokens), hidden)
        return self.out(states), hidden


class Carried(Model):
    """Truncated BPTT: the hidden state goes on from batch to batch, and across epochs."""

    hidden = None

    def train_step(self, batch):
        tokens, targets = batch
        scores, hidden = self.network(tokens, self.hidden)
        self.hidden = hidden.detach()
        loss = nn.functional.cross_entropy(scores.reshape(-1, VOCAB), targets.reshape(-1))
        self.backward(loss)
        self.optimizer_step()
        return {"loss": loss}


class Kept(Carried):
    """The same step, with its hidden state in resumable checkpoints."""

    def step_state_dict(self):
        return {"hidden": self.hidden}

    def load_step_state_dict(self, state):
        hidden = state["hidden"]
        self.hidden = None if hidden is None else hidden.to(self.device)


def _data():
    stream = torch.randint(
        0, VOCAB, (1, BATCHES * LENGTH + 1), generator=torch.Generator().manual_seed(0)
    )
    return stream[:, :-1].reshape(BATCHES, LENGTH), stream[:, 1:].reshape(BATCHES, LENGTH)


def _model(kind=Kept, seed=0):
    torch.manual_seed(seed)
    model = kind(LanguageModel())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.5))
    return model


def _weights(model):
    return torch.cat([p.detach().flatten() for p in model.network.parameters()])


class Crash(Callback):
    def __init__(self, at):
        super().__init__()
        self.at = at

    def on_train_batch_end(self, step, logs=None):
        if self.model.step == self.at:
            raise KeyboardInterrupt


def _fit(model, callbacks=()):
    return model.fit(
        _data(), batch_size=1, epochs=2, shuffle=False, verbose=0, callbacks=list(callbacks)
    )


def _killed_and_resumed(tmp_path, crashing=Kept, resuming=Kept):
    with pytest.raises(
        KeyboardInterrupt
    ):  # dies at step 15 (epoch 2, batch 5); last backup: step 12
        _fit(_model(crashing), [BackupAndRestore(tmp_path, save_freq=4), Crash(15)])
    resumed = _model(resuming, seed=5)
    _fit(resumed, [BackupAndRestore(tmp_path, save_freq=4)])
    return resumed


def test_a_run_killed_mid_epoch_resumes_its_carried_hidden_state_exactly(tmp_path):
    uninterrupted = _model()
    _fit(uninterrupted)
    resumed = _killed_and_resumed(tmp_path)
    assert torch.equal(_weights(resumed), _weights(uninterrupted))
    assert torch.equal(resumed.hidden, uninterrupted.hidden)


def test_a_resumable_save_holds_the_state_and_fit_resume_from_restores_it(tmp_path):
    model = _model()
    saved = {}

    class Save(Callback):
        def on_train_batch_end(self, step, logs=None):
            if self.model.step == 13:  # mid-way through the second epoch
                saved["resumable"] = self.model.save(tmp_path / "resumable", resumable=True)
                saved["plain"] = self.model.save(tmp_path / "plain")

    _fit(model, [Save()])
    per_rank = torch.load(saved["resumable"], weights_only=True)["fit"]["per_rank"]
    assert [sorted(part["step_state"]) for part in per_rank] == [["hidden"]]
    assert per_rank[0]["step_state"]["hidden"].shape == (1, 1, 8)
    assert "fit" not in torch.load(saved["plain"], weights_only=True)

    resumed = _model(seed=5)
    resumed.fit(
        _data(), batch_size=1, epochs=2, shuffle=False, verbose=0, resume_from=saved["resumable"]
    )
    assert torch.equal(_weights(resumed), _weights(model))


def test_a_file_saved_without_step_state_still_resumes(tmp_path):
    # Saved by a Model without the pair (or an older torch-hapi): the run resumes, hidden starts afresh.
    resumed = _killed_and_resumed(tmp_path, crashing=Carried, resuming=Kept)
    assert resumed.epoch == 2 and resumed.hidden is not None


def test_a_file_with_step_state_resumed_by_a_model_without_the_pair_warns(tmp_path):
    with pytest.warns(UserWarning, match="defines no load_step_state_dict"):
        _killed_and_resumed(tmp_path, crashing=Kept, resuming=Carried)


def test_half_a_pair_or_a_state_that_is_no_dict_is_refused_with_the_fix(tmp_path):
    class OnlySave(Carried):
        def step_state_dict(self):
            return {"hidden": self.hidden}

    class NotADict(Kept):
        def step_state_dict(self):
            return self.hidden

    for kind, message in (
        (OnlySave, r"defines step_state_dict\(\) but not load_step_state_dict\(\)"),
        (NotADict, r"step_state_dict\(\) returned Tensor; it must return a dict"),
    ):
        with pytest.raises(TypeError, match=message):
            _fit(_model(kind), [BackupAndRestore(tmp_path / kind.__name__, save_freq=4)])
