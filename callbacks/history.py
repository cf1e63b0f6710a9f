"""History: the per-epoch figures that ``Model.fit`` returns."""

from __future__ import annotations

from typing import Any

from .base import Callback


def learning_rates(model: Any) -> dict[str, float]:
    """The learning rate of each optimizer of ``model``, by its logged name.

    ``"lr"`` for a single optimizer (the name VisualDL and TensorBoard plot as
    ``train/lr``); ``"lr_<name>"`` for each of several (``prepare([a, b])``:
    ``lr_0``, ``lr_1``; ``prepare({"g": a, "d": b})``: ``lr_g``, ``lr_d``).
    Each is its first parameter group's ``lr``.
    """
    given = getattr(model, "optimizers", None) or getattr(model, "optimizer", None)
    if isinstance(given, (list, tuple)):
        given = given[0] if len(given) == 1 else dict(enumerate(given))
    named = (
        {f"lr_{k}": opt for k, opt in given.items()} if isinstance(given, dict) else {"lr": given}
    )
    return {  # a tensor lr (capturable) becomes a float
        name: float(optimizer.param_groups[0]["lr"])
        for name, optimizer in named.items()
        if getattr(optimizer, "param_groups", None)
    }


class History(Callback):
    """Records every epoch's logs: what ``Model.fit`` returns, to plot or compare runs.

    ``fit`` adds one unless ``callbacks`` holds one, and returns it; there is
    no need to create it yourself.

    ``history.history`` maps each logged name (``"loss"``, metric names and
    ``"val_" + name`` after an evaluation) to a list with one value per epoch
    in which it was logged; ``history.epoch`` lists those epoch indices.
    A name that first appears in a later epoch (``val_*`` with ``eval_freq``
    > 1) has a list only as long as the epochs that logged it, as in Keras.
    The learning rate each epoch trained with (read at its start, after a
    per-epoch schedule set it) is recorded too, as ``"lr"`` (one optimizer) or
    ``"lr_<name>"`` per optimizer (``lr_0``, ``lr_1`` for a list; ``lr_g``,
    ``lr_d`` for a dict), unless the
    epoch's logs already carry that name.

    ``history.evaluations`` lists every evaluation run during ``fit`` -- at
    the epoch ends and, with ``fit(eval_steps=N)``, every N optimizer steps --
    as ``{"step": optimizer steps so far, "epoch": its 0-based epoch, <name>:
    value, ...}`` with the evaluation's own names (``loss``, not ``val_loss``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.epoch: list[int] = []
        self.history: dict[str, list[float]] = {}
        self.evaluations: list[dict[str, float]] = []
        self._rates: dict[str, float] = {}  # this epoch's learning rates, read at its start

    def state_dict(self) -> dict:
        return {
            "epoch": list(self.epoch),
            "history": {k: list(v) for k, v in self.history.items()},
            "evaluations": [dict(e) for e in self.evaluations],
            "rates": dict(self._rates),
        }

    def load_state_dict(self, state: dict) -> None:
        self.epoch = list(state["epoch"])
        self.history = {k: list(v) for k, v in state["history"].items()}
        self.evaluations = [dict(e) for e in state.get("evaluations", [])]
        self._rates = dict(state.get("rates", self._rates))

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.epoch = []
        self.history = {}
        self.evaluations = []

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if not getattr(self.model, "epoch_step", 0):  # a resumed epoch keeps its restored rates
            self._rates = learning_rates(self.model)

    def on_eval_end(self, logs: dict | None = None) -> None:
        if logs and self.params.get("epochs") is not None:  # an evaluation inside fit
            self.evaluations.append({"step": self.model.step, "epoch": self.model.epoch, **logs})

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.epoch.append(epoch)
        logs = logs or {}
        rates = {name: rate for name, rate in self._rates.items() if name not in logs}
        for name, value in {**logs, **rates}.items():
            self.history.setdefault(name, []).append(value)
