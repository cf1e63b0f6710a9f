"""EarlyStopping: stop training when a monitored figure stops improving.

Keras semantics, because they are the ones users already know: ``patience``
counts evaluations without improvement, so a flat ``val_loss`` with
``patience=2`` stops after the third epoch (index 2); ``start_from_epoch``
skips a warm-up; ``restore_best_weights=True`` puts the best epoch's weights
back when training ends, whether it stopped early or ran all its epochs
(Keras 3). Paddle's ``save_best_model`` saves the best model into fit's
``save_dir``. Every rank sees the same (already reduced) logs, so every rank
reaches the same decision -- and makes the same collective ``model.save``
calls -- without a collective of its own.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from tqdm import tqdm

from .monitor import MonitorCallback, refuse_state, require_int

# What a resume takes back besides MonitorCallback's best and wait.
_STATE = ("stopped_epoch", "best_epoch", "best_weights", "best_model_path")


class EarlyStopping(MonitorCallback):
    """Sets ``model.stop_training`` when ``monitor`` has not improved for ``patience`` evaluations.

    Args:
        monitor: the logged figure to watch (default ``"val_loss"``; the
            training figure is ``"loss"``, see :class:`MonitorCallback`).
        mode: ``"min"``, ``"max"`` or ``"auto"`` (see :class:`MonitorCallback`).
        patience: evaluations without improvement before stopping; 0 stops at
            the first evaluation that does not improve.
        min_delta: smallest change that counts as an improvement.
        baseline: if set, the value to beat: an evaluation that does not beat
            it counts towards ``patience`` even when it is the best so far, so
            training stops after ``patience`` evaluations (at least one) that
            do not beat it (Paddle's and Keras 2's rule).
        restore_best_weights: when training ends -- stopped early or not --
            load the network weights of the best evaluation back into
            ``model.network``, as Keras 3 does: the best of the monitored
            epochs, even when none beat ``baseline``; the first monitored
            epoch's when no value improved on it (all NaN). If the figure was
            never logged, the last weights stay. The best weights are kept as
            ``model.get_weights()`` gives them: a full copy in CPU memory on
            every process, also under FSDP (where taking it gathers the shards).
        verbose: print "Epoch N: early stopping", what was restored and where
            the best model was saved, at the end of training (main process).
        save_best_model: Paddle's switch: each time the figure improves (and
            beats ``baseline``), save the model with ``model.save`` to
            ``<save_dir>/best_model`` (the file ``best_model.pt``), where
            ``save_dir`` is fit's ``save_dir``. Nothing is saved when fit has no
            ``save_dir``. Every process saves (saving is collective; the
            main process writes), as every process sees the same figures.
        start_from_epoch: Keras 3's warm-up: epochs before this one (0-based)
            are not watched at all -- no improvement, no count, no snapshot,
            no save.

    Attributes:
        stopped_epoch: 0-based epoch at which training was stopped, or None.
        best: the best value of the figure seen in this fit (``+inf`` /
            ``-inf`` before any), whether or not it beat ``baseline``.
        best_epoch: 0-based epoch of the best value (of the first monitored
            epoch while none improved), or None.
        best_weights: the best epoch's weights, as ``model.get_weights()``
            gives them (only with ``restore_best_weights``): full CPU tensors,
            the same on every process, under every strategy.
        save_dir: fit's ``save_dir`` for the current fit (None without one).
        best_model_path: the file ``save_best_model`` last wrote, or None.
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        mode: str = "auto",
        patience: int = 0,
        *,
        min_delta: float = 0.0,
        baseline: float | None = None,
        restore_best_weights: bool = False,
        verbose: int = 1,
        save_best_model: bool = True,
        start_from_epoch: int = 0,
    ) -> None:
        super().__init__(monitor=monitor, mode=mode, min_delta=min_delta)
        self.patience = require_int("EarlyStopping", "patience", patience, minimum=0)
        self.baseline = None if baseline is None else float(baseline)
        self.restore_best_weights = bool(restore_best_weights)
        self.verbose = verbose
        self.save_best_model = bool(save_best_model)
        self.start_from_epoch = require_int(
            "EarlyStopping", "start_from_epoch", start_from_epoch, minimum=0
        )
        self.stopped_epoch: int | None = None
        self.best_epoch: int | None = None
        self.best_weights: dict[str, Any] | None = None
        self.save_dir: str | None = None
        self.best_model_path: str | None = None

    def state_dict(self) -> dict[str, Any]:
        """The counters and the best weights (full plain tensors).

        Returns:
            ``best``, ``wait``, ``stopped_epoch``, ``best_epoch``,
            ``best_weights`` (``None`` unless ``restore_best_weights``) and
            where the best model was saved.
        """
        return {**super().state_dict(), **{key: getattr(self, key) for key in _STATE}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back :meth:`state_dict`'s values; those used only later are checked now.

        Args:
            state: what :meth:`state_dict` returned.

        Raises:
            ValueError: an entry of a kind no run writes (the error names the
                entry and the value); nothing is taken back then.
        """
        weights, path = state["best_weights"], state.get("best_model_path")
        if weights is not None and not (
            isinstance(weights, dict) and all(map(torch.is_tensor, weights.values()))
        ):
            refuse_state("EarlyStopping", "best_weights", weights, "None or a dict of tensors")
        if path is not None and not isinstance(path, str):
            refuse_state("EarlyStopping", "best_model_path", path, "None or a path")
        stopped, best_epoch = (
            None if state[key] is None else int(state[key])
            for key in ("stopped_epoch", "best_epoch")
        )
        super().load_state_dict(state)
        self.stopped_epoch, self.best_epoch = stopped, best_epoch
        self.best_weights, self.best_model_path = weights, path

    def on_train_begin(self, logs: dict | None = None) -> None:
        super().on_train_begin(logs)
        self.stopped_epoch = self.best_epoch = self.best_weights = self.best_model_path = None
        save_dir = self.params.get("save_dir")
        self.save_dir = None if save_dir is None else os.fspath(save_dir)

    def _beats_baseline(self, value: float) -> bool:
        return self.baseline is None or self._is_improvement(value, self.baseline)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        current = self.get_monitor_value(logs)
        if current is None or epoch < self.start_from_epoch:
            return
        improved = self._is_improvement(current, self.best)
        if improved:
            self.best = current
        if improved or self.best_epoch is None:
            # Keras 3: the first watched epoch is the best until one improves on it (all NaN).
            self.best_epoch = epoch
            if self.restore_best_weights:
                self.best_weights = self.model.get_weights()
        if improved and self._beats_baseline(current):
            self.wait = 0
            if self.save_best_model and self.save_dir is not None:
                # Collective: every process calls model.save; the main process writes.
                path = os.path.join(self.save_dir, "best_model")
                written = self.model.save(path)
                self.best_model_path = written if isinstance(written, str) else path + ".pt"
            return
        self.wait += 1
        if self.wait >= self.patience:
            self.model.stop_training = True
            self.stopped_epoch = epoch

    def on_train_end(self, logs: dict | None = None) -> None:
        speak = self.verbose and self.is_main
        if speak and self.stopped_epoch is not None:
            tqdm.write(f"Epoch {self.stopped_epoch + 1}: early stopping")
        if speak and self.best_model_path is not None:
            path = os.path.abspath(self.best_model_path)
            tqdm.write(
                f"EarlyStopping: the best model ({self.monitor}={self.best:g}) is saved at {path}."
            )
        if not self.restore_best_weights:
            return
        if self.best_weights is None:
            since = f" from epoch {self.start_from_epoch + 1} on" if self.start_from_epoch else ""
            text = (
                f"EarlyStopping: no epoch logged {self.monitor!r}{since}, so the best weights were "
                "not restored; the model keeps its last weights"
            )
        else:
            self.model.set_weights(self.best_weights)  # every process: the same full weights
            first = self.best == self._initial_best  # nothing improved on the first watched epoch
            which = "first monitored" if first else "best"
            text = (
                f"Restoring model weights from the end of the {which} epoch: {self.best_epoch + 1}"
            )
            if first:
                text += f" (no value of {self.monitor!r} was a finite number)"
            elif not self._beats_baseline(self.best):
                text += (
                    f" ({self.monitor}={self.best:g}; no epoch beat the baseline {self.baseline:g})"
                )
        if speak:
            tqdm.write(text + ".")
