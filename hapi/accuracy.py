"""Paddle's ``paddle.metric.Accuracy`` on torchmetrics (``hapi.metrics.Accuracy``).

A module of its own so that ``import hapi`` does not import torchmetrics: only a script that
uses this metric, or a torchmetrics metric of its own, pays for it.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torchmetrics


class Accuracy(torchmetrics.Metric):
    """Top-k classification accuracy, Paddle's ``paddle.metric.Accuracy``, as a torchmetrics metric.

    ``topk=(1,)`` logs ``acc``; ``topk=(1, 2)`` logs ``acc_top1`` and
    ``acc_top2``, as Paddle's ``paddle.Model`` logs them, so a Paddle script's log
    names carry over. Predictions are scores ``[N, C]``; labels are class
    indices ``[N]`` or ``[N, 1]``. Counting uses ``topk`` on the device, with
    no host sync, and the counts are summed across processes.

    Args:
        topk: the k values to count a prediction right within (an int or a
            tuple of positive ints).
        name: the logged name instead of ``acc``.
        **kwargs: passed on to ``torchmetrics.Metric`` (``sync_on_compute``, ...).

    Raises:
        ValueError: a ``topk`` that is not positive integers.

    Example:
        .. code-block:: python

            model.prepare(optimizer, loss, metrics=hapi.metrics.Accuracy(topk=(1, 5)))
            # logs acc_top1 and acc_top5
    """

    full_state_update = False
    higher_is_better = True

    def __init__(self, topk: Sequence[int] = (1,), name: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        topk = tuple(topk) if isinstance(topk, (tuple, list)) else (topk,)
        if not topk or any(not isinstance(k, int) or k < 1 for k in topk):
            raise ValueError(f"topk must be positive ints, e.g. (1,) or (1, 5); received {topk!r}.")
        self.topk = topk
        self.name = name or "acc"
        self.add_state(
            "correct", default=torch.zeros(len(topk), dtype=torch.long), dist_reduce_fx="sum"
        )
        self.add_state("total", default=torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")

    def names(self) -> list[str]:
        """The names this metric logs under, in ``topk`` order.

        Returns:
            ``[name]`` for ``topk=(1,)``, else ``[f"{name}_top{k}" for k in topk]``.
        """
        return [self.name] if self.topk == (1,) else [f"{self.name}_top{k}" for k in self.topk]

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        """Count one batch's hits (the loop calls it; call it yourself outside ``fit``).

        Args:
            preds: class scores ``[N, C]`` (logits or probabilities).
            target: class indices ``[N]`` or ``[N, 1]``.

        Raises:
            ValueError: fewer than ``max(topk)`` classes, or not as many
                labels as predictions.
        """
        if preds.ndim < 2 or preds.shape[-1] < max(self.topk):
            raise ValueError(
                f"Accuracy(topk={self.topk}) needs class scores of shape [N, C] with C >= "
                f"{max(self.topk)}; received predictions of shape {tuple(preds.shape)}."
            )
        target = target.reshape(-1)
        if target.shape[0] != preds.shape[0]:
            raise ValueError(
                f"Accuracy got {preds.shape[0]} predictions but {target.shape[0]} labels; "
                "labels must be class indices of shape [N] or [N, 1]."
            )
        top = preds.topk(max(self.topk), dim=-1).indices
        hits = (top == target.unsqueeze(-1)).cumsum(dim=-1).clamp_(max=1).sum(dim=0)
        self.correct += hits[[k - 1 for k in self.topk]]
        self.total += target.shape[0]

    def compute(self) -> dict[str, torch.Tensor]:
        """The accuracy over every batch since the last ``reset()``.

        Returns:
            ``{name: tensor}`` for each of :meth:`names`, values in ``[0, 1]``.
        """
        values = self.correct.double() / self.total.clamp(min=1)
        return dict(zip(self.names(), values))
