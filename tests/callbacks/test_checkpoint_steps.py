"""ModelCheckpoint(save_steps=N, keep=k, resumable=True): which step files appear, which survive,
and that a fit continued from one of them ends like a run never interrupted.

The two-process case runs this very file under torchrun (``python -m torch.distributed.run
test_checkpoint_steps.py OUT``): the script part is at the bottom.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import warnings

import pytest
import torch
from conftest import TinyNet, make_tiny_data
from dist_helpers import torchrun
from stub import attach
from torch import nn

import hapi.checkpoint
from callbacks import History, LRScheduler, ModelCheckpoint
from hapi import Model


class DropoutNet(nn.Module):
    """Dropout makes training depend on the RNG state, which a resumable file must carry."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _model(seed: int = 0) -> tuple[Model, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Model(DropoutNet())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.prepare(optimizer, nn.CrossEntropyLoss())
    return model, optimizer


def _record_saves(model: Model, calls: list | None = None) -> list[tuple[str, int]]:
    """(file name, model.step) of every model.save call, in order, into ``calls``."""
    calls = [] if calls is None else calls
    save = model.save

    def recording(path, *args, **kwargs):
        calls.append((os.path.basename(os.fspath(path)), model.step))
        return save(path, *args, **kwargs)

    model.save = recording
    return calls


def _saved(file: pathlib.Path) -> dict:
    return torch.load(file, weights_only=True)


def _weights(model: Model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_step_files_at_every_n_optimizer_steps(tmp_path):
    model, _ = _model()
    saves = _record_saves(model)
    model.fit(
        make_tiny_data(96),
        batch_size=8,
        epochs=2,
        verbose=0,
        callbacks=[ModelCheckpoint(tmp_path, save_freq=2, save_steps=5)],
    )
    # 24 steps; epoch 1 writes no <epoch>.pt (save_freq=2), so no step is merged into one.
    assert saves == [
        ("step-5", 5),
        ("step-10", 10),
        ("0", 12),
        ("step-15", 15),
        ("step-20", 20),
        ("final", 24),
    ]
    assert sorted(os.listdir(tmp_path)) == [
        "0.pt",
        "final.pt",
        "step-10.pt",
        "step-15.pt",
        "step-20.pt",
        "step-5.pt",
    ]
    assert [_saved(tmp_path / f"step-{n}.pt")["step"] for n in (5, 10, 15, 20)] == [5, 10, 15, 20]
    assert _saved(tmp_path / "step-15.pt")["epoch_step"] == 3  # mid-epoch: batch 3 of epoch 1


def test_with_accumulation_a_step_is_saved_once_not_at_every_batch_of_its_group(tmp_path):
    model, _ = _model()
    saves = _record_saves(model)
    # 3 batches per update: 4 updates per epoch, 8 in all; model.step stays 3 for batches 9-11.
    model.fit(
        make_tiny_data(96),
        batch_size=8,
        epochs=2,
        verbose=0,
        accumulate_grad_batches=3,
        callbacks=[ModelCheckpoint(tmp_path, save_steps=3)],
    )
    assert saves == [("step-3", 3), ("0", 4), ("step-6", 6), ("1", 8), ("final", 8)]
    assert _saved(tmp_path / "step-3.pt")["epoch_step"] == 9  # saved at the update, batch 9
    assert _saved(tmp_path / "step-6.pt")["epoch_step"] == 6


def test_a_step_at_an_epochs_end_is_written_once_under_both_names(tmp_path):
    model, _ = _model()
    saves = _record_saves(model)
    model.fit(
        make_tiny_data(96),
        batch_size=8,
        epochs=2,
        verbose=0,
        callbacks=[ModelCheckpoint(tmp_path, save_freq=2, save_steps=4)],
    )
    # Step 12 ends epoch 0, which saves 0.pt: one write, two names. Step 24 ends
    # epoch 1, which saves no <epoch>.pt (save_freq=2): written as a step file.
    assert saves == [
        ("step-4", 4),
        ("step-8", 8),
        ("0", 12),
        ("step-16", 16),
        ("step-20", 20),
        ("step-24", 24),
        ("final", 24),
    ]
    assert os.path.samefile(tmp_path / "step-12.pt", tmp_path / "0.pt")
    assert _saved(tmp_path / "step-12.pt")["step"] == 12
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["0.pt", "final.pt"] + [f"step-{n}.pt" for n in (4, 8, 12, 16, 20, 24)]
    )


def test_keep_leaves_the_newest_numbered_files_and_best_and_final(tmp_path):
    (tmp_path / "step-1.pt").write_bytes(b"an earlier run's")
    (tmp_path / "7.pt").write_bytes(b"an earlier run's")
    model, _ = _model()
    x, y = make_tiny_data(96)
    checkpoints = ModelCheckpoint(tmp_path, save_steps=5, keep=2)
    model.fit(
        (x, y),
        eval_data=(x[:16], y[:16]),
        batch_size=8,
        epochs=2,
        verbose=0,
        callbacks=[checkpoints],
    )
    # Written in order: step-5, step-10, 0, step-15, step-20, 1 -> the last two stay.
    assert sorted(os.listdir(tmp_path)) == [
        "1.pt",
        "7.pt",
        "best.pt",
        "final.pt",
        "step-1.pt",
        "step-20.pt",
    ]
    assert (tmp_path / "step-1.pt").read_bytes() == b"an earlier run's"  # not this run's: kept
    assert checkpoints.state_dict()["written"] == ["step-20", "1"]


def test_keep_counts_the_files_of_every_fit_the_callback_was_given_to(tmp_path):
    model, _ = _model()
    checkpoints = ModelCheckpoint(tmp_path, save_steps=5, keep=2)
    model.fit(make_tiny_data(96), batch_size=8, epochs=1, verbose=0, callbacks=[checkpoints])
    assert sorted(os.listdir(tmp_path)) == ["0.pt", "final.pt", "step-10.pt"]
    # model.step goes on from 12; epochs count from 0 again, so 0.pt is rewritten (the newest).
    model.fit(make_tiny_data(96), batch_size=8, epochs=1, verbose=0, callbacks=[checkpoints])
    assert sorted(os.listdir(tmp_path)) == ["0.pt", "final.pt", "step-20.pt"]


def test_keep_one_with_a_merged_step_keeps_the_epoch_name(tmp_path):
    model, _ = _model()
    model.fit(
        make_tiny_data(96),
        batch_size=8,
        epochs=1,
        verbose=0,
        callbacks=[ModelCheckpoint(tmp_path, save_steps=6, keep=1)],
    )
    assert sorted(os.listdir(tmp_path)) == ["0.pt", "final.pt"]


def test_a_step_left_to_the_epochs_end_survives_a_resume_there(tmp_path, capsys):
    """BackupAndRestore may back up between the last batch and the epoch's end."""
    before = ModelCheckpoint(tmp_path, save_steps=4)
    model = attach(before, steps=4)
    before.on_train_begin()
    model.step, model.epoch_step = 4, 4  # the epoch's last batch: step-4 waits for 0.pt
    before.on_train_batch_end(3)
    assert model.saved == []
    after = ModelCheckpoint(tmp_path, save_steps=4, verbose=1)
    attach(after, model, steps=4)
    after.on_train_begin()
    after.load_state_dict(before.state_dict())
    after.on_epoch_end(0, {"loss": 1.0})
    assert os.path.samefile(tmp_path / "step-4.pt", tmp_path / "0.pt")
    out = capsys.readouterr().out
    assert f"Epoch 1: saving model to {tmp_path / '0'}.pt" in out
    assert f"Epoch 1: {tmp_path / 'step-4.pt'} is the same checkpoint as {tmp_path / '0.pt'}" in out


def _resumable_run(
    save_dir, resume_from=None, seed=0, keep=None, accumulate=1, saves=None, eval_steps=None
):
    """Two epochs, shuffled, with dropout, momentum, a per-epoch schedule and evaluation."""
    model, optimizer = _model(seed)
    if saves is not None:
        _record_saves(model, saves)
    schedule = LRScheduler(torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5))
    history = History()
    checkpoints = ModelCheckpoint(save_dir, save_steps=5, keep=keep, resumable=True)
    x, y = make_tiny_data(96)
    model.fit(
        (x, y),
        eval_data=(x[:24], y[:24]),
        batch_size=8,
        epochs=2,
        verbose=0,
        shuffle=True,
        accumulate_grad_batches=accumulate,
        eval_steps=eval_steps,
        resume_from=resume_from,
        callbacks=[schedule, history, checkpoints],
    )
    return model, optimizer, history, checkpoints


def test_a_fit_continued_from_a_mid_epoch_step_file_ends_like_an_uninterrupted_run(tmp_path):
    reference, optimizer, history, checkpoints = _resumable_run(tmp_path)
    assert sorted(os.listdir(tmp_path)) == [
        "0.pt",
        "1.pt",
        "best.pt",
        "final.pt",
        "step-10.pt",
        "step-15.pt",
        "step-20.pt",
        "step-5.pt",
    ]
    # step-15 lies in epoch 1, after the schedule's first step and epoch 0's evaluation.
    # Another seed: the weights must all come from the file. The resumed run writes to the
    # same directory with keep=2 and takes over the rotation of the files listed in step-15.pt.
    resumed, resumed_optimizer, resumed_history, resumed_checkpoints = _resumable_run(
        tmp_path, resume_from=tmp_path / "step-15.pt", seed=1, keep=2
    )
    assert (_weights(resumed) - _weights(reference)).abs().max() < 1e-6
    assert resumed.step == reference.step == 24
    assert resumed_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"] == 0.025
    assert resumed_history.history == history.history
    assert resumed_checkpoints.best == checkpoints.best
    assert sorted(os.listdir(tmp_path)) == ["1.pt", "best.pt", "final.pt", "step-20.pt"]


def test_a_fit_continued_from_a_step_file_with_accumulation_saves_that_step_once(tmp_path):
    reference, *_ = _resumable_run(tmp_path / "reference", accumulate=2)
    # 6 updates per epoch: step 10 is the update at batch 8 of epoch 1.
    assert _saved(tmp_path / "reference" / "step-10.pt")["epoch_step"] == 8
    saves = []
    resumed, *_ = _resumable_run(
        tmp_path / "resumed",
        tmp_path / "reference" / "step-10.pt",
        seed=1,
        accumulate=2,
        saves=saves,
    )
    assert (_weights(resumed) - _weights(reference)).abs().max() < 1e-6
    # model.step stays 10 over the next batch (the first of a group): no second step-10,
    # which would hold half a group's gradients that no file keeps.
    assert [name for name, _ in saves if name != "best"] == ["1", "final"]
    assert "step-10.pt" not in os.listdir(tmp_path / "resumed")


def test_files_saved_without_resumable_refuse_a_resume(tmp_path):
    model, _ = _model()
    model.fit(
        make_tiny_data(96),
        batch_size=8,
        epochs=1,
        verbose=0,
        callbacks=[ModelCheckpoint(tmp_path, save_steps=5)],
    )
    again, _ = _model()
    with pytest.raises(
        hapi.checkpoint.CheckpointError, match="was not saved to resume a fit"
    ) as caught:
        again.fit(
            make_tiny_data(96), batch_size=8, epochs=1, verbose=0, resume_from=tmp_path / "step-5"
        )
    # Advice the user can follow: how to write a resumable file, how to use this one; no
    # argument of load() that fit(resume_from=...) never took.
    message = str(caught.value)
    assert "ModelCheckpoint(..., resumable=True)" in message and "resume=True" not in message
    assert f"model.load('{tmp_path / 'step-5.pt'}') before fit()" in message


def test_a_fit_resumed_from_a_file_says_so_as_a_backup_does(tmp_path, capsys):
    # Old: BackupAndRestore printed where it resumed; fit(resume_from=...) said nothing.
    model, _ = _model()
    model.fit(
        make_tiny_data(96),
        batch_size=8,
        verbose=0,
        callbacks=[ModelCheckpoint(tmp_path, save_steps=5, resumable=True)],
    )
    capsys.readouterr()
    _model()[0].fit(make_tiny_data(96), batch_size=8, verbose=0, resume_from=tmp_path / "step-5")
    assert capsys.readouterr().out == (
        f"Resuming from {tmp_path / 'step-5'} at epoch 1, batch 5 (optimizer step 5).\n"
    )


@pytest.mark.parametrize(
    "name, value",
    [
        ("save_steps", 0),
        ("save_steps", -2),
        ("save_steps", 2.5),
        ("save_steps", "5"),
        ("save_steps", True),
        ("keep", 0),
        ("keep", 1.0),
    ],
)
def test_save_steps_and_keep_must_be_positive_ints(tmp_path, name, value):
    with pytest.raises(
        ValueError, match=rf"ModelCheckpoint: {name} must be a positive int or None; received"
    ):
        ModelCheckpoint(tmp_path, **{name: value})


def test_resumable_must_be_a_bool(tmp_path):
    with pytest.raises(TypeError, match=r"resumable must be True or False; received 'yes'"):
        ModelCheckpoint(tmp_path, resumable="yes")


def test_save_steps_with_save_best_only_is_refused(tmp_path):
    with pytest.raises(
        ValueError, match=r"save_best_only=True writes only best.pt, so save_steps=5"
    ):
        ModelCheckpoint(tmp_path, save_best_only=True, save_steps=5)


# -- best.pt after every evaluation of fit(eval_steps=N) ------------------------------------


def _lively_model(lr: float = 2.0) -> Model:
    """SGD at a large lr: its evaluation loss goes up and down within an epoch."""
    torch.manual_seed(0)
    model = Model(TinyNet())
    model.prepare(torch.optim.SGD(model.parameters(), lr=lr), nn.CrossEntropyLoss())
    return model


def _best_saves(model: Model, calls: list) -> None:
    """(model.step, model.epoch, model.epoch_step) of every save of best.pt, into ``calls``."""
    save = model.save

    def recording(path, *args, **kwargs):
        if os.path.basename(os.fspath(path)) == "best":
            calls.append((model.step, model.epoch, model.epoch_step))
        return save(path, *args, **kwargs)

    model.save = recording


def test_best_is_judged_after_every_evaluation_inside_the_epoch(tmp_path):
    # Old: only epoch ends were judged, so best.pt was written at steps 12 and 24 and held
    # step 24's weights (val_loss 0.382), not step 14's (0.321), the best evaluation.
    model, calls, history = _lively_model(), [], History()
    _best_saves(model, calls)
    checkpoints = ModelCheckpoint(tmp_path, save_steps=5, keep=1)
    x, y = make_tiny_data(96)
    model.fit(
        (x, y),
        eval_data=make_tiny_data(48, seed=1),
        batch_size=8,
        epochs=2,
        eval_steps=2,
        verbose=0,
        callbacks=[checkpoints, history],
    )
    losses = {e["step"]: e["loss"] for e in history.evaluations}
    assert sorted(losses) == list(range(2, 25, 2))
    best_step = min(losses, key=losses.get)
    assert best_step == 14 and checkpoints.best == losses[14]
    # Every improvement, mid-epoch or at the epoch's end, and only then; the epoch's own
    # evaluation (step 12) once, in a file of the finished epoch (epoch 1, batch 0).
    assert calls == [(2, 0, 2), (4, 0, 4), (6, 0, 6), (12, 1, 0), (14, 1, 2)]
    assert _saved(tmp_path / "best.pt")["step"] == 14
    assert sorted(os.listdir(tmp_path)) == ["1.pt", "best.pt", "final.pt"]  # keep=1


def test_save_best_only_keeps_the_best_evaluation_of_a_single_long_epoch(tmp_path):
    model, history = _lively_model(lr=3.0), History()
    checkpoints = ModelCheckpoint(tmp_path, save_best_only=True)
    model.fit(
        make_tiny_data(96),
        eval_data=make_tiny_data(48, seed=1),
        batch_size=8,
        eval_steps=2,
        verbose=0,
        callbacks=[checkpoints, history],
    )
    losses = {e["step"]: e["loss"] for e in history.evaluations}
    assert min(losses, key=losses.get) == 4  # old: best.pt held step 12, the epoch's end
    assert _saved(tmp_path / "best.pt")["step"] == 4
    assert checkpoints.best == losses[4]
    assert os.listdir(tmp_path) == ["best.pt"]


def test_a_monitor_of_training_figures_is_judged_at_epoch_ends_only(tmp_path):
    model, calls = _lively_model(), []
    _best_saves(model, calls)
    model.fit(
        make_tiny_data(96),
        eval_data=make_tiny_data(48, seed=1),
        batch_size=8,
        epochs=2,
        eval_steps=2,
        verbose=0,
        callbacks=[ModelCheckpoint(tmp_path, monitor="loss", save_best_only=True)],
    )
    assert [step for step, _, _ in calls] == [12, 24]  # no step evaluation counts


def test_an_evaluation_of_unknown_position_is_judged_once(tmp_path):
    """Epochs of unknown length: the epoch's own evaluation is judged at once, not again."""
    cb = ModelCheckpoint(tmp_path, save_best_only=True)
    model = attach(cb, steps=None)
    cb.on_train_begin()
    model.step, model.epoch_step = 7, 7
    cb.on_eval_end({"loss": 0.5})
    assert [os.path.basename(p) for p in model.saved] == ["best"]  # old: nothing yet
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the figure is there: no warning either
        cb.on_epoch_end(0, {"loss": 1.0, "val_loss": 0.5})
    assert [os.path.basename(p) for p in model.saved] == ["best"]
    assert cb.best == 0.5


def test_a_resumable_best_of_an_epoch_of_unknown_length_is_written_at_the_epochs_end(tmp_path):
    """Resumable, the best of an evaluation is written once its step's callbacks have run: the
    epoch's own evaluation, outside any batch, by the epoch's end (it was never written)."""
    cb = ModelCheckpoint(tmp_path, resumable=True)
    model = attach(cb, steps=None)
    cb.on_train_begin()
    model.step, model.epoch_step = 7, 7
    cb.on_eval_end({"loss": 0.5})
    assert model.saved == []  # not yet: the epoch's other callbacks come first
    model.epoch, model.epoch_step = 1, 0
    cb.on_epoch_end(0, {"loss": 1.0, "val_loss": 0.5})
    assert [os.path.basename(p) for p in model.saved] == ["best", "0"]
    cb.on_train_end()
    assert [os.path.basename(p) for p in model.saved] == ["best", "0", "final"]


def test_an_evaluation_at_the_last_batch_waits_for_the_epochs_end_even_across_a_resume(
    tmp_path,
):
    """A step evaluation at the epoch's last batch, with no epoch evaluation after it
    (eval_freq): judged at the epoch's end, also when a backup between the two is resumed."""
    before = ModelCheckpoint(tmp_path, save_best_only=True)
    model = attach(before, steps=4)
    before.on_train_begin()
    model.step, model.epoch_step = 4, 4
    before.on_eval_end({"loss": 0.25})
    assert model.saved == []  # not yet: the file is written at the epoch's end
    after = ModelCheckpoint(tmp_path, save_best_only=True)
    attach(after, model, steps=4)
    after.on_train_begin()
    after.load_state_dict(before.state_dict())
    model.epoch, model.epoch_step = 1, 0
    after.on_epoch_end(0, {"loss": 1.0})  # no val_loss: this epoch ran no evaluation of its own
    assert [os.path.basename(p) for p in model.saved] == ["best"]  # old: nothing, and a warning
    assert after.best == 0.25


def test_a_crafted_deferred_evaluation_is_refused(tmp_path):
    cb = ModelCheckpoint(tmp_path)
    attach(cb)
    with pytest.raises(ValueError, match=r"'deferred' must be \[\] or \[value, step\]; received"):
        cb.load_state_dict({**cb.state_dict(), "deferred": ["../x"]})


@pytest.mark.parametrize("written", ["12", 7])
def test_a_crafted_list_of_written_files_is_refused(tmp_path, written):
    """A string was read as the list of its characters: rotation could then delete a user's
    own files named like them; a number failed with a bare TypeError."""
    cb = ModelCheckpoint(tmp_path)
    attach(cb)
    with pytest.raises(ValueError, match=r"'written' must be a list of file names; received"):
        cb.load_state_dict({**cb.state_dict(), "written": written})


def test_evaluate_alone_writes_no_best(tmp_path):
    model = _lively_model()
    checkpoints = ModelCheckpoint(tmp_path)
    model.evaluate(make_tiny_data(16), batch_size=8, verbose=0, callbacks=[checkpoints])
    assert not tmp_path.joinpath("best.pt").exists()


def test_the_best_of_step_evaluations_survives_a_resume(tmp_path):
    reference, _, history, checkpoints = _resumable_run(
        tmp_path / "reference", saves=(reference_saves := []), eval_steps=2
    )
    losses = [e["loss"] for e in history.evaluations]
    assert checkpoints.best == min(losses)
    resumed_saves = []
    resumed, _, resumed_history, resumed_checkpoints = _resumable_run(
        tmp_path / "resumed",
        tmp_path / "reference" / "step-15.pt",
        seed=1,
        saves=resumed_saves,
        eval_steps=2,
    )
    assert (_weights(resumed) - _weights(reference)).abs().max() < 1e-6
    assert resumed_checkpoints.best == checkpoints.best
    assert resumed_history.evaluations == history.evaluations

    def best_steps(saves):
        return [step for name, step in saves if name == "best" and step > 15]

    # step-15.pt carried the best of evaluations up to step 14: the resumed run writes
    # best.pt exactly where the uninterrupted one did (old: at epoch ends only).
    assert best_steps(resumed_saves) == best_steps(reference_saves) == [20, 22, 24]


def test_an_epoch_file_holds_the_best_judged_at_its_epochs_end(tmp_path):
    # Old: 0.pt was written before the epoch's val_loss was judged, so a fit continued
    # from it started with best=inf and wrote best.pt for any value at all.
    _, _, history, _ = _resumable_run(tmp_path)
    state = dict(_saved(tmp_path / "0.pt")["fit"]["callbacks"])["ModelCheckpoint"]
    assert state["best"] == history.history["val_loss"][0]


def test_two_processes_judge_each_evaluation_alike_and_rank_0_writes(tmp_path):
    tests = str(pathlib.Path(__file__).resolve().parents[1])
    torchrun(
        ["--standalone", "--nproc_per_node=2", __file__, str(tmp_path), "best"],
        timeout=120,
        PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]),
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["best"] == ranks[1]["best"] == min(ranks[0]["losses"])
    assert ranks[0]["losses"] == ranks[1]["losses"]
    assert ranks[0]["saves"] == ranks[1]["saves"]  # the collective save, on both ranks
    assert len(ranks[0]["saves"]) >= 2 and any(step % 6 for step in ranks[0]["saves"])
    assert ranks[0]["writes"] == ["best.pt"] * len(ranks[0]["saves"])
    assert ranks[1]["writes"] == []
    best_step = ranks[0]["losses"].index(ranks[0]["best"])
    assert _saved(tmp_path / "ckpt" / "best.pt")["step"] == ranks[0]["steps"][best_step]


def test_two_processes_write_and_rotate_step_files_on_rank_0_only(tmp_path):
    tests = str(pathlib.Path(__file__).resolve().parents[1])
    torchrun(
        ["--standalone", "--nproc_per_node=2", __file__, str(tmp_path)],
        timeout=120,
        PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]),
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    # 96 samples, 48 per process, batch 8: 6 steps per epoch, 12 in all; written in order
    # step-4, 0, step-8, 1 (step-12 is the same file) and final.
    assert ranks[0]["writes"] == ["step-4.pt", "0.pt", "step-8.pt", "1.pt", "final.pt"]
    assert ranks[1]["writes"] == []
    assert ranks[0]["removed"] == ["step-4.pt", "0.pt", "step-8.pt"]
    assert ranks[1]["removed"] == []
    assert ranks[0]["written"] == ranks[1]["written"] == ["step-12", "1"]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["1.pt", "final.pt", "step-12.pt"]
    assert os.path.samefile(tmp_path / "ckpt" / "step-12.pt", tmp_path / "ckpt" / "1.pt")


def _two_process_best_script(out: pathlib.Path) -> None:
    """Rank R records its best.pt saves, its writes and what it judged in OUT/rankR.json."""
    writes = []
    write_file = hapi.checkpoint.state.write_file

    def recording_write(state, target, *args, **kwargs):
        writes.append(os.path.basename(target))
        return write_file(state, target, *args, **kwargs)

    hapi.checkpoint.state.write_file = recording_write
    model, history, saves = _lively_model(), History(), []
    _best_saves(model, saves)
    checkpoints = ModelCheckpoint(out / "ckpt", save_best_only=True)
    model.fit(
        make_tiny_data(96),
        eval_data=make_tiny_data(48, seed=1),
        batch_size=8,
        epochs=2,
        eval_steps=2,
        verbose=0,
        callbacks=[checkpoints, history],
    )
    (out / f"rank{os.environ['RANK']}.json").write_text(
        json.dumps(
            {
                "writes": writes,
                "saves": [step for step, _, _ in saves],
                "best": checkpoints.best,
                "losses": [e["loss"] for e in history.evaluations],
                "steps": [e["step"] for e in history.evaluations],
            }
        )
    )


def _two_process_script(out: pathlib.Path) -> None:
    """Rank R records the checkpoint files it writes and deletes in OUT/rankR.json."""
    writes, removed = [], []
    write_file, remove = hapi.checkpoint.state.write_file, hapi.checkpoint.files.remove_with_spare

    def recording_write(state, target, *args, **kwargs):
        writes.append(os.path.basename(target))
        return write_file(state, target, *args, **kwargs)

    def recording_remove(path):
        removed.append(os.path.basename(path))
        return remove(path)

    hapi.checkpoint.state.write_file, hapi.checkpoint.files.remove_with_spare = (
        recording_write,
        recording_remove,
    )
    model, _ = _model()
    checkpoints = ModelCheckpoint(out / "ckpt", save_steps=4, keep=2, resumable=True)
    model.fit(make_tiny_data(96), batch_size=8, epochs=2, verbose=0, callbacks=[checkpoints])
    rank = os.environ["RANK"]
    (out / f"rank{rank}.json").write_text(
        json.dumps(
            {"writes": writes, "removed": removed, "written": checkpoints.state_dict()["written"]}
        )
    )


if __name__ == "__main__":
    if sys.argv[2:] == ["best"]:
        _two_process_best_script(pathlib.Path(sys.argv[1]))
    else:
        _two_process_script(pathlib.Path(sys.argv[1]))
