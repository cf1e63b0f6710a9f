"""CSVLogger: the rows and columns a user reads back from the file."""

import csv
import os

import pytest
from stub import attach

from callbacks.csv_logger import CSVLogger


def read_csv(path, separator=","):
    with open(path, newline="") as handle:
        rows = list(csv.reader(handle, delimiter=separator))
    return rows[0], rows[1:]


def fit(cb, epoch_logs):
    cb.on_train_begin()
    for epoch, logs in enumerate(epoch_logs):
        cb.on_epoch_begin(epoch)
        cb.on_epoch_end(epoch, logs)
    cb.on_train_end(epoch_logs[-1] if epoch_logs else {})


def test_one_row_per_epoch_with_sorted_columns(tmp_path):
    path = tmp_path / "log" / "train.csv"
    cb = CSVLogger(path)
    attach(cb)
    fit(cb, [{"loss": 1.5, "acc": 0.25}, {"loss": 0.75, "acc": 0.5}])
    header, rows = read_csv(path)
    assert header == ["epoch", "acc", "loss"]
    assert rows == [["0", "0.25", "1.5"], ["1", "0.5", "0.75"]]


def test_a_key_that_appears_later_gets_a_column_and_empty_cells(tmp_path):
    path = tmp_path / "train.csv"
    cb = CSVLogger(path)
    attach(cb)
    cb.on_train_begin()
    cb.on_epoch_end(0, {"loss": 1.0, "val_loss": 2.0})  # eval_freq=2: val_* on epochs 0, 2
    header, rows = read_csv(path)
    assert header == ["epoch", "loss", "val_loss"] and rows == [
        ["0", "1.0", "2.0"]
    ]  # complete after each epoch
    cb.on_epoch_end(1, {"loss": 0.5})
    cb.on_epoch_end(2, {"loss": 0.25, "val_loss": 1.0, "val_acc": 0.5})
    header, rows = read_csv(path)
    assert header == ["epoch", "loss", "val_acc", "val_loss"]
    assert rows == [["0", "1.0", "", "2.0"], ["1", "0.5", "", ""], ["2", "0.25", "0.5", "1.0"]]
    assert os.listdir(tmp_path) == ["train.csv"]  # no temporary file left behind


def test_append_keeps_the_rows_of_an_earlier_run(tmp_path):
    path = tmp_path / "train.csv"
    first = CSVLogger(path)
    attach(first)
    fit(first, [{"loss": 1.0}, {"loss": 0.5}])
    resumed = CSVLogger(path, append=True)
    attach(resumed)
    fit(resumed, [{"loss": 0.25, "val_loss": 0.3}])
    header, rows = read_csv(path)
    assert header == ["epoch", "loss", "val_loss"]
    assert rows == [["0", "1.0", ""], ["1", "0.5", ""], ["0", "0.25", "0.3"]]


def test_append_without_an_existing_file_starts_one(tmp_path):
    path = tmp_path / "new.csv"
    cb = CSVLogger(path, append=True)
    attach(cb)
    fit(cb, [{"loss": 1.0}])
    assert read_csv(path) == (["epoch", "loss"], [["0", "1.0"]])


def test_without_append_a_new_fit_replaces_the_file(tmp_path):
    path = tmp_path / "train.csv"
    cb = CSVLogger(path)
    attach(cb)
    fit(cb, [{"loss": 1.0}, {"loss": 0.5}])
    fit(cb, [{"loss": 0.1}])
    assert read_csv(path) == (["epoch", "loss"], [["0", "0.1"]])


def test_custom_separator(tmp_path):
    path = tmp_path / "train.tsv"
    cb = CSVLogger(str(path), separator="\t")
    attach(cb)
    fit(cb, [{"loss": 1.0, "acc": 0.5}])
    assert path.read_bytes() == b"epoch\tacc\tloss\n0\t0.5\t1.0\n"
    resumed = CSVLogger(str(path), separator="\t", append=True)
    attach(resumed)
    fit(resumed, [{"loss": 0.5, "acc": 0.75}])
    assert read_csv(path, "\t") == (
        ["epoch", "acc", "loss"],
        [["0", "0.5", "1.0"], ["0", "0.75", "0.5"]],
    )


def test_rank_1_writes_nothing(tmp_path):
    path = tmp_path / "train.csv"
    path.write_text("epoch,loss\n0,9.0\n")
    cb = CSVLogger(path, append=True)
    attach(cb, rank=1)
    fit(cb, [{"loss": 1.0}, {"loss": 0.5}])
    assert path.read_text() == "epoch,loss\n0,9.0\n"
    assert os.listdir(tmp_path) == ["train.csv"]


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match=r"filename must be a file path .*received 3"):
        CSVLogger(3)
    with pytest.raises(ValueError, match=r"separator must be a single character; received ';;'"):
        CSVLogger("x.csv", separator=";;")
