"""verbose=3: Paddle's progress lines plus avg_reader_cost, avg_batch_cost and ips.

A fake clock drives the hooks, so the counters are exact: reader cost is the time
from a batch's end (or the pass's start) to the next batch's begin, batch cost the
time from its begin to its end, ips the samples (times the processes) per second.
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest import TinyNet, make_tiny_data
from torch import nn

from callbacks import CallbackList, ProgBarLogger
from hapi import Model


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    import callbacks.progbar

    fake = FakeClock()
    monkeypatch.setattr(callbacks.progbar, "_clock", fake)
    return fake


def _epoch(bar, clock, steps, *, read=0.002, run=0.010, batch_size=4, world_size=1, rank=0):
    bar.set_params({"epochs": 1, "steps": steps, "rank": rank, "world_size": world_size})
    bar.on_epoch_begin(0)
    for step in range(steps):
        clock.now += read
        bar.on_train_batch_begin(step)
        clock.now += run
        bar.on_train_batch_end(step, {"batch_size": batch_size, "loss": 0.5})
    bar.on_epoch_end(0, {"loss": 0.5})


def test_lines_carry_paddles_time_counters_and_verbose_2_lines_do_not(clock, capsys):
    _epoch(ProgBarLogger(log_freq=1, verbose=3), clock, 2)
    counters = (
        " - avg_reader_cost: 0.00200 sec - avg_batch_cost: 0.01000 sec - ips: 333.33333 samples/sec"
    )
    assert capsys.readouterr().out.splitlines() == [
        "Epoch 1/1",
        f"step 1/2 - loss: 0.5000{counters} - 12ms/step",
        f"step 2/2 - loss: 0.5000{counters} - 12ms/step",
    ]
    _epoch(ProgBarLogger(log_freq=1, verbose=2), clock, 2)  # verbose=2 as before
    assert capsys.readouterr().out.splitlines() == [
        "Epoch 1/1",
        "step 1/2 - loss: 0.5000 - 12ms/step",
        "step 2/2 - loss: 0.5000 - 12ms/step",
    ]


def test_averages_cover_the_pass_so_far(clock, capsys):
    bar = ProgBarLogger(log_freq=2, verbose=3)
    bar.set_params({"epochs": 1, "steps": 2, "rank": 0, "world_size": 1})
    bar.on_epoch_begin(0)
    for step, (read, run) in enumerate([(0.001, 0.003), (0.003, 0.005)]):
        clock.now += read
        bar.on_train_batch_begin(step)
        clock.now += run
        bar.on_train_batch_end(step, {"batch_size": 6, **({"loss": 0.5} if step else {})})
    bar.on_epoch_end(0)
    line = capsys.readouterr().out.splitlines()[1]
    # (0.001 + 0.003) / 2, (0.003 + 0.005) / 2, 12 samples / 0.012 s
    assert "avg_reader_cost: 0.00200 sec - avg_batch_cost: 0.00400 sec - ips: 1000.00000" in line


def test_ips_counts_every_process(clock, capsys):
    _epoch(ProgBarLogger(log_freq=1, verbose=3), clock, 1, world_size=2)
    assert "ips: 666.66667 samples/sec" in capsys.readouterr().out


def test_an_evaluation_inside_a_training_batch_is_not_its_cost(clock, capsys):
    bar = ProgBarLogger(log_freq=1, verbose=3)
    bar.set_params({"epochs": 1, "steps": 1, "rank": 0, "world_size": 1})
    bar.on_epoch_begin(0)
    clock.now += 0.002
    bar.on_train_batch_begin(0)
    clock.now += 0.004
    bar.on_eval_begin({"steps": 1})  # fit(eval_steps=...): before on_train_batch_end
    bar.on_eval_batch_begin(0)
    clock.now += 5.0
    bar.on_eval_batch_end(0, {"batch_size": 4, "loss": 0.5})
    bar.on_eval_end({"loss": 0.5})
    clock.now += 0.006
    bar.on_train_batch_end(0, {"batch_size": 4, "loss": 0.5})
    bar.on_epoch_end(0)
    lines = capsys.readouterr().out.splitlines()
    assert "avg_batch_cost: 5.00000 sec" in lines[2]  # the evaluation's own line
    assert "avg_reader_cost: 0.00200 sec - avg_batch_cost: 0.01000 sec" in lines[-1]


def test_other_ranks_print_nothing(clock, capsys):
    _epoch(ProgBarLogger(log_freq=1, verbose=3), clock, 2, rank=1, world_size=2)
    assert capsys.readouterr().out == ""


def test_only_verbose_3_asks_the_loop_for_batch_begin_calls():
    for verbose in (0, 1, 2):
        quiet = CallbackList([ProgBarLogger(verbose=verbose)])
        assert not quiet.wants("on_train_batch_begin")
        assert not quiet.wants("on_eval_batch_begin")
    timed = CallbackList([ProgBarLogger(verbose=3)])
    assert timed.wants("on_train_batch_begin") and timed.wants("on_eval_batch_begin")


TIMED = re.compile(
    r"^step (\d+)/(\d+) - loss: \d+\.\d{4} - avg_reader_cost: \d+\.\d{5} sec - "
    r"avg_batch_cost: \d+\.\d{5} sec - ips: \d+\.\d{5} samples/sec - \d+(ms|s)/step$"
)


def test_fit_and_evaluate_take_verbose_3(capsys):
    x, y = make_tiny_data(40)
    torch.manual_seed(0)
    model = Model(TinyNet(), device="cpu")
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    model.fit((x, y), eval_data=(x, y), batch_size=10, log_freq=2, verbose=3)
    lines = capsys.readouterr().out.splitlines()
    assert (
        lines[0] == "Epoch 1/1" and lines[3] == "Eval begin..." and lines[-1] == "Eval samples: 40"
    )
    assert [TIMED.match(line).group(1) for line in lines[1:3] + lines[4:6]] == ["2", "4"] * 2
    model.evaluate((x, y), batch_size=10, log_freq=2, verbose=3)
    lines = capsys.readouterr().out.splitlines()
    assert [TIMED.match(line).group(1) for line in lines[1:3]] == ["2", "4"]
