"""VisualDL: scalars read back with visualdl.LogReader, tags, values and steps."""

import importlib.util
import os
import sys

import pytest
from visualdl import LogReader

import callbacks.visualdl
from callbacks.visualdl import VisualDL
from stub import attach


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
    scalars = read_scalars(log_dir)
    assert set(scalars) == {"train/loss", "train/acc", "train/lr", "eval/loss", "eval/acc"}
    # global batch numbers, 1-based, across epochs
    assert scalars["train/loss"] == [(2, 1.0), (4, 3.0), (6, 11.0), (8, 13.0)]
    assert [s for s, _ in scalars["train/acc"]] == [2, 4, 6, 8]
    assert scalars["train/acc"][1][1] == pytest.approx(0.3)
    assert [(s, pytest.approx(v)) for s, v in scalars["train/lr"]] == [(2, 0.1), (4, 0.1), (6, 0.05), (8, 0.05)]
    # one point per evaluation, at the epoch index
    assert scalars["eval/loss"] == [(0, 1.0), (1, 0.5)]
    assert [(s, pytest.approx(v)) for s, v in scalars["eval/acc"]] == [(0, 0.7), (1, 0.8)]


def test_no_optimizer_means_no_lr_scalar(tmp_path):
    cb = VisualDL(tmp_path / "runs")
    model = attach(cb)
    model.optimizer = None
    cb.on_train_begin()
    cb.on_epoch_begin(0)
    cb.on_train_batch_end(0, {"batch_size": 8, "loss": 2.0})
    cb.on_train_end()
    assert read_scalars(tmp_path / "runs") == {"train/loss": [(1, 2.0)]}


def test_standalone_evaluate_counts_evaluations_and_flushes_the_file(tmp_path):
    log_dir = tmp_path / "eval_runs"
    cb = VisualDL(log_dir)
    attach(cb)
    for i in range(2):
        cb.on_eval_begin({"steps": 1, "metrics": ["loss"]})
        cb.on_eval_batch_end(0, {"batch_size": 8, "loss": 9.0})
        cb.on_eval_end({"loss": 0.25 * (i + 1)})
        # readable right away: the writer was flushed at the end of evaluate
        assert read_scalars(log_dir)["eval/loss"][-1] == (i + 1, 0.25 * (i + 1))
    assert read_scalars(log_dir) == {"eval/loss": [(1, 0.25), (2, 0.5)]}


def test_evaluate_after_fit_is_plotted_after_the_epochs_and_resumes_there(tmp_path):
    cb = VisualDL(tmp_path / "runs")
    model = attach(cb, log_freq=2)
    fit_two_epochs(cb, model)  # evaluations at epochs 0 and 1
    cb.on_eval_begin({"steps": 1, "metrics": ["loss"]})
    cb.on_eval_end({"loss": 0.1})
    assert [step for step, _ in read_scalars(tmp_path / "runs")["eval/loss"]] == [0, 1, 2]
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
    cb.on_train_batch_end(0, {"batch_size": 8})  # a step without figures
    assert not (tmp_path / "runs").exists()
    cb.on_train_end()
    assert not (tmp_path / "runs").exists()


def test_visualdl_is_imported_only_on_the_first_write(tmp_path, monkeypatch):
    # With sys.modules["visualdl"] = None any `import visualdl` raises ImportError,
    # so loading the module, building the callback and a step without figures
    # prove that none of them imports it (importing it costs ~0.4 s).
    monkeypatch.setitem(sys.modules, "visualdl", None)
    spec = importlib.util.spec_from_file_location("_fresh_visualdl_cb", callbacks.visualdl.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cb = module.VisualDL(tmp_path / "runs")
    attach(cb)
    cb.on_train_begin()
    cb.on_epoch_begin(0)
    cb.on_train_batch_end(0, {"batch_size": 8})
    with pytest.raises(ImportError):
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
    cb.on_eval_begin({"steps": 1, "metrics": ["loss"]})  # then a standalone evaluate
    cb.on_eval_end({"loss": 0.1})
    cb.close()
    if rank == 0:
        assert opened == [str(log_dir)]
        assert read_scalars(log_dir)["eval/loss"] == [(0, 1.0), (1, 0.5), (2, pytest.approx(0.1))]
    else:
        assert opened == []
        assert os.listdir(tmp_path) == []
