"""ProgBarLogger prints what a Paddle user expects, and only on the main process."""

from __future__ import annotations

import itertools
import re

import pytest
from conftest import make_tiny_data, tiny_model

from callbacks import ProgBarLogger
from hapi.metrics import Accuracy

LINE = re.compile(
    r"^step (\d+)/(\d+) - loss: \d+\.\d{4} - acc_top1: \d\.\d{4} - acc_top2: \d\.\d{4} - \d+ms/step$"
)


def _model():
    return tiny_model(1e-2, Accuracy(topk=(1, 2)), adam=True)


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


@pytest.mark.parametrize("kwargs", [{"log_freq": 0}, {"verbose": 4}])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError, match="log_freq|verbose"):
        ProgBarLogger(**kwargs)


# -- how many lines a pass prints (no sleeping: a fake clock drives paces and intervals) ------------

STEP_LINE = re.compile(r"^step (\d+)(?:/\d+)? - loss: 0\.5000 - (\S+)/step$")


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


def drive_epoch(bar, clock, steps, *, log_freq, seconds_per_step, known_length=True):
    """One training epoch as the loop delivers it: figures every log_freq steps and on the last step."""
    bar.set_params(
        {"epochs": 1, "steps": steps if known_length else None, "rank": 0, "world_size": 1}
    )
    bar.on_epoch_begin(0)
    for step in range(steps):
        clock.now += seconds_per_step
        logs = {"batch_size": 4}
        if (step + 1) % log_freq == 0 or step == steps - 1:
            logs["loss"] = 0.5
        bar.on_train_batch_end(step, logs)
    bar.on_epoch_end(0, {"loss": 0.5})


def printed_steps(out):
    lines = out.splitlines()
    assert lines[0] == "Epoch 1/1", lines[:3]
    matches = [STEP_LINE.match(line) for line in lines[1:]]
    assert all(matches), [line for line, m in zip(lines[1:], matches) if not m][:3]
    return [int(m.group(1)) for m in matches], {m.group(2) for m in matches}


def test_a_100000_step_epoch_prints_one_line_per_percent_not_10000(clock, capsys):
    bar = ProgBarLogger(log_freq=10, verbose=2)  # what fit's defaults give (log_freq=10)
    drive_epoch(bar, clock, 100_000, log_freq=10, seconds_per_step=0.005)
    steps, paces = printed_steps(capsys.readouterr().out)
    # the first figures at once, then the first log_freq step of each new 1%, and the last step
    assert steps == [10] + list(range(1000, 100_001, 1000))
    assert paces == {"5ms"}  # the pace comes from the same (patched) clock


def test_a_slow_thinned_pass_still_prints_a_line_every_interval(clock, capsys):
    # 1% of this epoch is 60 s of steps: thinning alone would leave 60 s between lines
    bar = ProgBarLogger(log_freq=10, verbose=2, interval=15)
    drive_epoch(bar, clock, 6000, log_freq=10, seconds_per_step=1.0)
    steps, _ = printed_steps(capsys.readouterr().out)
    gaps = [b - a for a, b in itertools.pairwise(steps)]
    assert max(gaps) <= 20  # seconds: the interval, rounded up to the next log_freq step
    assert len(steps) < 6000 // 10  # yet fewer than one line per log_freq step


def test_interval_none_leaves_only_the_percent_lines(clock, capsys):
    bar = ProgBarLogger(log_freq=10, verbose=2, interval=None)
    drive_epoch(bar, clock, 6000, log_freq=10, seconds_per_step=1.0)
    steps, _ = printed_steps(capsys.readouterr().out)
    assert steps == [10] + list(range(60, 6001, 60))


def test_a_pass_of_unknown_length_prints_first_last_and_one_line_per_interval(clock, capsys):
    bar = ProgBarLogger(log_freq=10, verbose=2)  # interval=30 s by default
    drive_epoch(bar, clock, 100_000, log_freq=10, seconds_per_step=1 / 256, known_length=False)
    steps, _ = printed_steps(capsys.readouterr().out)
    assert steps[0] == 10 and steps[-1] == 100_000
    assert steps[1:-1] == list(range(10 + 7680, 100_000, 7680))  # 30 s = 7,680 steps of 1/256 s


@pytest.mark.parametrize("known_length", [True, False])
def test_max_lines_none_prints_every_log_freq_step_whatever_the_length(clock, capsys, known_length):
    bar = ProgBarLogger(log_freq=3, verbose=2, max_lines=None, interval=None)
    drive_epoch(bar, clock, 20, log_freq=3, seconds_per_step=0.01, known_length=known_length)
    steps, _ = printed_steps(capsys.readouterr().out)
    assert steps == [3, 6, 9, 12, 15, 18, 20]


@pytest.mark.parametrize(
    "steps, log_freq, expected",
    [
        (25, 10, [10, 20, 25]),  # a short epoch: first, every log_freq, last
        (938, 400, [400, 800, 938]),  # the seeds' explicit log_freq, as Paddle prints it
        (
            938,
            10,
            list(range(10, 931, 10)) + [938],
        ),  # fit's default on the seeds' epoch: all 94 lines
    ],
)
def test_passes_with_at_most_100_log_freq_steps_print_every_one(
    clock, capsys, steps, log_freq, expected
):
    drive_epoch(
        ProgBarLogger(log_freq=log_freq, verbose=2),
        clock,
        steps,
        log_freq=log_freq,
        seconds_per_step=0.005,
    )
    assert printed_steps(capsys.readouterr().out)[0] == expected


def test_max_lines_none_prints_every_log_freq_step(clock, capsys):
    bar = ProgBarLogger(log_freq=10, verbose=2, max_lines=None)
    drive_epoch(bar, clock, 20_000, log_freq=10, seconds_per_step=0.005)
    assert printed_steps(capsys.readouterr().out)[0] == list(range(10, 20_001, 10))


def test_an_evaluation_is_thinned_too(clock, capsys):
    bar = ProgBarLogger(log_freq=10, verbose=2)
    bar.set_params({"rank": 0, "world_size": 1})
    bar.on_eval_begin({"steps": 50_000, "metrics": ["loss"]})
    for step in range(50_000):
        clock.now += 0.001
        bar.on_eval_batch_end(
            step, {"batch_size": 4, **({"loss": 0.5} if (step + 1) % 10 == 0 else {})}
        )
    bar.on_eval_end({"loss": 0.5})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "Eval begin..." and lines[-1] == "Eval samples: 200000"
    steps = [int(STEP_LINE.match(line).group(1)) for line in lines[1:-1]]
    assert steps == [10] + list(range(500, 50_001, 500))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_lines": 0},
        {"max_lines": 2.5},
        {"max_lines": True},
        {"interval": 0},
        {"interval": -1.0},
        {"interval": float("nan")},
        {"interval": "30"},
    ],
)
def test_bad_thinning_arguments(kwargs):
    with pytest.raises(ValueError, match=f"{next(iter(kwargs))} must be"):
        ProgBarLogger(**kwargs)
