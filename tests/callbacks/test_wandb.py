"""WandbCallback: offline runs read back from wandb's own .wandb files; never the network."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
from conftest import TinyNet, make_tiny_data
from dist_helpers import WORKER, read_ranks, torchrun
from stub import as_evaluate, attach
from wandb_offline import wandb_offline_fixture  # noqa: F401  (the wandb_offline fixture)

import callbacks.wandb
from callbacks import Callback
from callbacks.wandb import WandbCallback
from hapi import Model

pytestmark = pytest.mark.usefixtures("wandb_offline")


def fit_two_epochs(cb, model):
    """4 batches per epoch, log_freq=2: batch logs carry figures on steps 1 and 3."""
    cb.on_train_begin()
    for epoch in range(2):
        model.epoch = epoch  # as the loop sets it
        cb.on_epoch_begin(epoch)
        for step in range(4):
            cb.on_train_batch_begin(step)
            logs = {"batch_size": 8}
            if step % 2 == 1:
                logs.update(loss=10.0 * epoch + step, acc=0.25 * step, samples=8.0 * (step + 1))
            cb.on_train_batch_end(step, logs)
        model.optimizer.param_groups[0]["lr"] = 0.05  # e.g. a scheduler stepped
        cb.on_eval_begin({"steps": 2, "metrics": ["loss", "acc"]})
        cb.on_eval_end({"loss": 1.0 - 0.5 * epoch, "acc": 0.75 + 0.125 * epoch})
        cb.on_epoch_end(epoch, {"loss": 1.0, "acc": 0.5, "val_loss": 1.0, "val_acc": 0.75})
    cb.on_train_end()


def test_importing_callbacks_imports_no_wandb():
    # The callback's module and its constructor only look wandb up; the run's start imports it.
    code = (
        "import sys, callbacks, callbacks.wandb\n"
        "callbacks.wandb.WandbCallback(mode='disabled')\n"
        "print(sorted(m for m in sys.modules if m == 'wandb' or m.startswith('wandb.')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "[]"


def test_a_missing_wandb_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb fails, find_spec finds nothing
    with pytest.raises(ImportError, match=r"'wandb' package.*pip install wandb"):
        WandbCallback()


def test_fit_logs_paddle_names_and_the_lr_then_finishes(wandb_offline):
    cb = WandbCallback(
        project="hapi-test", name="two-epochs", dir=str(wandb_offline.dir), job_type="train"
    )
    assert cb.run is None  # nothing starts before training
    model = attach(cb, log_freq=2)
    fit_two_epochs(cb, model)
    assert cb.run is None
    (run,) = wandb_offline.runs()
    assert (run.run.project, run.run.display_name, run.run.job_type) == (
        "hapi-test",
        "two-epochs",
        "train",
    )
    assert run.metrics == {
        "train/step": "",
        "train/*": "train/step",
        "epoch": "",
        "eval/*": "epoch",
    }
    train = [row for row in run.history if "train/loss" in row]
    assert train == [
        {"train/step": 2, "train/loss": 1.0, "train/acc": 0.25, "train/lr": 0.1},
        {"train/step": 4, "train/loss": 3.0, "train/acc": 0.75, "train/lr": 0.1},
        {"train/step": 6, "train/loss": 11.0, "train/acc": 0.25, "train/lr": 0.05},
        {"train/step": 8, "train/loss": 13.0, "train/acc": 0.75, "train/lr": 0.05},
    ]
    evals = [row for row in run.history if "eval/loss" in row]
    assert evals == [
        {"epoch": 0, "train/step": 4, "eval/loss": 1.0, "eval/acc": 0.75},
        {"epoch": 1, "train/step": 8, "eval/loss": 0.5, "eval/acc": 0.875},
    ]
    assert len(run.history) == 6  # nothing logged on the steps between log_freq steps
    assert run.exit_code == 0  # finished


def test_a_real_fit_logs_what_history_holds(wandb_offline, tiny_net):
    model = Model(tiny_net)
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.CrossEntropyLoss())
    cb = WandbCallback(project="hapi-test", dir=str(wandb_offline.dir))
    history = model.fit(
        make_tiny_data(32),
        eval_data=make_tiny_data(16, seed=1),
        batch_size=8,
        epochs=2,
        log_freq=2,
        verbose=0,
        callbacks=[cb],
    )
    (run,) = wandb_offline.runs()
    train = [row for row in run.history if "train/loss" in row]
    assert [row["train/step"] for row in train] == [2, 4, 6, 8]
    assert [row["train/lr"] for row in train] == [0.1] * 4
    # The last batch of an epoch carries the epoch's running figures: History's.
    assert [train[1]["train/loss"], train[3]["train/loss"]] == pytest.approx(
        history.history["loss"]
    )
    evals = [row for row in run.history if "eval/loss" in row]
    assert [row["epoch"] for row in evals] == [0, 1]
    assert [row["eval/loss"] for row in evals] == pytest.approx(history.history["val_loss"])
    assert run.exit_code == 0


def test_other_ranks_start_no_run(wandb_offline):
    import wandb

    cb = WandbCallback(project="hapi-test", dir=str(wandb_offline.dir))
    model = attach(cb, rank=1, log_freq=2)
    fit_two_epochs(cb, model)
    cb.on_eval_begin({"steps": 2})  # a standalone evaluate, on rank 1
    cb.on_eval_end({"loss": 1.0})
    assert cb.run is None and wandb.run is None
    assert not (wandb_offline.dir / "wandb").exists()


def test_a_standalone_evaluate_is_a_run_of_its_own(wandb_offline):
    cb = WandbCallback(project="hapi-test", dir=str(wandb_offline.dir))
    model = attach(cb, log_freq=2, epochs=None)  # evaluate()'s params
    cb.on_eval_begin({"steps": 2, "metrics": ["loss"]})
    cb.on_eval_end({"loss": 0.5})
    attach(cb, model, log_freq=2)
    fit_two_epochs(cb, model)
    as_evaluate(cb)
    cb.on_eval_begin({"steps": 2, "metrics": ["loss"]})
    cb.on_eval_end({"loss": 0.25})
    assert cb.run is None
    first, fit, last = wandb_offline.runs()
    assert first.history == [{"epoch": 0, "train/step": 0, "eval/loss": 0.5}]
    assert len(fit.history) == 6
    # after the fit's 2 epochs (8 batches): plotted after the fit's last evaluation (epoch 1)
    assert last.history == [{"epoch": 2, "train/step": 8, "eval/loss": 0.25}]
    assert [r.exit_code for r in (first, fit, last)] == [0, 0, 0]


class _Boom(Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            raise RuntimeError("boom")


def _fit(model, *cbs):
    return model.fit(make_tiny_data(16), batch_size=8, epochs=3, verbose=0, callbacks=list(cbs))


def test_a_fit_that_raises_leaves_no_open_run_to_the_next_one(wandb_offline):
    import wandb

    torch.manual_seed(0)
    model = Model(TinyNet())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.CrossEntropyLoss())
    failed = WandbCallback(project="hapi-test", name="failed", dir=str(wandb_offline.dir))
    with pytest.raises(RuntimeError, match="boom"):
        _fit(model, failed, _Boom())
    assert wandb.run is not None and failed.run is wandb.run  # no hook told the callback
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not taken over as the user's own run
        _fit(model, WandbCallback(project="hapi-test", name="next", dir=str(wandb_offline.dir)))
    assert wandb.run is None and failed.run is None
    first, second = wandb_offline.runs()
    assert (first.run.display_name, first.exit_code) == ("failed", 1)
    assert [row["train/step"] for row in first.history] == [2, 4]
    assert (second.run.display_name, second.exit_code) == ("next", 0)
    assert [row["train/step"] for row in second.history] == [2, 4, 6]


def test_a_run_left_open_by_a_raise_is_finished_as_failed_at_exit(wandb_offline):
    import wandb

    cb = WandbCallback(project="hapi-test", dir=str(wandb_offline.dir))
    attach(cb)
    cb.on_train_begin()
    cb.on_epoch_begin(0)
    cb.on_train_batch_begin(0)
    cb.on_train_batch_end(0, {"batch_size": 8, "loss": 1.0})
    callbacks.wandb._finish_open_runs()  # what atexit runs
    assert wandb.run is None
    (run,) = wandb_offline.runs()
    assert run.exit_code == 1


def test_an_active_run_of_the_user_is_logged_into_and_left_open(wandb_offline):
    import wandb

    user_run = wandb.init(project="hapi-test", name="mine", dir=str(wandb_offline.dir))
    try:
        cb = WandbCallback(project="ignored")
        model = attach(cb, log_freq=2)
        with pytest.warns(UserWarning, match="already active.*wandb.finish"):
            fit_two_epochs(cb, model)
        assert wandb.run is user_run and cb.run is None
        user_run.log({"test/acc": 0.5})  # the user carries on with their run
    finally:
        user_run.finish()
    (run,) = wandb_offline.runs()
    assert run.run.display_name == "mine"
    assert len(run.history) == 7 and run.history[-1] == {"test/acc": 0.5}
    assert run.exit_code == 0


def test_other_keywords_reach_wandb_init(wandb_offline):
    cb = WandbCallback(
        project="hapi-test",
        dir=str(wandb_offline.dir),
        config={"lr": 0.1, "epochs": 2},
        tags=["smoke"],
        group="g1",
    )
    fit_two_epochs(cb, attach(cb, log_freq=2))
    run = wandb_offline.runs()[0].run
    config = {item.key: item.value_json for item in run.config.update}
    assert (config["lr"], config["epochs"]) == ("0.1", "2")
    assert (list(run.tags), run.run_group) == (["smoke"], "g1")


def test_the_open_run_registry_is_empty_after_each_fit(wandb_offline):
    cb = WandbCallback(project="hapi-test", dir=str(wandb_offline.dir))
    fit_two_epochs(cb, attach(cb, log_freq=2))
    assert callbacks.wandb._OPEN == []


def test_under_torchrun_only_rank_0_starts_a_run(wandb_offline):
    script = WORKER.parent / "wandb_script.py"
    out = wandb_offline.dir
    torchrun(["--standalone", "--nproc_per_node=2", str(script), str(out)], timeout=240)
    ranks = read_ranks(out, "wandb", 2)
    assert [r["imported_wandb"] for r in ranks] == [True, False]  # rank 1 never imports it
    assert [r["held_run"] for r in ranks] == [True, False]
    (run,) = wandb_offline.runs()  # one run, rank 0's
    assert run.exit_code == 0
    train = [row for row in run.history if "train/loss" in row]
    # 32 samples on 2 processes at 8 each: 2 batches per epoch, figures every batch.
    assert [row["train/step"] for row in train] == [1, 2, 3, 4]
    evals = [row for row in run.history if "eval/loss" in row]
    assert [row["eval/loss"] for row in evals] == pytest.approx(ranks[0]["history"]["val_loss"])


def test_an_evaluation_inside_a_batch_is_plotted_at_that_batch(wandb_offline):
    # fit(eval_steps=N) evaluates after a step's update, before its on_train_batch_end.
    cb = WandbCallback(project="hapi-test", dir=str(wandb_offline.dir))
    attach(cb, eval_steps=2)
    cb.on_train_begin()
    cb.on_epoch_begin(0)
    for step in range(2):
        cb.on_train_batch_begin(step)
        if step == 1:
            cb.on_eval_begin({"steps": 1})
            cb.on_eval_end({"loss": 0.5})
        cb.on_train_batch_end(step, {"batch_size": 8, "loss": 1.0})
    cb.on_train_end()
    (run,) = wandb_offline.runs()
    assert [row["train/step"] for row in run.history] == [1, 2, 2]
    assert run.history[1] == {"epoch": 0, "train/step": 2, "eval/loss": 0.5}


def test_no_optimizer_means_no_lr(wandb_offline):
    cb = WandbCallback(project="hapi-test", dir=str(wandb_offline.dir))
    attach(cb).optimizer = None
    cb.on_train_begin()
    cb.on_train_batch_begin(0)
    cb.on_train_batch_end(0, {"batch_size": 8, "loss": 2.0})
    cb.on_train_end()
    (run,) = wandb_offline.runs()
    assert run.history == [{"train/step": 1, "train/loss": 2.0}]


def test_mode_disabled_trains_and_writes_nothing(wandb_offline):
    import wandb

    cb = WandbCallback(project="hapi-test", dir=str(wandb_offline.dir), mode="disabled")
    fit_two_epochs(cb, attach(cb, log_freq=2))
    assert cb.run is None and wandb.run is None
    assert not (wandb_offline.dir / "wandb").exists()


def test_an_evaluate_after_a_fit_that_raised_is_a_run_of_its_own(wandb_offline):
    torch.manual_seed(0)
    model = Model(TinyNet())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.CrossEntropyLoss())
    cb = WandbCallback(project="hapi-test", dir=str(wandb_offline.dir))
    with pytest.raises(RuntimeError, match="boom"):
        _fit(model, cb, _Boom())
    logs = model.evaluate(make_tiny_data(16, seed=1), batch_size=8, verbose=0, callbacks=[cb])
    # Both epochs ran (the second raised in on_epoch_end, after this callback saw it).
    failed, evaluation = wandb_offline.runs()
    assert failed.exit_code == 1
    assert evaluation.history == [
        {"epoch": 2, "train/step": 4, "eval/loss": pytest.approx(logs["loss"])}
    ]
    assert evaluation.exit_code == 0
