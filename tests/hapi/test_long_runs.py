"""Evaluation every N steps, and fit(resume_from=...): what long runs need."""

from __future__ import annotations

import pytest
import torch
from conftest import TinyNet, make_tiny_data, tiny_model
from torch import nn

from callbacks import BackupAndRestore, Callback
from hapi import Model
from hapi.metrics import Accuracy

DATA = make_tiny_data(50)
EVAL = make_tiny_data(13, seed=1)


def assert_same_history(mine: dict, theirs: dict) -> None:
    """The same names and, per name, the same values (pytest.approx takes no dict of lists)."""
    assert mine.keys() == theirs.keys()
    for name, values in theirs.items():
        assert mine[name] == pytest.approx(values), name


def _model() -> Model:
    return tiny_model(0.3, Accuracy(), momentum=0.9)


def test_eval_steps_evaluates_every_n_steps_without_disturbing_training():
    model = _model()
    history = model.fit(
        DATA, eval_data=EVAL, batch_size=10, epochs=2, shuffle=False, verbose=0, eval_steps=2
    )
    # 5 steps an epoch: mid-epoch at 2, 4, 6, 8; at each epoch end (5, 10) once.
    assert [(e["step"], e["epoch"]) for e in history.evaluations] == [
        (2, 0),
        (4, 0),
        (5, 0),
        (6, 1),
        (8, 1),
        (10, 1),
    ]
    plain = _model()
    plain_history = plain.fit(
        DATA, eval_data=EVAL, batch_size=10, epochs=2, shuffle=False, verbose=0
    )
    assert_same_history(history.history, plain_history.history)  # the epochs' figures are unchanged
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))
    for evaluation in history.evaluations:  # each is the model after that many steps
        reference = _model()
        reference.fit(
            DATA, batch_size=10, epochs=2, shuffle=False, verbose=0, num_iters=evaluation["step"]
        )
        figures = reference.evaluate(EVAL, batch_size=10, verbose=0)
        assert evaluation["loss"] == pytest.approx(figures["loss"], rel=1e-6)
        assert evaluation["acc"] == pytest.approx(figures["acc"])


def test_mid_epoch_evaluations_reach_callbacks_at_their_step():
    seen = []

    class Watch(Callback):
        def on_eval_end(self, logs=None):
            seen.append((self.model.step, sorted(logs)))

    _model().fit(
        DATA, eval_data=EVAL, batch_size=10, epochs=1, verbose=0, eval_steps=3, callbacks=[Watch()]
    )
    assert seen == [(3, ["acc", "loss"]), (5, ["acc", "loss"])]


def test_fit_resume_from_a_backup_ends_with_the_uninterrupted_weights(tmp_path):
    uninterrupted = _model()
    uninterrupted.fit(DATA, eval_data=EVAL, batch_size=10, epochs=3, verbose=0)

    class Crash(Callback):
        def on_train_batch_end(self, step, logs=None):
            if self.model.step == 8:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _model().fit(
            DATA,
            eval_data=EVAL,
            batch_size=10,
            epochs=3,
            verbose=0,
            callbacks=[BackupAndRestore(tmp_path, save_freq=3), Crash()],
        )
    torch.manual_seed(123)
    resumed = Model(TinyNet())
    resumed.prepare(
        torch.optim.SGD(resumed.parameters(), lr=0.3, momentum=0.9),
        nn.CrossEntropyLoss(),
        Accuracy(),
    )
    history = resumed.fit(
        DATA, eval_data=EVAL, batch_size=10, epochs=3, verbose=0, resume_from=tmp_path / "backup.pt"
    )
    assert all(torch.equal(p, q) for p, q in zip(resumed.parameters(), uninterrupted.parameters()))
    assert resumed.step == 15 and history.epoch == [0, 1, 2]


def test_resume_from_refuses_what_it_cannot_continue(tmp_path):
    model = _model()
    model.fit(DATA, batch_size=10, verbose=0)
    model.save(tmp_path / "plain")  # saved outside fit: nothing to continue
    with pytest.raises(Exception, match=r"resum"):
        _model().fit(DATA, batch_size=10, verbose=0, resume_from=tmp_path / "plain.pt")
    with pytest.raises(TypeError, match=r"resume_from must be the path"):
        _model().fit(DATA, batch_size=10, verbose=0, resume_from=3)
    with pytest.raises(ValueError, match=r"eval_steps"):
        _model().fit(DATA, batch_size=10, verbose=0, eval_steps=0)


def test_resume_from_a_resumable_epoch_checkpoint_listed_first_is_exact(tmp_path):
    """The user lists ModelCheckpoint before LRScheduler: its files still hold the schedule after the epoch."""
    from callbacks import LRScheduler, ModelCheckpoint

    def run(callbacks, resume_from=None):
        model = _model()
        scheduler = torch.optim.lr_scheduler.StepLR(model.optimizer, step_size=1, gamma=0.5)
        history = model.fit(
            DATA,
            eval_data=EVAL,
            batch_size=10,
            epochs=3,
            verbose=0,
            resume_from=resume_from,
            callbacks=callbacks + [LRScheduler(scheduler)],
        )
        return model, history

    uninterrupted, full = run([ModelCheckpoint(tmp_path, resumable=True)])
    resumed, history = run([], resume_from=tmp_path / "0.pt")
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(0.3 * 0.5**3)
    assert all(torch.equal(p, q) for p, q in zip(resumed.parameters(), uninterrupted.parameters()))
    assert_same_history(history.history, full.history)
