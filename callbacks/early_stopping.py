"""EarlyStopping: stop training when a monitored figure stops improving.

Keras semantics, because they are the ones users already know: ``patience``
counts evaluations without improvement, so a flat ``val_loss`` with
``patience=2`` stops after the third epoch (index 2). Every rank sees the same
(already reduced) logs, so every rank reaches the same decision without a
collective of its own.
"""

from __future__ import annotations

import copy
from typing import Any

from tqdm import tqdm

from callbacks.monitor import MonitorCallback, require_int


def _snapshot(state_dict: dict[str, Any]) -> dict[str, Any]:
    # A detached clone, so later optimizer steps cannot change the copy in place.
    return {
        key: value.detach().clone() if hasattr(value, "detach") else copy.deepcopy(value)
        for key, value in state_dict.items()
    }


class EarlyStopping(MonitorCallback):
    """Sets ``model.stop_training`` when ``monitor`` has not improved for ``patience`` evaluations.

    Args:
        monitor: the logged figure to watch (default ``"val_loss"``).
        mode: ``"min"``, ``"max"`` or ``"auto"`` (see :class:`MonitorCallback`).
        patience: evaluations without improvement before stopping; 0 stops at
            the first evaluation that does not improve.
        min_delta: smallest change that counts as an improvement.
        baseline: if set, the value to beat from the start: training stops
            after ``patience`` + 1 evaluations that do not beat it.
        restore_best_weights: when stopping, load the network weights of the
            best evaluation back into ``model.network``.
        verbose: print "Epoch N: early stopping" at the end of training.

    Attributes:
        stopped_epoch: 0-based epoch at which training was stopped, or None.
        best_epoch: 0-based epoch of the best value, or None.
        best_weights: detached copy of the best ``state_dict`` (only with
            ``restore_best_weights``).
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        mode: str = "auto",
        patience: int = 0,
        min_delta: float = 0.0,
        baseline: float | None = None,
        restore_best_weights: bool = False,
        verbose: int = 1,
    ) -> None:
        super().__init__(monitor=monitor, mode=mode, min_delta=min_delta)
        self.patience = require_int("EarlyStopping", "patience", patience, minimum=0)
        self.baseline = None if baseline is None else float(baseline)
        self.restore_best_weights = bool(restore_best_weights)
        self.verbose = verbose
        self.stopped_epoch: int | None = None
        self.best_epoch: int | None = None
        self.best_weights: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "stopped_epoch": self.stopped_epoch,
                "best_epoch": self.best_epoch, "best_weights": self.best_weights}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.stopped_epoch = state["stopped_epoch"]
        self.best_epoch = state["best_epoch"]
        self.best_weights = state["best_weights"]

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.wait = 0
        self.best = self.initial_best if self.baseline is None else self.baseline
        self.stopped_epoch = None
        self.best_epoch = None
        self.best_weights = None

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        current = self.get_monitor_value(logs)
        if current is None:
            return
        if self.is_improvement(current, self.best):
            self.best = current
            self.best_epoch = epoch
            self.wait = 0
            if self.restore_best_weights:
                self.best_weights = _snapshot(self.model.network.state_dict())
            return
        self.wait += 1
        if self.wait >= self.patience:
            self.model.stop_training = True
            self.stopped_epoch = epoch
            if self.restore_best_weights and self.best_weights is not None:
                self.model.network.load_state_dict(self.best_weights)
                if self.verbose and self.is_main:
                    tqdm.write(
                        "Restoring model weights from the end of the best epoch: "
                        f"{self.best_epoch + 1}."
                    )

    def on_train_end(self, logs: dict | None = None) -> None:
        if self.stopped_epoch is not None and self.verbose and self.is_main:
            tqdm.write(f"Epoch {self.stopped_epoch + 1}: early stopping")
