"""VisualDL: training curves for the VisualDL dashboard (``visualdl --logdir``).

Only the main process writes (other ranks never create a file or directory),
and ``visualdl`` is imported on the first write, not at import time, because
importing it costs about 0.4 s that a run without this callback should not pay.

The choice of scalars, tags and steps lives in :class:`_ScalarLogger`, which
``callbacks.tensorboard.TensorBoard`` shares, so that the two dashboards show
the same curves for the same run; each subclass only says how to open its
writer and add one scalar.
"""

from __future__ import annotations

import atexit
import os
from typing import Any

from callbacks.base import Callback

# Batch-log keys that describe the batch, not the model; never plotted.
_NOT_SCALARS = ("batch_size", "samples", "step")


class _ScalarLogger(Callback):
    """Decides which scalars are written, under which tags, at which steps
    (listed in :class:`VisualDL`'s docstring), for VisualDL and TensorBoard alike.

    One writer per callback, opened on the first write by the main process
    only; flushed (not closed) at the end of training and after a standalone
    evaluation, so the file is complete when the call returns and a later
    ``evaluate`` with the same callback appends to it; closed by :meth:`close`
    or at interpreter exit. Subclasses implement :meth:`_open_writer` and
    :meth:`_add_scalar`; the writer must also have ``flush()`` and ``close()``.
    """

    def __init__(self, log_dir: str | os.PathLike) -> None:
        super().__init__()
        name = type(self).__name__
        if not isinstance(log_dir, (str, os.PathLike)):
            raise TypeError(
                f"{name}: log_dir must be a directory path (str or os.PathLike); received "
                f"{log_dir!r} of type {type(log_dir).__name__}. Pass e.g. {name}('runs/lenet')."
            )
        self.log_dir = os.fspath(log_dir)
        self.train_step = 0
        self.next_eval_step = 1  # where the next standalone evaluate is plotted
        self._epoch = 0
        self._training = False
        self._writer: Any = None

    def _open_writer(self) -> Any:
        """Create the writer for ``self.log_dir`` (called once, on the first write)."""
        raise NotImplementedError

    def _add_scalar(self, tag: str, value: float, step: int) -> None:
        """Add one point to ``self._writer``."""
        raise NotImplementedError

    def _write(self, prefix: str, scalars: dict[str, float], step: int) -> None:
        if not self.is_main:
            return
        if self._writer is None:
            self._writer = self._open_writer()
            atexit.register(self.close)
        for name, value in scalars.items():
            self._add_scalar(f"{prefix}/{name}", float(value), step)

    def close(self) -> None:
        """Close the record file; a later write opens a new one."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def state_dict(self) -> dict[str, Any]:
        return {"train_step": self.train_step, "next_eval_step": self.next_eval_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.train_step = int(state["train_step"])
        self.next_eval_step = int(state.get("next_eval_step", state.get("eval_count", 0) + 1))

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._training = True

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_end(self, step: int, logs: dict | None = None) -> None:
        self.train_step += 1
        scalars = {k: v for k, v in (logs or {}).items() if k not in _NOT_SCALARS}
        if not scalars:
            return  # a step between log_freq steps: nothing new to plot
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            scalars["lr"] = float(optimizer.param_groups[0]["lr"])
        self._write("train", scalars, self.train_step)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.next_eval_step = max(self.next_eval_step, epoch + 1)

    def on_eval_end(self, logs: dict | None = None) -> None:
        if self._training:
            step = self._epoch
        else:
            step = self.next_eval_step
            self.next_eval_step += 1
        self._write("eval", dict(logs or {}), step)
        if not self._training:
            self._flush()

    def on_train_end(self, logs: dict | None = None) -> None:
        self._training = False
        self._flush()


class VisualDL(_ScalarLogger):
    """Writes scalars with ``visualdl.LogWriter(logdir=log_dir)``.

    * ``train/<name>`` for the loss and each metric in the batch logs, every
      time they carry them (every ``log_freq`` steps and on the last step);
      the step is the global batch number (1-based, counted across epochs and
      across ``fit`` calls on the same callback).
    * ``train/lr``: ``model.optimizer.param_groups[0]["lr"]`` at the same moments.
    * ``eval/<name>`` for each figure of an evaluation; the step is the epoch
      index (0-based) during ``fit``; a standalone ``evaluate`` comes next:
      step 1, 2, ... with no ``fit`` before it, and after a ``fit`` of E epochs
      step E, E+1, ..., so the curve never runs backwards.

    Everything goes to one record file per callback: the writer is flushed
    (not closed) at the end of training and after a standalone evaluation, so
    the file is complete when the call returns, and the same callback given
    to a later ``evaluate`` adds its ``eval/*`` scalars to that file. It is
    closed by :meth:`close` or at interpreter exit.

    Args:
        log_dir: directory for the ``vdlrecords.*.log`` files; created on the
            first write by the main process.
    """

    def _open_writer(self) -> Any:
        from visualdl import LogWriter  # lazy: importing visualdl costs ~0.4 s

        return LogWriter(logdir=self.log_dir)

    def _add_scalar(self, tag: str, value: float, step: int) -> None:
        self._writer.add_scalar(tag=tag, value=value, step=step)
