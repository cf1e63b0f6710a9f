"""TerminateOnNaN: stop a run whose loss has become NaN or infinite.

Once the loss is NaN every later step is wasted compute (and a periodic
checkpoint would overwrite good weights with bad ones), so the run stops at the
first logged sign of it.
"""

from __future__ import annotations

import math

from tqdm import tqdm

from .base import Callback


class TerminateOnNaN(Callback):
    """Stops training when a logged ``loss`` is NaN or +-inf; or raises, with ``raise_error``.

    Checked in ``on_train_batch_end`` and ``on_epoch_end``. Batch logs carry
    the loss only every ``log_freq`` steps (and on an epoch's last step), so a
    NaN is detected at the next logging step, not necessarily at the step that
    produced it; fit with ``log_freq=1`` to stop at that exact step. The logged
    loss is a running mean over the epoch, so one NaN batch keeps it NaN until
    the epoch ends and cannot be missed.

    Args:
        raise_error: False (default) sets ``model.stop_training``: the epoch
            ends as usual and every callback's ``on_train_end`` runs (a last
            checkpoint, EarlyStopping's restore). True raises a
            ``RuntimeError`` at once instead (Keras 3): ``fit`` ends with the
            error and no ``on_train_end`` runs, so nothing written at the end
            of training (``final.pt``, a removed backup) replaces the last good
            state. The loss is the same on every process, so all of them raise.
    """

    def __init__(self, raise_error: bool = False) -> None:
        super().__init__()
        self.raise_error = bool(raise_error)
        self._epoch = 0
        self._last_step: int | None = None
        self._reported = False

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._reported = False

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch
        self._last_step = None

    def on_train_batch_end(self, step: int, logs: dict | None = None) -> None:
        self._last_step = step
        self._check(logs, step)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._check(logs, self._last_step)

    def _check(self, logs: dict | None, step: int | None) -> None:
        loss = (logs or {}).get("loss")
        if loss is None or math.isfinite(float(loss)):
            return
        where = f"epoch {self._epoch + 1}" + ("" if step is None else f", step {step + 1}")
        if self.raise_error:
            raise RuntimeError(
                f"NaN or Inf loss encountered at {where}: the logged training loss is "
                f"{float(loss)} (TerminateOnNaN(raise_error=True) ends fit here, without "
                "on_train_end). Lower the learning rate, clip gradients, or look for NaN/Inf in "
                "the inputs; fit with log_freq=1 to find the first such step."
            )
        self.model.stop_training = True
        if self.is_main and not self._reported:
            self._reported = True
            tqdm.write(
                f"{where[0].upper()}{where[1:]}: loss is {float(loss)}; stopping training (TerminateOnNaN)."
            )
