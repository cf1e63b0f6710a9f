"""EMA: an exponential moving average of the weights, evaluated during fit and kept at the end.

Averaging the weights of the last few hundred optimizer steps smooths out the
noise of the final steps of SGD-like training; the average often evaluates
better than the last weights, and costs one fused in-place update per step.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import Callback, stepped_to
from .monitor import require_int, require_number


class EMA(Callback):
    """Keeps ``shadow = decay * shadow + (1 - decay) * weights`` after every optimizer step.

    What is averaged: every floating-point parameter of ``model.network``.
    Buffers (BatchNorm's running statistics, counters) are not averaged and
    not copied: the averaged model uses the network's own, current buffers,
    wherever the average is used (evaluation, the end of training). Integer
    parameters are left alone.

    When: the shadow starts as a copy of the weights at ``on_train_begin``
    (each ``fit`` starts a fresh average, unless a resume restores one) and is
    updated in ``on_train_batch_end`` whenever ``model.step`` has moved since
    the last look and is a multiple of ``every_n_steps`` -- once per optimizer
    update, so with ``accumulate_grad_batches=k`` once every k batches, never
    between accumulated batches. There is no warm-up: with ``decay=0.999``
    the average needs a few thousand steps to forget the initial weights.

    Evaluation during ``fit`` scores the average: the averaged weights are
    copied into the network at ``on_eval_begin`` and the training weights
    back at ``on_eval_end``, so ``val_*`` figures (and what EarlyStopping,
    ReduceLROnPlateau and ModelCheckpoint's ``best.pt`` decide from them) are
    the average's. ``evaluate()``/``predict()`` outside ``fit`` use whatever
    the network holds. This callback runs before the others (its
    ``order`` is -1, see :class:`Callback`), so their evaluation hooks see
    the average and the rest of their hooks the training weights.

    At the end of training (``on_train_end``) the averaged weights are copied
    into the network for good (as Keras' ``use_ema`` does), so ``evaluate``,
    ``predict`` and ``model.save`` afterwards use them; ``swap_at_end=False``
    keeps the last training weights there instead. Note that the optimizer's
    state (momentum, Adam's moments) belongs to the training weights: a
    further ``fit`` continues from the averaged ones.

    Files: checkpoints written during training hold the training weights
    (the swap is undone before ``on_epoch_end``), so ModelCheckpoint's
    ``<epoch>.pt`` and ``best.pt`` hold the training weights even though
    ``best.pt`` was chosen on the average's figures. The average itself is
    this callback's state (:meth:`state_dict`), saved in BackupAndRestore's
    backups, so a resumed run ends with exactly the average of an
    uninterrupted one. ``final.pt`` holds the average: this callback's
    ``on_train_end`` comes first (its ``order`` is -1). With
    ``EarlyStopping(restore_best_weights=True)``, whose ``on_train_end`` comes
    later, the best epoch's weights are what the network ends with, and what
    ``final.pt`` holds.

    Several processes: under DDP every process holds the same weights after
    every step, so every process computes the same average, with no
    communication. FSDP across processes (sharded weights) is not supported.

    Cost: one more copy of the parameters, on their device (two during an
    evaluation), and one fused ``torch._foreach_lerp_`` per update (about
    0.2 ms for 1M parameters on one CPU core).

    Args:
        decay: weight of the old average at each update, in [0, 1). The
            average spans roughly ``1 / (1 - decay)`` updates; ``0`` makes it
            the current weights.
        every_n_steps: update only when ``model.step`` is a multiple of this
            (the decay then applies per update, not per step).
        swap_at_end: copy the average into the network when training ends.
    """

    order = -1  # its average is in place around the others' evaluation hooks (Callback.order)

    def __init__(
        self, decay: float = 0.999, every_n_steps: int = 1, swap_at_end: bool = True
    ) -> None:
        super().__init__()
        self.decay = require_number(
            "EMA", "decay", decay, "a number in [0, 1)", lambda v: 0 <= v < 1, 0.999
        )
        self.every_n_steps = require_int("EMA", "every_n_steps", every_n_steps, minimum=1)
        self.swap_at_end = bool(swap_at_end)
        self._names: list[str] = []
        self._params: list[torch.Tensor] = []
        self._shadow: list[torch.Tensor] | None = None
        self._saved: list[torch.Tensor] | None = None  # the training weights while evaluating
        self._pending: dict[str, Any] | None = None  # a state loaded before training began
        self._last_step = 0

    # -- training -------------------------------------------------------------------------------
    def on_train_begin(self, logs: dict | None = None) -> None:
        if getattr(self.model, "sharded", False):
            raise RuntimeError(
                "EMA does not support weights sharded across processes (FSDP on several "
                "processes): each would average only its shard. Use strategy='ddp', or no EMA."
            )
        floating = {n: p for n, p in self.model.network.named_parameters() if p.is_floating_point()}
        self._names, self._params = list(floating), list(floating.values())
        self._shadow = [p.detach().clone() for p in self._params]
        pending, self._pending, self._saved = self._pending, None, None
        if pending is not None:
            self._restore(pending)
        self._last_step = self.model.step  # this fit's count, not the one a state was saved at

    def on_train_batch_end(self, step: int, logs: dict | None = None) -> None:
        if stepped_to(self, self.every_n_steps):  # never mid-accumulation
            with torch.no_grad():
                # shadow += (1 - decay) * (weights - shadow): one fused kernel over all tensors
                torch._foreach_lerp_(self._shadow, self._params, 1.0 - self.decay)

    def on_eval_begin(self, logs: dict | None = None) -> None:
        if self.params.get("epochs") is not None and self._saved is None:  # in a fit
            with torch.no_grad():
                self._saved = [p.detach().clone() for p in self._params]
                torch._foreach_copy_(self._params, self._shadow)

    def on_eval_end(self, logs: dict | None = None) -> None:
        if self._saved is not None:
            with torch.no_grad():
                torch._foreach_copy_(self._params, self._saved)
            self._saved = None

    def on_train_end(self, logs: dict | None = None) -> None:
        if self.swap_at_end and self._shadow is not None:
            with torch.no_grad():
                torch._foreach_copy_(self._params, self._shadow)

    # -- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The average, so that a resumed fit goes on averaging where it stopped.

        Returns:
            ``"step"``, the step the average was last updated at, and
            ``"shadow"``, a CPU copy of each parameter's average by name
            (``{}`` before training began).
        """
        if self._shadow is None:
            return dict(self._pending or {})
        shadow = {name: t.to("cpu", copy=True) for name, t in zip(self._names, self._shadow)}
        return {"step": self._last_step, "shadow": shadow}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore an average saved by :meth:`state_dict` (a resume does this).

        Before training has begun the state is kept, and ``on_train_begin``
        starts from it instead of from the weights.

        Args:
            state: what :meth:`state_dict` returned.

        Raises:
            ValueError: the saved average does not match this network's parameters.
        """
        if state and self._shadow is None:
            self._pending = dict(state)
        elif state:
            self._restore(state)

    def _restore(self, state: dict[str, Any]) -> None:
        saved = state.get("shadow")
        if not isinstance(saved, dict) or not isinstance(state.get("step"), int):
            raise ValueError(
                "EMA: load_state_dict expects what EMA.state_dict() returns, {'step': int, "
                f"'shadow': {{parameter name: tensor}}}}; received keys {sorted(state)}."
            )
        network = {name: tuple(t.shape) for name, t in zip(self._names, self._shadow)}
        missing = sorted(network.keys() - saved.keys())
        unexpected = sorted(saved.keys() - network.keys())
        wrong = [
            f"{name}: saved {tuple(v.shape) if torch.is_tensor(v) else v!r}, network {network[name]}"
            for name, v in saved.items()
            if name in network and not (torch.is_tensor(v) and v.shape == network[name])
        ]
        if missing or unexpected or wrong:
            raise ValueError(
                f"EMA: the saved average does not match this network's parameters (missing: "
                f"{missing}, unexpected: {unexpected}; shapes differ: {'; '.join(wrong) or 'none'}). "
                "It was saved from another architecture; start the average afresh (a new EMA, or "
                "delete the backup)."
            )
        with torch.no_grad():
            torch._foreach_copy_(self._shadow, [saved[name] for name in self._names])
        self._last_step = state["step"]
