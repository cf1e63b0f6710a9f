"""VisualDL: training curves for the VisualDL dashboard (``visualdl --logdir``).

Only the main process writes (other ranks never create a file or directory),
and ``visualdl`` is imported on the first write, not at import time, because
importing it costs about 0.4 s that a run without this callback should not pay.
"""

from __future__ import annotations

import atexit
import os
from typing import Any

from callbacks.base import Callback

# Batch-log keys that describe the batch, not the model; never plotted.
_NOT_SCALARS = ("batch_size", "samples", "step")


class VisualDL(Callback):
    """Writes scalars with ``visualdl.LogWriter(logdir=log_dir)``.

    * ``train/<name>`` for the loss and each metric in the batch logs, every
      time they carry them (every ``log_freq`` steps and on the last step);
      the step is the global batch number (1-based, counted across epochs and
      across ``fit`` calls on the same callback).
    * ``train/lr``: ``model.optimizer.param_groups[0]["lr"]`` at the same moments.
    * ``eval/<name>`` for each figure of an evaluation; the step is the epoch
      index (0-based) during ``fit``, or the number of standalone
      ``evaluate`` calls so far (1-based) outside it.

    Everything goes to one record file per callback: the writer is flushed
    (not closed) at the end of training and after a standalone evaluation, so
    the file is complete when the call returns, and the same callback given
    to a later ``evaluate`` adds its ``eval/*`` scalars to that file. It is
    closed by :meth:`close` or at interpreter exit.

    Args:
        log_dir: directory for the ``vdlrecords.*.log`` files; created on the
            first write by the main process.
    """

    def __init__(self, log_dir: str | os.PathLike) -> None:
        super().__init__()
        if not isinstance(log_dir, (str, os.PathLike)):
            raise TypeError(
                f"VisualDL: log_dir must be a directory path (str or os.PathLike); received "
                f"{log_dir!r} of type {type(log_dir).__name__}. Pass e.g. VisualDL('runs/lenet')."
            )
        self.log_dir = os.fspath(log_dir)
        self.train_step = 0
        self.eval_count = 0
        self._epoch = 0
        self._training = False
        self._writer: Any = None

    def _write(self, prefix: str, scalars: dict[str, float], step: int) -> None:
        if not self.is_main:
            return
        if self._writer is None:
            from visualdl import LogWriter  # lazy: importing visualdl costs ~0.4 s

            self._writer = LogWriter(logdir=self.log_dir)
            atexit.register(self.close)
        for name, value in scalars.items():
            self._writer.add_scalar(tag=f"{prefix}/{name}", value=float(value), step=step)

    def close(self) -> None:
        """Close the record file; a later write opens a new one."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def state_dict(self) -> dict[str, Any]:
        return {"train_step": self.train_step, "eval_count": self.eval_count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.train_step, self.eval_count = int(state["train_step"]), int(state["eval_count"])

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

    def on_eval_end(self, logs: dict | None = None) -> None:
        if self._training:
            step = self._epoch
        else:
            self.eval_count += 1
            step = self.eval_count
        self._write("eval", dict(logs or {}), step)
        if not self._training:
            self._flush()

    def on_train_end(self, logs: dict | None = None) -> None:
        self._training = False
        self._flush()
