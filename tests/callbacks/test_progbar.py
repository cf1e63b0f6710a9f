"""ProgBarLogger prints what a Paddle user expects, and only on the main process."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from callbacks import ProgBarLogger
from conftest import TinyNet, make_tiny_data
from hapi import Model
from hapi.metrics import Accuracy

LINE = re.compile(r"^step (\d+)/(\d+) - loss: \d+\.\d{4} - acc_top1: \d\.\d{4} - acc_top2: \d\.\d{4} - \d+ms/step$")


def _model():
    torch.manual_seed(0)
    model = Model(TinyNet())
    model.prepare(torch.optim.Adam(model.parameters(), 1e-2), nn.CrossEntropyLoss(), Accuracy(topk=(1, 2)))
    return model


def test_lines_in_paddles_form_every_log_freq_steps_and_the_last(capsys):
    x, y = make_tiny_data(100)
    _model().fit((x, y), eval_data=(x, y), batch_size=10, log_freq=4, verbose=2)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "Epoch 1/1"
    steps = [LINE.match(line) for line in lines[1:4]]
    assert all(steps), lines[1:4]
    assert [(m.group(1), m.group(2)) for m in steps] == [("4", "10"), ("8", "10"), ("10", "10")]
    assert lines[4] == "Eval begin..."
    assert [LINE.match(line).group(1) for line in lines[5:8]] == ["4", "8", "10"]
    assert lines[8:] == ["Eval samples: 100"]


def test_an_epoch_cut_short_by_num_iters_still_shows_its_last_figures(capsys):
    x, y = make_tiny_data(40)  # 4 steps per epoch; num_iters=5 leaves 1 step for epoch 2
    _model().fit((x, y), eval_data=(x, y), batch_size=10, log_freq=4, num_iters=5, verbose=2)
    lines = capsys.readouterr().out.splitlines()
    second = lines.index("Epoch 2/2")
    assert LINE.match(lines[second + 1]).group(1) == "1"  # its only step, before the evaluation
    assert lines[second + 2] == "Eval begin..."


def test_not_a_terminal_prints_lines_even_with_verbose_1(capsys):
    x, y = make_tiny_data(40)
    _model().fit((x, y), batch_size=10, log_freq=2, verbose=1)
    out = capsys.readouterr().out
    assert "step 2/4 - loss:" in out and "step 4/4 - loss:" in out


def test_predict_reports_its_samples(capsys):
    x, y = make_tiny_data(25)
    _model().predict((x, y), batch_size=10, verbose=2)
    assert capsys.readouterr().out.splitlines() == ["Predict begin...", "Predict samples: 25"]


def test_verbose_0_prints_nothing(capsys):
    x, y = make_tiny_data(40)
    model = _model()
    model.fit((x, y), eval_data=(x, y), batch_size=10, verbose=0)
    model.evaluate((x, y), verbose=0)
    model.predict((x, y), verbose=0)
    assert capsys.readouterr().out == ""


def test_other_ranks_print_nothing(capsys):
    bar = ProgBarLogger(log_freq=1, verbose=2)
    bar.set_params({"epochs": 1, "steps": 2, "rank": 1, "world_size": 2})
    bar.on_epoch_begin(0)
    bar.on_train_batch_end(0, {"batch_size": 4, "loss": 1.0})
    bar.on_epoch_end(0, {"loss": 1.0})
    assert capsys.readouterr().out == ""


def test_a_bar_on_a_terminal(monkeypatch, capsys):
    import sys

    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    bar = ProgBarLogger(log_freq=1, verbose=1)
    bar.set_params({"epochs": 1, "steps": 3, "rank": 0, "world_size": 1})
    bar.on_epoch_begin(0)
    for step in range(3):
        bar.on_train_batch_end(step, {"batch_size": 4, "loss": 0.5})
    bar.on_epoch_end(0, {"loss": 0.5})
    out = capsys.readouterr().out
    assert "Epoch 1/1" in out and "3/3" in out and "loss=0.5000" in out
    assert "step 1/3" not in out  # the bar replaces the lines


@pytest.mark.parametrize("kwargs", [{"log_freq": 0}, {"verbose": 3}])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError, match="log_freq|verbose"):
        ProgBarLogger(**kwargs)
