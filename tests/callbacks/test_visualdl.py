"""VisualDL: scalars read back with visualdl.LogReader, tags, values and steps."""

import importlib.util
import os
import sys

import pytest
from stub import as_evaluate, attach
from visualdl import LogReader

import callbacks.visualdl
from callbacks.visualdl import VisualDL


def read_scalars(log_dir):
    """{tag: [(step, value), ...]} over every vdlrecords file in log_dir."""
    files = [f for f in os.listdir(log_dir) if f.startswith("vdlrecords")]
    assert files, f"no vdlrecords file in {log_dir}: {os.listdir(log_dir)}"
    scalars = {}
    for name in files:
        reader = LogReader(file_path=os.path.join(log_dir, name))
        for tag in reader.get_tags().get("scalar", []):
            records = reader.get_data("scalar", tag)
            scalars.setdefault(tag, []).extend((r.id, r.value) for r in records)
    return {tag: sorted(points) for tag, points in scalars.items()}


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
                logs.update(loss=10.0 * epoch + step, acc=0.1 * step, step=float(step))
            cb.on_train_batch_end(step, logs)
        model.optimizer.param_groups[0]["lr"] = 0.05  # e.g. a scheduler stepped
        cb.on_eval_begin({"steps": 2, "metrics": ["loss", "acc"]})
        cb.on_eval_end({"loss": 1.0 - 0.5 * epoch, "acc": 0.7 + 0.1 * epoch})
        cb.on_epoch_end(epoch, {"loss": 1.0, "acc": 0.5, "val_loss": 1.0, "val_acc": 0.7})
    cb.on_train_end()


def test_fit_writes_train_eval_and_lr_scalars(tmp_path):
    log_dir = tmp_path / "runs"
    cb = VisualDL(str(log_dir))
    model = attach(cb, log_freq=2)
    fit_two_epochs(cb, model)
    assert cb.run_dir == str(log_dir / "version_0")  # the first run under log_dir
    scalars = read_scalars(cb.run_dir)
    assert set(scalars) == {"train/loss", "train/acc", "train/lr", "eval/loss", "eval/acc"}
    # global batch numbers, 1-based, across epochs
    assert scalars["train/loss"] == [(2, 1.0), (4, 3.0), (6, 11.0), (8, 13.0)]
    assert [s for s, _ in scalars["train/acc"]] == [2, 4, 6, 8]
    assert scalars["train/acc"][1][1] == pytest.approx(0.3)
    assert [(s, pytest.approx(v)) for s, v in scalars["train/lr"]] == [
        (2, 0.1),
        (4, 0.1),
        (6, 0.05),
        (8, 0.05),
    ]
    # one point per evaluation, at the epoch index
    assert scalars["eval/loss"] == [(0, 1.0), (1, 0.5)]
    assert [(s, pytest.approx(v)) for s, v in scalars["eval/acc"]] == [(0, 0.7), (1, 0.8)]


def test_no_optimizer_means_no_lr_scalar(tmp_path):
    cb = VisualDL(tmp_path / "runs")
    model = attach(cb)
    model.optimizer = None
    cb.on_train_begin()
    cb.on_epoch_begin(0)
    cb.on_train_batch_begin(0)
    cb.on_train_batch_end(0, {"batch_size": 8, "loss": 2.0})
    cb.on_train_end()
    assert read_scalars(cb.run_dir) == {"train/loss": [(1, 2.0)]}


def test_standalone_evaluate_counts_evaluations_and_flushes_the_file(tmp_path):
    log_dir = tmp_path / "eval_runs"
    cb = VisualDL(log_dir)
    attach(cb, epochs=None)  # evaluate()'s params
    for i in range(2):
        cb.on_eval_begin({"steps": 1, "metrics": ["loss"]})
        cb.on_eval_batch_end(0, {"batch_size": 8, "loss": 9.0})
        cb.on_eval_end({"loss": 0.25 * (i + 1)})
        # readable right away: the writer was flushed at the end of evaluate
        assert read_scalars(cb.run_dir)["eval/loss"][-1] == (i + 1, 0.25 * (i + 1))
    assert read_scalars(cb.run_dir) == {"eval/loss": [(1, 0.25), (2, 0.5)]}
    assert os.listdir(log_dir) == ["version_0"]  # one callback, one run directory


def test_evaluate_after_fit_is_plotted_after_the_epochs_and_resumes_there(tmp_path):
    cb = VisualDL(tmp_path / "runs")
    model = attach(cb, log_freq=2)
    fit_two_epochs(cb, model)  # evaluations at epochs 0 and 1
    as_evaluate(cb)
    cb.on_eval_begin({"steps": 1, "metrics": ["loss"]})
    cb.on_eval_end({"loss": 0.1})
    assert [step for step, _ in read_scalars(cb.run_dir)["eval/loss"]] == [0, 1, 2]
    restored = VisualDL(tmp_path / "other")
    restored.load_state_dict(cb.state_dict())  # e.g. BackupAndRestore after a crash
    assert restored.next_eval_step == 3 and restored.train_step == 8
    cb.close()


def test_rank_1_creates_no_file_or_directory(tmp_path):
    log_dir = tmp_path / "runs"
    cb = VisualDL(log_dir)
    model = attach(cb, rank=1)
    fit_two_epochs(cb, model)
    cb.on_eval_end({"loss": 1.0})
    assert not log_dir.exists()
    assert os.listdir(tmp_path) == []


def test_nothing_is_created_before_the_first_write(tmp_path):
    cb = VisualDL(tmp_path / "runs")
    attach(cb)
    cb.on_train_begin()
    cb.on_epoch_begin(0)
    cb.on_train_batch_begin(0)
    cb.on_train_batch_end(0, {"batch_size": 8})  # a step without figures
    assert not (tmp_path / "runs").exists()
    cb.on_train_end()
    assert not (tmp_path / "runs").exists()


def test_visualdl_is_imported_only_on_the_first_write(tmp_path, monkeypatch):
    # With sys.modules["visualdl"] = None any `import visualdl` raises ImportError,
    # so loading the module, building the callback and a step without figures
    # prove that none of them imports it (importing it costs ~0.4 s).
    monkeypatch.setitem(sys.modules, "visualdl", None)
    spec = importlib.util.spec_from_file_location(
        "callbacks._fresh_visualdl_cb", callbacks.visualdl.__file__
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cb = module.VisualDL(tmp_path / "runs")
    attach(cb)
    cb.on_train_begin()
    cb.on_epoch_begin(0)
    cb.on_train_batch_begin(0)
    cb.on_train_batch_end(0, {"batch_size": 8})
    with pytest.raises(ImportError):
        cb.on_train_batch_begin(1)
        cb.on_train_batch_end(1, {"batch_size": 8, "loss": 1.0})


def test_log_dir_must_be_a_path():
    with pytest.raises(TypeError, match=r"log_dir must be a directory path .*received 5"):
        VisualDL(5)


@pytest.mark.parametrize("rank", [0, 1])
def test_of_two_processes_only_rank_0_opens_a_writer(tmp_path, monkeypatch, rank):
    # Record files are named after the second they are opened in, so "one file" alone
    # cannot tell whether rank 1 also wrote: count the writers each rank builds.
    import visualdl

    opened = []

    class CountingLogWriter(visualdl.LogWriter):
        def __init__(self, *args, **kwargs):
            opened.append(kwargs.get("logdir"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(visualdl, "LogWriter", CountingLogWriter)
    log_dir = tmp_path / "runs"
    cb = VisualDL(log_dir)
    model = attach(cb, rank=rank, world_size=2, log_freq=2)
    fit_two_epochs(cb, model)
    as_evaluate(cb)
    cb.on_eval_begin({"steps": 1, "metrics": ["loss"]})  # then a standalone evaluate
    cb.on_eval_end({"loss": 0.1})
    cb.close()
    if rank == 0:
        assert opened == [str(log_dir / "version_0")]
        assert read_scalars(cb.run_dir)["eval/loss"] == [
            (0, 1.0),
            (1, 0.5),
            (2, pytest.approx(0.1)),
        ]
    else:
        assert opened == []
        assert os.listdir(tmp_path) == []


# -- one directory per run --------------------------------------------------------------------------


def write_one_point(cb, value=1.0):
    cb.on_train_begin()
    cb.on_epoch_begin(0)
    cb.on_train_batch_begin(0)
    cb.on_train_batch_end(0, {"batch_size": 8, "loss": value})
    cb.on_train_end()


def test_each_run_gets_the_next_version_directory(tmp_path):
    log_dir = tmp_path / "runs"
    first, second = VisualDL(log_dir), VisualDL(log_dir)
    attach(first), attach(second)
    assert first.run_dir is None  # not chosen before the first write
    write_one_point(first, 1.0)
    write_one_point(second, 2.0)
    assert (first.run_dir, second.run_dir) == (
        str(log_dir / "version_0"),
        str(log_dir / "version_1"),
    )
    # each run is its own curve: neither file hides the other
    assert read_scalars(first.run_dir)["train/loss"] == [(1, 1.0)]
    assert read_scalars(second.run_dir)["train/loss"] == [(1, 2.0)]
    # numbers follow the order runs started in: after the largest, even with gaps or other entries
    (log_dir / "version_0").rename(log_dir / "old")
    (log_dir / "version_7").mkdir()
    (log_dir / "version_9.txt").write_text("not a run")
    third = VisualDL(log_dir)
    attach(third)
    write_one_point(third)
    assert third.run_dir == str(log_dir / "version_8")
    for cb in (first, second, third):
        cb.close()


def test_a_run_keeps_its_directory_across_fit_evaluate_and_close(tmp_path):
    cb = VisualDL(tmp_path / "runs")
    attach(cb)
    write_one_point(cb)
    as_evaluate(cb)
    cb.on_eval_end({"loss": 0.5})  # a standalone evaluate
    cb.close()
    attach(cb)
    write_one_point(cb)  # a later fit with the same callback object
    cb.close()
    assert os.listdir(tmp_path / "runs") == ["version_0"]
    scalars = read_scalars(cb.run_dir)
    assert (scalars["train/loss"], scalars["eval/loss"]) == ([(1, 1.0), (2, 1.0)], [(1, 0.5)])


def test_version_none_writes_into_log_dir_itself(tmp_path):
    log_dir = tmp_path / "runs"
    for version in (None, False):
        cb = VisualDL(log_dir, version=version)
        assert cb.run_dir == str(log_dir)  # known before any write
        attach(cb)
        write_one_point(cb)
        cb.close()
    assert [p.name for p in log_dir.iterdir() if p.is_dir()] == []
    assert read_scalars(log_dir)["train/loss"] == [(1, 1.0), (1, 1.0)]


@pytest.mark.parametrize(
    "version, name",
    [(3, "version_3"), ("baseline", "baseline"), ("lr1e-3/seed0", os.path.join("lr1e-3", "seed0"))],
)
def test_a_named_version_is_that_subdirectory(tmp_path, version, name):
    cb = VisualDL(tmp_path / "runs", version=version)
    assert cb.run_dir == os.path.join(tmp_path / "runs", name)
    attach(cb)
    cb.on_train_begin()
    assert not (tmp_path / "runs").exists()  # still nothing before the first write
    write_one_point(cb)
    cb.close()
    assert read_scalars(cb.run_dir)["train/loss"] == [(1, 1.0)]


def test_two_runs_choosing_at_the_same_moment_get_different_numbers(tmp_path, monkeypatch):
    # Both listed an empty log_dir; the other run created version_0 first.
    log_dir = tmp_path / "runs"
    (log_dir / "version_0").mkdir(parents=True)
    real_listdir, stale = os.listdir, [[]]
    monkeypatch.setattr(
        callbacks.visualdl.os, "listdir", lambda path: stale.pop() if stale else real_listdir(path)
    )
    cb = VisualDL(log_dir)
    attach(cb)
    write_one_point(cb)
    cb.close()
    assert cb.run_dir == str(log_dir / "version_1")
    assert os.listdir(log_dir / "version_0") == []  # the other run's directory is untouched


def test_a_resumed_run_keeps_writing_into_its_version(tmp_path):
    log_dir = tmp_path / "runs"
    crashed = VisualDL(log_dir)
    attach(crashed)
    write_one_point(crashed, 1.0)
    state = crashed.state_dict()
    crashed.close()
    other = VisualDL(log_dir)  # another run started meanwhile and took version_1
    attach(other)
    write_one_point(other)
    other.close()

    resumed = VisualDL(log_dir)
    attach(resumed)
    resumed.load_state_dict(state)  # what BackupAndRestore does in on_train_begin
    write_one_point(resumed, 2.0)
    resumed.close()
    assert resumed.run_dir == str(log_dir / "version_0")
    assert sorted(os.listdir(log_dir)) == ["version_0", "version_1"]
    assert read_scalars(resumed.run_dir)["train/loss"] == [(1, 1.0), (2, 2.0)]


def test_a_checkpoint_before_the_first_write_fixes_the_version(tmp_path):
    # A backup every few steps can come before any figure was written: the run's
    # directory is chosen then, so the resumed run writes where this one went on to.
    log_dir = tmp_path / "runs"
    crashed = VisualDL(log_dir)
    attach(crashed)
    state = crashed.state_dict()
    write_one_point(crashed)
    crashed.close()
    resumed = VisualDL(log_dir)
    attach(resumed)
    resumed.load_state_dict(state)
    write_one_point(resumed)
    resumed.close()
    assert os.listdir(log_dir) == ["version_0"]


def test_a_fixed_version_wins_over_the_saved_one_and_old_states_still_load(tmp_path):
    fixed = VisualDL(tmp_path / "runs", version="mine")
    attach(fixed)
    fixed.load_state_dict({"train_step": 4, "next_eval_step": 2, "version": "version_0"})
    assert fixed.run_dir == str(tmp_path / "runs" / "mine")
    auto = VisualDL(tmp_path / "runs")
    auto.load_state_dict({"train_step": 4, "eval_count": 1})  # saved before versions existed
    assert auto.train_step == 4 and auto.run_dir is None


def test_rank_1_chooses_no_version_and_creates_nothing_when_saving_state(tmp_path):
    cb = VisualDL(tmp_path / "runs")
    attach(cb, rank=1)
    assert cb.state_dict()["version"] is None
    assert os.listdir(tmp_path) == []


def test_fit_resumed_by_backup_and_restore_writes_into_the_same_version(tmp_path):
    import torch
    from conftest import TinyNet, make_tiny_data
    from torch import nn

    from callbacks import BackupAndRestore, Callback
    from hapi import Model

    class Crash(Callback):
        def __init__(self, armed):
            super().__init__()
            self.armed = armed

        def on_epoch_begin(self, epoch, logs=None):
            if self.armed and epoch == 1:
                raise KeyboardInterrupt  # dies after epoch 0's backup

    def fit(crash=False):
        torch.manual_seed(0)
        model = Model(TinyNet())
        model.prepare(torch.optim.SGD(model.parameters(), lr=0.05), nn.CrossEntropyLoss())
        board = VisualDL(tmp_path / "runs")
        try:
            model.fit(
                make_tiny_data(40),
                batch_size=10,
                epochs=2,
                log_freq=4,
                verbose=0,
                callbacks=[board, Crash(crash), BackupAndRestore(tmp_path / "backup")],
            )
        finally:
            board.close()
        return board

    with pytest.raises(KeyboardInterrupt):
        fit(crash=True)
    resumed = fit()
    assert os.listdir(tmp_path / "runs") == ["version_0"]
    assert resumed.run_dir == str(tmp_path / "runs" / "version_0")
    assert [step for step, _ in read_scalars(resumed.run_dir)["train/loss"]] == [
        4,
        8,
    ]  # epoch 0, then 1
    fit()  # a new run (the backup was deleted when the resumed one ended): a new version
    assert sorted(os.listdir(tmp_path / "runs")) == ["version_0", "version_1"]


@pytest.mark.parametrize(
    "version, error, match",
    [
        (-1, ValueError, r"version must be a non-negative integer .*received -1"),
        (
            "../elsewhere",
            ValueError,
            r"version='\.\./elsewhere' must name a subdirectory of log_dir",
        ),
        ("/abs", ValueError, r"must name a subdirectory"),
        ("", ValueError, r"must name a subdirectory"),
        (
            1.5,
            TypeError,
            r"version must be 'auto', an int, a subdirectory name \(str\), or None; received 1\.5",
        ),
    ],
)
def test_bad_versions(tmp_path, version, error, match):
    with pytest.raises(error, match=match):
        VisualDL(tmp_path / "runs", version=version)


# -- fit(eval_steps=N): every evaluation at its global batch number ------------------------------------


def fit_with_eval_steps(board, accumulate=1, callbacks=()):
    """2 epochs of 5 batches (batch_size=10), eval_steps=2, figures every batch; returns (model, History)."""
    import torch
    from conftest import TinyNet, make_tiny_data
    from torch import nn

    from hapi import Model

    torch.manual_seed(0)
    model = Model(TinyNet())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.05), nn.CrossEntropyLoss())
    history = model.fit(
        make_tiny_data(50),
        eval_data=make_tiny_data(20, seed=1),
        batch_size=10,
        epochs=2,
        eval_steps=2,
        log_freq=1,
        verbose=0,
        accumulate_grad_batches=accumulate,
        callbacks=[board, *callbacks],
    )
    return model, history


def evaluation_points(history):
    return [pytest.approx(e["loss"], rel=1e-6) for e in history.evaluations]


def test_fit_with_eval_steps_plots_each_evaluation_at_its_batch_on_the_train_axis(tmp_path):
    board = VisualDL(tmp_path / "runs")
    model, history = fit_with_eval_steps(board)
    # Optimizer steps 1..5 in epoch 0, 6..10 in epoch 1 (no accumulation): mid-epoch
    # evaluations after steps 2, 4 | 6, 8; step 10 ends epoch 1, whose epoch-end
    # evaluation follows, so the fit loop skips the mid-epoch one there; epoch ends at 5 and 10.
    assert [e["step"] for e in history.evaluations] == [2, 4, 5, 6, 8, 10]
    scalars = read_scalars(board.run_dir)
    assert [x for x, _ in scalars["eval/loss"]] == [2, 4, 5, 6, 8, 10]  # not 0, 0, 0, 1, 1, 1
    assert [v for _, v in scalars["eval/loss"]] == evaluation_points(history)
    # the same x axis as the training curve: every evaluation sits on a training point
    assert [x for x, _ in scalars["train/loss"]] == list(range(1, 11))
    # a standalone evaluate afterwards goes after the fit's last batch, never backwards
    from conftest import make_tiny_data

    for _ in range(2):
        model.evaluate(make_tiny_data(20, seed=1), verbose=0, callbacks=[board])
    board.close()
    assert [x for x, _ in read_scalars(board.run_dir)["eval/loss"]] == [2, 4, 5, 6, 8, 10, 11, 12]


def test_with_accumulation_evaluations_are_plotted_at_batches_not_optimizer_steps(tmp_path):
    board = VisualDL(tmp_path / "runs")
    _, history = fit_with_eval_steps(board, accumulate=2)
    board.close()
    # Updates after batches 2, 4, 5 (short last group) | 7, 9, 10: optimizer steps 1..6.
    # Evaluations after steps 2 (batch 4), 3 (epoch end, batch 5), 4 (batch 7), 6 (epoch end, batch 10).
    assert [e["step"] for e in history.evaluations] == [2, 3, 4, 6]
    scalars = read_scalars(board.run_dir)
    assert [x for x, _ in scalars["eval/loss"]] == [4, 5, 7, 10]
    assert [v for _, v in scalars["eval/loss"]] == evaluation_points(history)
    assert [x for x, _ in scalars["train/loss"]] == list(range(1, 11))  # one point per batch


def test_a_fit_with_eval_steps_resumed_by_backup_and_restore_plots_as_if_never_stopped(tmp_path):
    from callbacks import BackupAndRestore, Callback

    class Crash(Callback):
        def __init__(self, armed):
            super().__init__()
            self.armed = armed

        def on_epoch_begin(self, epoch, logs=None):
            if self.armed and epoch == 1:
                raise KeyboardInterrupt  # dies after epoch 0's backup

    crashed = VisualDL(tmp_path / "runs")
    with pytest.raises(KeyboardInterrupt):
        try:
            fit_with_eval_steps(
                crashed, callbacks=[Crash(True), BackupAndRestore(tmp_path / "backup")]
            )
        finally:
            crashed.close()
    resumed = VisualDL(tmp_path / "runs")
    try:
        _, history = fit_with_eval_steps(
            resumed, callbacks=[Crash(False), BackupAndRestore(tmp_path / "backup")]
        )
    finally:
        resumed.close()
    assert resumed.run_dir == crashed.run_dir
    scalars = read_scalars(resumed.run_dir)  # both runs' record files
    assert [x for x, _ in scalars["eval/loss"]] == [2, 4, 5, 6, 8, 10]
    assert [v for _, v in scalars["eval/loss"]] == evaluation_points(
        history
    )  # History was restored too
    assert [x for x, _ in scalars["train/loss"]] == list(range(1, 11))
    assert resumed.next_eval_step == 11


def test_eval_steps_in_params_switches_the_eval_x_for_that_fit_only(tmp_path):
    cb = VisualDL(tmp_path / "runs")
    model = attach(cb, log_freq=2, eval_steps=3)
    fit_two_epochs(cb, model)  # evaluations after batches 4 and 8
    attach(cb, model, log_freq=2, eval_steps=None)
    fit_two_epochs(cb, model)  # a later fit without eval_steps: epoch indices again
    cb.close()
    assert [x for x, _ in read_scalars(cb.run_dir)["eval/loss"]] == [0, 1, 4, 8]
    assert cb.train_step == 16 and cb.next_eval_step == 9
