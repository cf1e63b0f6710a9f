"""Shared "watch one logged figure" logic for EarlyStopping, ReduceLROnPlateau
and ModelCheckpoint.

The three callbacks answer the same question -- did ``logs[monitor]`` improve
by more than ``min_delta`` in the right direction? -- so the answer lives in one
place and cannot drift between them (Keras' ``MonitorCallback``). The state is
kept in plain attributes (``best``, ``wait``) so that it can be saved and
restored with the rest of a run.

Names differ from Paddle's hapi, where the evaluation logs carry no prefix and
``EarlyStopping("loss")`` / ``ReduceLROnPlateau("loss")`` watch the evaluation
loss. Here, as in Keras, ``"loss"`` is the training figure and ``"val_loss"``
the evaluation one; a callback watching a training name while the evaluation
figure of that name exists warns once per fit (:class:`MonitorNameWarning`).
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Any, Callable, NoReturn

import hapi.messages as messages
from hapi.messages import require_int  # noqa: F401 -- other callbacks import it from here

from .base import Callback, refuse_argument

# Substrings of a monitored name that mean "higher is better" in mode="auto".
_MAX_HINTS = ("acc", "auc", "precision", "recall", "f1", "score")


def refuse_state(owner: str, key: str, value: Any, expected: str) -> NoReturn:
    """Raise the ValueError for an entry of a saved callback state that no run writes.

    A state comes from a file. ``fit`` turns any error while a callback loads
    its state into a ``CheckpointError`` naming the file, so a callback checks
    only what would load without error and fail later, or lead elsewhere.
    """
    raise ValueError(
        f"{owner} state {key!r} must be {expected}; received {value!r}. The checkpoint it came "
        "from is damaged or was crafted."
    )


def require_number(
    owner: str, name: str, value: Any, kind: str, ok: Callable[[float], bool], example: float
) -> float:
    """``value`` as a float if it is a real number (not a bool) that ``ok`` accepts.

    Otherwise a ValueError naming the owner, the argument, what it must be
    (``kind``), what was received and an ``example`` to pass.
    """
    if isinstance(value, bool) or not isinstance(value, Real) or not ok(float(value)):
        refuse_argument(owner, name, value, f"be {kind}", f"{name}={example}")
    return float(value)


def require_bool(owner: str, name: str, value: Any) -> bool:
    """``value`` if it is True or False; a TypeError naming the owner and the argument otherwise."""
    if not isinstance(value, bool):
        refuse_argument(owner, name, value, "be True or False", f"{name}=True", TypeError)
    return value


class MonitorNameWarning(UserWarning):
    """A monitored name is a training figure while its ``val_`` twin exists (Paddle's meaning).

    Warned once per fit by EarlyStopping, ReduceLROnPlateau and
    ModelCheckpoint: in Paddle's hapi ``"loss"`` meant the evaluation loss,
    here (as in Keras) ``"val_loss"`` does, so a ported script would silently
    watch the training figure. Silence it, if the training figure is what you
    mean, with
    ``warnings.filterwarnings("ignore", category=callbacks.MonitorNameWarning)``.
    """


class MonitorCallback(Callback):
    """Base class for callbacks that act when a logged figure stops improving.

    Args:
        monitor: key of the ``logs`` dict to watch, e.g. ``"val_loss"``.
        mode: ``"min"``, ``"max"`` or ``"auto"``. ``"auto"`` picks ``"max"``
            when the name contains acc, auc, precision, recall, f1 or score
            (case-insensitive) and ``"min"`` otherwise. Any other value warns
            and is read as ``"auto"`` (Paddle and Keras do the same).
        min_delta: the smallest change that counts as an improvement; a
            non-negative number.

    Attributes:
        mode: the resolved direction, ``"min"`` or ``"max"``.
        best: the best value seen so far (``+inf`` / ``-inf`` before any).
        wait: evaluations since the last improvement.

    A training name (no ``val_`` prefix) while the epoch logs also hold
    ``val_<name>`` warns once per fit on the main process with a
    :class:`MonitorNameWarning`: in Paddle's hapi ``"loss"`` meant the
    evaluation loss, here ``"val_loss"`` is.
    """

    def __init__(
        self, monitor: str = "val_loss", mode: str = "auto", min_delta: float = 0.0
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        if not isinstance(monitor, str) or not monitor:
            must = "be the name of a logged figure (a non-empty str)"
            refuse_argument(owner, "monitor", monitor, must, "monitor='val_loss'", TypeError)
        self.min_delta = require_number(
            owner, "min_delta", min_delta, "a non-negative number", lambda v: v >= 0, 0.01
        )
        if mode not in ("auto", "min", "max"):  # read as "auto", as Paddle's hapi and Keras do
            messages.warn(
                f"{owner}: mode {mode!r} is unknown; using 'auto' instead (accepted: 'auto', "
                "'min', 'max'). Pass mode='min' for losses, mode='max' for accuracies and scores.",
            )
        if mode not in ("min", "max"):
            mode = "max" if any(hint in monitor.lower() for hint in _MAX_HINTS) else "min"
        self.monitor, self.mode = monitor, mode
        self.best, self.wait = self._initial_best, 0
        self._warned_missing = self._warned_name = False

    def set_params(self, params: dict[str, Any]) -> None:
        super().set_params(params)
        self._warned_name = False  # the training-name warning is once per fit, not once per object

    def on_train_begin(self, logs: dict | None = None) -> None:
        """Forget the best value and the wait: each fit watches afresh (a resume restores them).

        Args:
            logs: ``{}``.
        """
        self.best, self.wait = self._initial_best, 0

    @property
    def _initial_best(self) -> float:
        """The value every real figure improves on: ``+inf`` for min, ``-inf`` for max."""
        return math.inf if self.mode == "min" else -math.inf

    def _is_improvement(self, current: float, best: float) -> bool:
        """Whether ``current`` beats ``best`` by more than ``min_delta``.

        NaN never counts as an improvement (every comparison with NaN is false).
        """
        if self.mode == "min":
            return current < best - self.min_delta
        return current > best + self.min_delta

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "wait": self.wait}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.wait = float(state["best"]), int(state["wait"])

    def get_monitor_value(self, logs: dict | None, warn: bool = True) -> float | None:
        """The monitored figure of ``logs`` (Keras' name), for a subclass's own decisions.

        A missing key warns once per callback (not every epoch), naming the
        keys that are there, because the usual cause is a typo or an epoch
        without evaluation. A training name with a ``val_`` twin in ``logs``
        warns too, whatever ``warn`` says: Paddle's ``"loss"`` meant the
        evaluation loss, here ``"val_loss"`` does.

        Args:
            logs: a hook's ``logs`` dict (``None`` reads as empty).
            warn: warn when ``monitor`` is missing.

        Returns:
            ``logs[monitor]`` as a float, or ``None`` when it is missing.
        """
        logs = logs or {}
        name = self.monitor
        if not (self._warned_name or name.startswith("val_")) and f"val_{name}" in logs:
            self._warned_name = True  # once per fit
            if self.is_main:
                messages.warn(
                    f"{type(self).__name__} monitors {name!r}, the training figure, although "
                    f"'val_{name}' is logged too. In Paddle's hapi {name!r} meant the evaluation "
                    f"figure: pass monitor='val_{name}' to watch it, or filter the "
                    "callbacks.MonitorNameWarning category out.",
                    MonitorNameWarning,
                )
        value = logs.get(self.monitor)
        if value is None and warn:
            self._warn_missing(logs)
        return None if value is None else float(value)

    def _warn_missing(self, logs: dict, then: str = "") -> None:
        """Warn, once per callback, that ``monitor`` is not in ``logs`` (``then``: what follows)."""
        if not self._warned_missing:
            self._warned_missing = True
            messages.warn(
                f"{type(self).__name__} is monitoring {self.monitor!r}, which is not in the logs. "
                f"Available keys: {sorted(logs)}. {then}Pass monitor= one of them; val_* keys "
                "exist only on epochs that ran an evaluation (eval_data, eval_freq).",
            )
