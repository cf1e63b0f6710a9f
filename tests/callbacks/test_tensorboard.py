"""TensorBoard: the same scalars as VisualDL for the same run, read back from the event file."""

from __future__ import annotations

import importlib
import os
import re
import sys

import pytest
import torch
from conftest import TinyNet, make_tiny_data
from stub import attach
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from visualdl import LogReader

import callbacks
from callbacks import TensorBoard, VisualDL
from hapi import Model
from hapi.metrics import Accuracy

INSTALL_HINT = 'pip install "torch-hapi[tensorboard]"'


def event_files(log_dir):
    return sorted(f for f in os.listdir(log_dir) if f.startswith("events.out.tfevents."))


def tensorboard_scalars(log_dir):
    """{tag: [(step, value), ...]} in write order, as TensorBoard's own reader sees them."""
    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return {
        tag: [(e.step, e.value) for e in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


def visualdl_scalars(log_dir):
    """{tag: [(step, value), ...]} in write order from the one vdlrecords file."""
    (record,) = [f for f in os.listdir(log_dir) if f.startswith("vdlrecords")]
    reader = LogReader(file_path=os.path.join(log_dir, record))
    return {
        tag: [(r.id, r.value) for r in reader.get_data("scalar", tag)]
        for tag in reader.get_tags()["scalar"]
    }


def test_fit_and_evaluate_write_visualdls_scalars_to_one_event_file(tmp_path):
    torch.manual_seed(0)
    model = Model(TinyNet())
    model.prepare(
        torch.optim.SGD(model.parameters(), lr=0.05), nn.CrossEntropyLoss(), Accuracy(topk=(1, 2))
    )
    data = make_tiny_data(60)  # batch_size=10: 6 steps per epoch; log_freq=4 logs steps 4 and 6
    visualdl, board = VisualDL(tmp_path / "vdl"), TensorBoard(tmp_path / "tb")
    try:
        model.fit(
            data,
            eval_data=data,
            batch_size=10,
            epochs=2,
            log_freq=4,
            verbose=0,
            callbacks=[visualdl, board],
        )
        # The run's own directory, named as VisualDL names it.
        assert board.run_dir == str(tmp_path / "tb" / "version_0")
        assert visualdl.run_dir == str(tmp_path / "vdl" / "version_0")
        # Flushed, not closed, when fit returns: readable now, and evaluate appends to it.
        (after_fit,) = event_files(board.run_dir)
        assert tensorboard_scalars(board.run_dir)["eval/loss"][-1][0] == 1

        model.evaluate(data, verbose=0, callbacks=[visualdl, board])
        assert event_files(board.run_dir) == [after_fit]
        scalars = tensorboard_scalars(board.run_dir)
    finally:
        board.close()
        visualdl.close()

    assert set(scalars) == {
        "train/loss",
        "train/acc_top1",
        "train/acc_top2",
        "train/lr",
        "eval/loss",
        "eval/acc_top1",
        "eval/acc_top2",
    }
    assert scalars == visualdl_scalars(visualdl.run_dir)  # same tags, steps and (float32) values
    assert [step for step, _ in scalars["train/loss"]] == [4, 6, 10, 12]  # global batch numbers
    assert [value for _, value in scalars["train/lr"]] == pytest.approx([0.05] * 4)
    # epoch index during fit (0, 1), then the standalone evaluation after them (2)
    assert [step for step, _ in scalars["eval/acc_top1"]] == [0, 1, 2]


def test_rank_1_creates_no_file_or_directory(tmp_path):
    board = TensorBoard(tmp_path / "tb")
    attach(board, rank=1)
    board.on_train_begin()
    board.on_epoch_begin(0)
    board.on_train_batch_begin(0)
    board.on_train_batch_end(0, {"batch_size": 8, "loss": 1.0, "acc": 0.5})
    board.on_eval_end({"loss": 0.9})
    board.on_epoch_end(0, {"loss": 1.0, "val_loss": 0.9})
    board.on_train_end()
    board.on_eval_end({"loss": 0.8})  # a standalone evaluate
    board.close()
    assert os.listdir(tmp_path) == []
    assert board.train_step == 1  # counts still advance, so a resumed rank agrees with rank 0


def test_missing_tensorboard_is_an_import_error_naming_the_extra(tmp_path, monkeypatch):
    # sys.modules[name] = None makes `import name` fail; dropping torch.utils.tensorboard
    # makes the constructor run torch's real `import tensorboard`, as on a bare install.
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    for name in [n for n in sys.modules if n.split(".")[:3] == ["torch", "utils", "tensorboard"]]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ImportError, match=re.escape(INSTALL_HINT)):
        TensorBoard(tmp_path / "tb")
    assert os.listdir(tmp_path) == []


def test_importing_callbacks_needs_no_tensorboard(monkeypatch):
    # Any import of a None entry raises ImportError, so importing the package afresh
    # proves that `import callbacks` neither needs tensorboard nor pays for loading it.
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    monkeypatch.delitem(sys.modules, "callbacks")
    monkeypatch.delitem(sys.modules, "callbacks.tensorboard")
    fresh = importlib.import_module("callbacks")
    assert fresh is not callbacks and "TensorBoard" in fresh.__all__
    assert fresh.TensorBoard is not TensorBoard  # defined anew, with tensorboard unavailable


def test_log_dir_must_be_a_path():
    with pytest.raises(
        TypeError, match=r"TensorBoard: log_dir must be a directory path .*received 5"
    ):
        TensorBoard(5)


def write_one_point(board, value):
    attach(board)
    board.on_train_begin()
    board.on_epoch_begin(0)
    board.on_train_batch_begin(0)
    board.on_train_batch_end(0, {"batch_size": 8, "loss": value})
    board.on_train_end()
    board.close()


def test_tensorboard_shows_each_run_under_log_dir_as_its_own_run(tmp_path):
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    first, second = TensorBoard(tmp_path / "tb"), TensorBoard(tmp_path / "tb")
    write_one_point(first, 1.0)
    write_one_point(second, 2.0)
    # what `tensorboard --logdir tmp_path/tb` loads: one run per subdirectory
    runs = EventMultiplexer().AddRunsFromDirectory(str(tmp_path / "tb"))
    runs.Reload()
    assert sorted(runs.Runs()) == ["version_0", "version_1"]
    assert [e.value for e in runs.Scalars("version_1", "train/loss")] == [2.0]
    assert second.run_dir == str(tmp_path / "tb" / "version_1")


def test_version_none_writes_the_event_file_into_log_dir(tmp_path):
    board = TensorBoard(tmp_path / "tb", version=None)
    assert board.run_dir == str(tmp_path / "tb")
    write_one_point(board, 1.0)
    assert len(event_files(tmp_path / "tb")) == 1
    assert tensorboard_scalars(tmp_path / "tb")["train/loss"] == [(1, 1.0)]


def test_a_resumed_tensorboard_run_keeps_its_directory(tmp_path):
    crashed = TensorBoard(tmp_path / "tb", version="auto")
    write_one_point(crashed, 1.0)
    write_one_point(TensorBoard(tmp_path / "tb"), 5.0)  # another run meanwhile: version_1
    resumed = TensorBoard(tmp_path / "tb")
    resumed.load_state_dict(crashed.state_dict())
    write_one_point(resumed, 2.0)
    assert resumed.run_dir == crashed.run_dir == str(tmp_path / "tb" / "version_0")
    assert sorted(os.listdir(tmp_path / "tb")) == ["version_0", "version_1"]


def test_bad_version():
    with pytest.raises(ValueError, match=r"TensorBoard: version='\.\.' must name a subdirectory"):
        TensorBoard("tb", version="..")


@pytest.mark.parametrize(
    "accumulate, batches, optimizer_steps",
    [
        (1, [2, 4, 5, 6, 8, 10], [2, 4, 5, 6, 8, 10]),
        # updates after batches 2, 4, 5 (short last group) | 7, 9, 10: the x stays the batch number
        (2, [4, 5, 7, 10], [2, 3, 4, 6]),
    ],
)
def test_fit_with_eval_steps_plots_each_evaluation_at_its_global_batch(
    tmp_path, accumulate, batches, optimizer_steps
):
    torch.manual_seed(0)
    model = Model(TinyNet())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.05), nn.CrossEntropyLoss())
    visualdl, board = VisualDL(tmp_path / "vdl"), TensorBoard(tmp_path / "tb")
    try:
        # 2 epochs of 5 batches, an evaluation every 2 optimizer steps and at each epoch end;
        # the fit loop skips the mid-epoch one at an epoch's last step (the epoch-end one follows).
        history = model.fit(
            make_tiny_data(50),
            eval_data=make_tiny_data(20, seed=1),
            batch_size=10,
            epochs=2,
            eval_steps=2,
            log_freq=1,
            verbose=0,
            accumulate_grad_batches=accumulate,
            callbacks=[visualdl, board],
        )
        model.evaluate(make_tiny_data(20, seed=1), verbose=0, callbacks=[visualdl, board])
        scalars = tensorboard_scalars(board.run_dir)
    finally:
        board.close()
        visualdl.close()
    assert [e["step"] for e in history.evaluations] == optimizer_steps
    eval_loss = scalars["eval/loss"]
    # every evaluation at its own x (none overwritten), then the standalone one after the last batch
    assert [x for x, _ in eval_loss] == batches + [11]
    assert [v for _, v in eval_loss[:-1]] == [
        pytest.approx(e["loss"], rel=1e-6) for e in history.evaluations
    ]
    assert [x for x, _ in scalars["train/loss"]] == list(
        range(1, 11)
    )  # the same axis: batch numbers
    assert scalars == visualdl_scalars(visualdl.run_dir)  # the two dashboards agree
