"""History: the per-epoch figures that ``Model.fit`` returns."""

from __future__ import annotations

from .base import Callback


class History(Callback):
    """Records every epoch's logs.

    ``history.history`` maps each logged name (``"loss"``, metric names and
    ``"val_" + name`` after an evaluation) to a list with one value per epoch
    in which it was logged; ``history.epoch`` lists those epoch indices.
    A name that first appears in a later epoch (``val_*`` with ``eval_freq``
    > 1) has a list only as long as the epochs that logged it, as in Keras.

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
        self._training = False

    def state_dict(self) -> dict:
        return {
            "epoch": list(self.epoch),
            "history": {k: list(v) for k, v in self.history.items()},
            "evaluations": [dict(e) for e in self.evaluations],
        }

    def load_state_dict(self, state: dict) -> None:
        self.epoch = list(state["epoch"])
        self.history = {k: list(v) for k, v in state["history"].items()}
        self.evaluations = [dict(e) for e in state.get("evaluations", [])]

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.epoch = []
        self.history = {}
        self.evaluations = []
        self._training = True

    def on_train_end(self, logs: dict | None = None) -> None:
        self._training = False

    def on_eval_end(self, logs: dict | None = None) -> None:
        if self._training and logs:
            self.evaluations.append({"step": self.model.step, "epoch": self.model.epoch, **logs})

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.epoch.append(epoch)
        for name, value in (logs or {}).items():
            self.history.setdefault(name, []).append(value)
