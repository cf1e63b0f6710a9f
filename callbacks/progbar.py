"""ProgBarLogger: what a user watches while a model trains.

Two displays, chosen like Paddle's ``verbose``:

* ``verbose=1`` on a terminal or in a Jupyter notebook: a tqdm bar per epoch
  (and per evaluation) with the running figures as its postfix, refreshed at
  most four times a second (see "Notebooks" below);
* ``verbose=2``, or ``verbose=1`` when stdout is neither (CI logs, files,
  ``torchrun`` workers): lines in Paddle's form
  ``step 400/938 - loss: 0.4262 - acc_top1: 0.7887 - 5ms/step``, at the
  steps chosen below;
* ``verbose=3``: the lines of ``verbose=2`` plus Paddle's time counters,
  ``step 400/938 - loss: 0.4262 - avg_reader_cost: 0.00012 sec -
  avg_batch_cost: 0.00456 sec - ips: 14035.08772 samples/sec - 5ms/step``
  (see "Time counters" below);
* ``verbose=0`` prints nothing.

Which steps get a line. Figures reach the callbacks every ``log_freq`` steps
(and on a pass's last step), so those are the candidates. Paddle prints every
candidate, which is right for the usual epoch (938 steps at ``log_freq=10``:
94 lines) but floods a log with 10,000 lines for a 100,000-step epoch. So a
pass (a training epoch, an evaluation) prints at most about ``max_lines``
(default 100) lines from its progress: its first candidate (the first
figures and pace, early), then a candidate only when it starts a new
``1/max_lines`` of the pass (the first candidate past each 1%), and always
its last step. When ``log_freq`` already gives ``max_lines`` lines or fewer
per pass -- every epoch of up to 1,000 steps at the default ``log_freq=10``,
any explicit ``log_freq`` of at least 1% of the pass, such as Paddle's examples'
``log_freq=400`` -- every candidate is printed, exactly as in Paddle; a
finer ``log_freq`` is thinned to about one line per 1%, and
``ProgBarLogger(log_freq=..., max_lines=None)`` prints every candidate. We
count lines rather than time them because the same run then prints the same
lines on any machine (diffable logs, testable output).

Counting alone can leave a slow pass silent for long (a 100,000-step epoch
at one second a step would print every 17 minutes; some CI services stop a
job after 10 silent minutes), so a thinned-out candidate is also printed
when ``interval`` seconds (default 30) have passed since the previous line.
The interval only ever adds lines: a pass whose candidates are all printed
is unaffected. A pass of unknown length (an ``IterableDataset``) has no
1%, so it prints its first candidate, then at most one line per
``interval``, and its last step.

Time counters (``verbose=3``), averaged over the pass so far, measured from
the hooks alone: ``avg_reader_cost`` is the time from a batch's end (or the
pass's start) to the next batch's begin -- fetching and preparing the batch;
``avg_batch_cost`` the time from a batch's begin to its end -- the step; ``ips``
the samples (the logs' ``batch_size``, times the number of processes) per
second of both. An evaluation run inside a training batch is not counted in
that batch's cost. Nothing synchronises the device: on a GPU a step's cost is
what the host waited for it, which averages out over a pass as the queue of
launched work fills. With ``verbose`` other than 3 the batch-begin hooks are
left out of the loop (``unused_hooks``), so the counters cost nothing then.

Notebooks. A notebook's stdout is no terminal, yet it shows one live bar far
better than a hundred lines, so ``verbose=1`` draws a bar in an IPython kernel
(Jupyter, JupyterLab, VS Code, Colab) too. In the kernel's own process it is
tqdm's notebook widget when ``ipywidgets`` is installed (``tqdm.autonotebook``'s
choice). Without ``ipywidgets`` -- or in a Qt console, which cannot draw
widgets, or in the processes ``hapi.spawn`` forks from a notebook, whose
output the kernel forwards as text -- it is tqdm's text bar: it redraws itself
with carriage returns, which notebooks render as one line updated in place.
We chose that over tqdm's own fallback, which warns "IProgress not found" and
draws the same text bar, so a missing optional package costs the user no
warning and no lines. Only ``verbose=1`` changes; ``verbose=2`` and ``3``
print lines everywhere.

Only the main process prints. The figures come from the loop's ``logs`` (they
are running means over the epoch), so printing never touches the device.
"""

from __future__ import annotations

import sys
import time
import warnings
from typing import Any

from hapi.messages import require_int

from .base import NOT_FIGURES, Callback
from .monitor import require_number

_BEGIN_HOOKS = ("on_train_batch_begin", "on_eval_batch_begin", "on_predict_batch_begin")

# The one clock for paces and intervals; tests replace it (monkeypatch
# ``callbacks.progbar._clock``) instead of sleeping.
_clock = time.perf_counter


def _bar_class(world_size: int) -> Any:
    """tqdm's bar class for ``verbose=1`` here, or None for lines (see "Notebooks" above)."""
    in_kernel = "ipykernel.zmqshell" in sys.modules  # an IPython kernel, or a process it forked
    if in_kernel and world_size == 1:  # the kernel itself: tqdm's widget where it can draw one
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # tqdm's notices of which bar it chose
            from tqdm.autonotebook import tqdm
        return tqdm
    if in_kernel or sys.stdout.isatty():
        from tqdm.std import tqdm

        return tqdm
    return None


def _format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4e}" if value != 0.0 and abs(value) < 1e-3 else f"{value:.4f}"
    return str(value)


def _formatted(figures: dict) -> dict[str, str]:
    return {name: _format_value(value) for name, value in figures.items()}


class _Phase:
    """Progress of one pass (a training epoch, an evaluation or a prediction)."""

    def __init__(self, steps: int | None, bar: Any) -> None:
        self.steps = steps
        self.bar = bar
        # When the pass started, its last line was printed, its last batch began or ended.
        self.started = self.last_line = self.mark = _clock()
        self.samples = self.done = 0
        # Figures not printed yet (a shortened last epoch's final step, say):
        # printed before the pass ends, so the last figures are always shown.
        self.unprinted: dict | None = None
        # The 1/max_lines of the pass the last line was in (-1: a pass of unknown length); -2,
        # below every part, until the pass's first line.
        self.part = -2
        # verbose=3's counters: seconds between batches (reading) and inside them.
        self.reader_time = self.batch_time = 0.0
        self.timed_batches = self.timed_samples = 0
        # Seconds of an evaluation inside the current interval (while one runs: minus its start).
        self.paused = 0.0

    def part_of(self, max_lines: int | None) -> int:
        """Which 1/max_lines of the pass the current step ends (-1: unknown length or no thinning)."""
        if self.steps is None or max_lines is None:
            return -1
        return self.done * max_lines // max(self.steps, 1)

    def since_mark(self) -> float:
        """Seconds since the last batch begin or end, evaluations inside it left out."""
        now = _clock()
        seconds = now - self.mark - self.paused
        self.mark, self.paused = now, 0.0
        return seconds


class ProgBarLogger(Callback):
    """Prints progress and running figures (default in fit/evaluate/predict).

    ``fit``/``evaluate``/``predict`` add one from their ``verbose`` and
    ``log_freq`` unless ``callbacks`` holds one; pass your own to choose
    ``max_lines`` or ``interval``. Only the main process prints.

    Args:
        log_freq: a line may be printed (or the bar's figures refreshed) every
            this many steps, and always on the last step.
        verbose: 0 silent; 1 a progress bar on a terminal or in a notebook
            (lines otherwise);
            2 lines; 3 lines with Paddle's time counters (``avg_reader_cost``,
            ``avg_batch_cost``, ``ips``; see the module docstring).
        max_lines: lines per pass from progress: the first ``log_freq``
            step, then the first one in each new ``1/max_lines`` of the pass,
            and the last step (see the module docstring). ``log_freq`` steps
            that give no more lines than this are all printed. ``None``
            prints every ``log_freq`` step, however many.
        interval: seconds after which a ``log_freq`` step that thinning
            would skip is printed anyway, so a slow pass still shows progress;
            also the spacing of lines on a pass of unknown length. ``None``:
            never.

    Raises:
        ValueError: an argument is out of range; the message names it.
    """

    def __init__(
        self,
        log_freq: int = 1,
        verbose: int = 2,
        max_lines: int | None = 100,
        interval: float | None = 30.0,
    ) -> None:
        super().__init__()
        self.log_freq = require_int("ProgBarLogger", "log_freq", log_freq)
        self.max_lines = require_int("ProgBarLogger", "max_lines", max_lines, allow_none=True)
        if verbose not in (0, 1, 2, 3):
            raise ValueError(
                f"verbose must be 0, 1, 2 or 3 (lines with time counters); received {verbose!r}."
            )
        if interval is not None:
            kind = "a positive number of seconds, or None for no time-based lines"
            require_number("ProgBarLogger", "interval", interval, kind, lambda v: v > 0, 30)
        self.verbose = verbose
        self.interval = interval
        self._phase: _Phase | None = None
        self._outer: _Phase | None = None  # the training epoch while an evaluation runs
        # Only verbose=3 times batches from their begin: otherwise no per-batch begin call.
        self.unused_hooks = () if verbose == 3 else _BEGIN_HOOKS

    # -- display helpers -------------------------------------------------
    def _start(self, steps: int | None, description: str, line: str) -> None:
        """Begin a pass: a bar named ``description``, or the ``line`` that opens it.

        Nothing with ``verbose=0`` or off the main process: no pass, so every hook after
        it finds none and shows nothing.
        """
        if not self.verbose or not self.is_main:
            return
        tqdm = _bar_class(self.params.get("world_size", 1)) if self.verbose == 1 else None
        if tqdm is None:
            print(line, flush=True)
            self._phase = _Phase(steps, None)
            return
        bar = tqdm(
            total=steps, desc=description, file=sys.stdout, mininterval=0.25, dynamic_ncols=True
        )
        self._phase = _Phase(steps, bar)

    def _print_line(self, phase: _Phase) -> None:
        if phase.unprinted is None:
            return
        total = f"/{phase.steps}" if phase.steps is not None else ""
        parts = [f"step {phase.done}{total}"]
        parts += [f"{name}: {value}" for name, value in _formatted(phase.unprinted).items()]
        if self.verbose == 3:  # Paddle's time counters, averaged over the pass so far
            count = max(phase.timed_batches, 1)
            spent = phase.reader_time + phase.batch_time
            samples = phase.timed_samples * self.params.get("world_size", 1)
            parts.append(f"avg_reader_cost: {phase.reader_time / count:.5f} sec")
            parts.append(f"avg_batch_cost: {phase.batch_time / count:.5f} sec")
            parts.append(f"ips: {samples / spent if spent > 0 else 0.0:.5f} samples/sec")
        pace = (_clock() - phase.started) / max(phase.done, 1)
        parts.append(f"{pace:.1f}s/step" if pace >= 1.0 else f"{pace * 1000:.0f}ms/step")
        print(" - ".join(parts), flush=True)
        phase.unprinted = None
        phase.part = phase.part_of(self.max_lines)
        phase.last_line = _clock()

    def _end(self, kind: str | None, logs: dict | None = None) -> None:
        """End the pass: its last figures (and an evaluation's or prediction's samples)."""
        phase = self._phase
        if phase is None:
            return
        # An evaluation or prediction ends: back to the epoch it ran in, if any.
        self._phase, self._outer = self._outer, None
        if self._phase is not None:
            self._phase.paused += _clock()  # the evaluation's end: paused gains its duration
        if phase.bar is None:
            self._print_line(phase)  # the pass ended on a step between log_freq steps
        else:
            if logs:
                phase.bar.set_postfix(_formatted(logs), refresh=False)
            phase.bar.close()
        if kind is not None:
            print(f"{kind} samples: {phase.samples}", flush=True)

    # -- hooks -----------------------------------------------------------
    def on_train_begin(self, logs: dict | None = None) -> None:
        world_size = self.params.get("world_size", 1)
        if self.verbose and self.is_main and world_size > 1:
            batch = self.params.get("batch_size")
            print(
                f"Distributed training on {world_size} processes: batch_size {batch} per "
                f"process, global batch {batch * world_size if batch else '?'}",
                flush=True,
            )

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        epochs = self.params.get("epochs")
        header = f"Epoch {epoch + 1}/{epochs}" if epochs else f"Epoch {epoch + 1}"
        self._start(self.params.get("steps"), header, header)

    def on_train_batch_begin(self, step: int, logs: dict | None = None) -> None:
        """Time the reading of a batch (``verbose=3``); every pass's batches alike.

        Args:
            step: the batch's index in its pass, from 0.
            logs: ``{}``.
        """
        if self._phase is not None:
            self._phase.reader_time += self._phase.since_mark()

    def on_train_batch_end(self, step: int, logs: dict | None = None) -> None:
        """Count the batch and show its figures: the bar's, or a line when one is due.

        Every pass's batches alike (training, evaluation, prediction).

        Args:
            step: the batch's index in its pass, from 0.
            logs: the batch's logs (``batch_size``; figures every ``log_freq`` steps).
        """
        phase = self._phase
        if phase is None:
            return
        logs = logs or {}
        batch = int(logs.get("batch_size", 0))
        if self.verbose == 3:
            phase.batch_time += phase.since_mark()
            phase.timed_batches += 1
            phase.timed_samples += batch
        phase.done = step + 1
        # The count the figures cover (every process's at the end), else this process's batches.
        phase.samples = int(logs.get("samples", phase.samples + batch))
        figures = {k: v for k, v in logs.items() if k not in NOT_FIGURES}
        if phase.bar is not None:
            phase.bar.update(phase.done - phase.bar.n)
            if figures:
                phase.bar.set_postfix(_formatted(figures), refresh=False)
            return
        if not figures:
            return
        phase.unprinted = figures
        # A log_freq step gets a line by the rule of the module docstring; a pass of
        # unknown length stays in part -1, so only time spaces its lines.
        due = (
            self.max_lines is None
            or phase.part_of(self.max_lines) > phase.part
            or (self.interval is not None and _clock() - phase.last_line >= self.interval)
        )
        steady = phase.done % self.log_freq == 0 or phase.steps is None
        if phase.done == phase.steps or (steady and due):
            self._print_line(phase)

    on_eval_batch_begin = on_predict_batch_begin = on_train_batch_begin
    on_eval_batch_end = on_predict_batch_end = on_train_batch_end

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._end(None)

    def on_eval_begin(self, logs: dict | None = None) -> None:
        outer = self._outer = self._phase  # None with verbose=0 or off the main process
        if outer is not None:
            outer.paused -= _clock()  # the evaluation is no part of a batch's cost
            if outer.bar is not None:
                outer.bar.refresh()
            else:
                self._print_line(outer)  # the epoch's last figures before "Eval begin..."
        self._start((logs or {}).get("steps"), "Eval", "Eval begin...")

    def on_eval_end(self, logs: dict | None = None) -> None:
        self._end("Eval", logs)

    def on_predict_begin(self, logs: dict | None = None) -> None:
        self._start((logs or {}).get("steps"), "Predict", "Predict begin...")

    def on_predict_end(self, logs: dict | None = None) -> None:
        self._end("Predict", logs)
